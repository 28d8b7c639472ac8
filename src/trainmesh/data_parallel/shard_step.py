"""Stepping a flat shard the way torch.optim steps the parameters in it, one by one.

A ZeRO stage hands the optimizer one flat shard per parameter group, cut through many
parameters. torch.optim keeps some of its state per *parameter* — a scalar such as AdamW's
``step`` (its bias correction), NAdam's ``mu_product``, ASGD's ``eta`` — and leaves a parameter
without a gradient alone: no weight decay, no moment update, its step count unchanged. So a
parameter that took no part in a step (unused that step; an expert no token was routed to) must
not be stepped with the others, and from then on its step count differs from theirs.

:class:`ShardStepper` keeps those per-parameter scalars (``None`` for a parameter never
stepped, whose state is born on its first step, as torch.optim's is) and replaces the single
``optimizer.step()``:

- every parameter of the group took part and all share one history (the usual step): the shard
  is stepped whole, as before — one call, no copy; a group none of whose parameters took part
  (a rank's experts, every one idle) is left out of that call;
- otherwise the parameters are put in *classes* of the same history, idle ones left out, and
  each class is stepped on its own: the optimizer's group holds, for the call, one view of the
  shard per stretch of the class's parameters (views of the shard's states beside them, no
  copy), then the shard again. A class with no element on this rank is stepped on an empty view,
  so its scalars advance on every rank alike.

The scalars after a step are the same on every rank of the group (the idle parameters are agreed
on over it), so a checkpoint takes them from any rank, per parameter (:attr:`Member.scalars`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Index = Any
"""An index into a shard tensor selecting one contiguous 1-D stretch: ``(bucket, slice)`` of a
ZeRO-1/2 shard ``(n_buckets, chunk)``, a ``slice`` of a ZeRO-3 shard ``(n,)``."""
Scalars = dict[str, Any]


@dataclass
class Member:
    """One parameter of a group: its stretches of this rank's shard and its scalar states
    (``None``: never stepped). Parameters with the same history share one dict object."""

    name: str
    param: nn.Parameter
    shape: torch.Size
    ranges: list[Index] = field(default_factory=list)
    scalars: Scalars | None = None


def elementwise(value: Any, like: torch.Tensor) -> bool:
    """Whether an optimizer state is per element of ``like`` (a moment), not a scalar."""
    return torch.is_tensor(value) and value.shape == like.shape


class ShardStepper:
    """Per-parameter scalar states of the flat shards' optimizer, and the step that honours
    them (module docstring). ``groups[gi]``: the members of optimizer group ``gi``."""

    def __init__(self, groups: Sequence[list[Member]]) -> None:
        self.groups = [list(g) for g in groups]
        self.shards: list[nn.Parameter] = []
        """What the optimizer updates for each group (the shard, or its fp32 master)."""
        self.idle: set[int] = set()
        """id() of the model parameters that take no step now (no gradient on any rank)."""
        self._group_of: dict[int, int] = {}

    def bind(self, shards: Sequence[nn.Parameter]) -> None:
        """The tensors the optimizer holds, one per group, in group order."""
        self.shards = list(shards)
        self._group_of = {id(s): gi for gi, s in enumerate(self.shards)}

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """What ``optimizer.step()`` would do to each parameter, on the groups the optimizer
        holds now (a file store steps them one at a time)."""
        groups = optimizer.param_groups
        plans = [self._plan(group) for group in groups]
        held = self._hold_idle(optimizer, groups)
        try:
            self._step(optimizer, groups, plans)
        finally:
            self._put_back(optimizer, held)

    def _step(self, optimizer: torch.optim.Optimizer, groups: list[dict],
              plans: list[list[_Class] | None]) -> None:
        saved = [group["params"] for group in groups]
        if all(p is None or (len(p) <= 1 and all(c.whole for c in p)) for p in plans):
            try:                                       # the usual step: whole shards, one call
                for group, plan in zip(groups, plans):
                    if plan:
                        self._prime(optimizer, group["params"][0], plan[0])
                    elif plan is not None:             # every member idle: the group sits out
                        group["params"] = []
                optimizer.step()
            finally:
                for group, params in zip(groups, saved):
                    group["params"] = params
            for group, plan in zip(groups, plans):
                if plan:
                    self._record(optimizer, group["params"][0], plan[0])
            return
        try:
            for r in range(max(1 if p is None else len(p) for p in plans)):
                made: list[list[tuple[nn.Parameter, Index]] | None] = []
                for group, plan, params in zip(groups, plans, saved):
                    made.append(None)
                    if plan is None:                     # not a shard of ours: as it is, once
                        group["params"] = params if r == 0 else []
                    elif r >= len(plan):
                        group["params"] = []
                    elif plan[r].whole:
                        self._prime(optimizer, params[0], plan[r])
                        group["params"] = params
                    else:
                        made[-1] = self._views(optimizer, params[0], plan[r])
                        group["params"] = [v for v, _ in made[-1]]
                optimizer.step()
                for plan, params, views in zip(plans, saved, made):
                    if plan is not None and r < len(plan):
                        if views is None:
                            self._record(optimizer, params[0], plan[r])
                        else:
                            self._collect(optimizer, params[0], plan[r], views)
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params

    def _plan(self, group: dict) -> list[_Class] | None:
        """The classes of the group's members that step now, in member order (None: the group
        is not one of our shards; empty: nothing to step)."""
        params = group["params"]
        gi = self._group_of.get(id(params[0])) if len(params) == 1 else None
        if gi is None:
            return None
        if params[0].grad is None:
            return []
        members = self.groups[gi]
        if group.get("muon") or group.get("whole"):   # whole matrices: one call, idle put back
            return [_Class({}, [m for m in members if id(m.param) not in self.idle], whole=True)]
        by_history: dict[int, _Class] = {}
        for m in members:
            if id(m.param) not in self.idle:
                by_history.setdefault(id(m.scalars), _Class(m.scalars)).members.append(m)
        classes = list(by_history.values())
        if len(classes) == 1 and len(classes[0].members) == len(members):
            classes[0].whole = True
        return classes

    def _hold_idle(self, optimizer: torch.optim.Optimizer, groups: list[dict]) -> list[tuple]:
        """A group that must step whole (Muon's: its matrices are orthogonalised whole, the
        collectives the same on every rank) steps its idle members too: their stretches of the
        shard and of its moments are kept here and put back after the step."""
        held = []
        for group in groups:
            params = group["params"]
            gi = self._group_of.get(id(params[0])) if len(params) == 1 else None
            if gi is None or not (group.get("muon") or group.get("whole")) or params[0].grad is None:
                continue
            shard = params[0]
            state = optimizer.state.get(shard, {})
            for m in self.groups[gi]:
                if id(m.param) in self.idle:
                    for idx in m.ranges:
                        held.append((shard, idx, shard.data[idx].clone(),
                                     {k: v[idx].clone() for k, v in state.items() if elementwise(v, shard)}))
        return held

    @staticmethod
    def _put_back(optimizer: torch.optim.Optimizer, held: list[tuple]) -> None:
        for shard, idx, value, moments in held:
            shard.data[idx] = value
            for k, v in optimizer.state.get(shard, {}).items():
                if elementwise(v, shard):
                    v[idx] = moments[k] if k in moments else 0   # born in this step: not yet here

    @staticmethod
    def _prime(optimizer: torch.optim.Optimizer, shard: nn.Parameter, cls: _Class) -> None:
        """The shard steps whole: its scalar states are its members' (none: fresh states)."""
        if cls.scalars is None:
            optimizer.state.pop(shard, None)
        else:
            optimizer.state[shard].update(_copy(cls.scalars))

    @staticmethod
    def _record(optimizer: torch.optim.Optimizer, shard: nn.Parameter, cls: _Class) -> None:
        new = _copy({k: v for k, v in optimizer.state.get(shard, {}).items() if not elementwise(v, shard)})
        for m in cls.members:
            m.scalars = new

    @staticmethod
    def _views(optimizer: torch.optim.Optimizer, shard: nn.Parameter,
               cls: _Class) -> list[tuple[nn.Parameter, Index]]:
        """One parameter per stretch of the class's members (an empty one if this rank holds
        none), each a view of the shard, its gradient and its states viewed alike."""
        full = optimizer.state.get(shard, {})
        made = []
        for idx in [idx for m in cls.members for idx in m.ranges] or [_empty(shard)]:
            view = nn.Parameter(shard.data[idx])
            view.grad = shard.grad[idx]
            if cls.scalars is not None:
                optimizer.state[view] = {**{k: v[idx] for k, v in full.items() if elementwise(v, shard)},
                                         **_copy(cls.scalars)}
            made.append((view, idx))
        return made

    @staticmethod
    def _collect(optimizer: torch.optim.Optimizer, shard: nn.Parameter, cls: _Class,
                 made: list[tuple[nn.Parameter, Index]]) -> None:
        """Write the views' states back into the shard's (created where the class's states
        were born now), record the class's new scalars, drop the views."""
        full = optimizer.state.setdefault(shard, {})
        new: Scalars = {}
        for view, idx in made:
            for k, v in optimizer.state.pop(view, {}).items():
                if not elementwise(v, view):
                    new[k] = v
                    continue
                if not elementwise(full.get(k), shard):
                    full[k] = torch.zeros_like(shard.data, dtype=v.dtype)
                dst = full[k][idx]
                if dst.data_ptr() != v.data_ptr():
                    dst.copy_(v)
        new = _copy(new)
        full.update(_copy(new))
        for m in cls.members:
            m.scalars = new

    # ---------------------------------------------------------------- state by parameter
    def local_state(self, gi: int) -> dict[str, torch.Tensor]:
        """Group ``gi``'s scalars as flat entries (``param{i}.stepped``, ``param{i}.{key}``) for
        :meth:`load_local_state` on the same rank of another replica."""
        out = {}
        for i, m in enumerate(self.groups[gi]):
            if m.scalars is not None:
                out[f"param{i}.stepped"] = torch.ones(())
                out.update({f"param{i}.{k}": v for k, v in m.scalars.items() if torch.is_tensor(v)})
        return out

    def load_local_state(self, gi: int, entries: dict[str, torch.Tensor]) -> None:
        """Take :meth:`local_state` of another replica."""
        scalars: list[Scalars | None] = [None] * len(self.groups[gi])
        for key, v in entries.items():
            head, _, k = key.partition(".")
            if head.startswith("param") and head[5:].isdigit():
                s = scalars[int(head[5:])] = scalars[int(head[5:])] or {}
                if k != "stepped":
                    s[k] = v.clone()
        self.load(gi, scalars)

    def load(self, gi: int, scalars: Sequence[Scalars | None]) -> None:
        """Set group ``gi``'s members' scalar states (a checkpoint); members with equal values
        share one history again, so the usual step stays one call."""
        seen: dict[tuple, Scalars] = {}
        for m, s in zip(self.groups[gi], scalars):
            if s is None:
                m.scalars = None
                continue
            key = tuple(sorted((k, float(v) if torch.is_tensor(v) else v) for k, v in s.items()))
            m.scalars = seen.setdefault(key, dict(s))


@dataclass
class _Class:
    """Members that step together now: one history (``scalars``); ``whole``: every member of
    the group, so the shard steps as it is."""

    scalars: Scalars | None
    members: list[Member] = field(default_factory=list)
    whole: bool = False


def _copy(scalars: Scalars) -> Scalars:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}


def _empty(shard: torch.Tensor) -> Index:
    """An index selecting no element of ``shard``."""
    return (0, slice(0, 0)) if shard.dim() == 2 else slice(0, 0)

