"""A user's optimizer that needs whole parameters (Shampoo-like preconditioners, Adafactor's
factored moments, ...), under every sharding.

An optimizer declares it with ``needs_whole_params = True`` on the object its factory returns,
or the factory is wrapped: ``tm.whole_params(factory)``. The engine then builds
:class:`WholeParams` over what its strategy hands an optimizer (ZeRO's flat shards, tp shards,
whole parameters) and sets its ``wholes`` map for the layout (:mod:`.muon_owners`): each step,
every parameter's whole value and gradient are assembled (under ZeRO at one owner rank of the
shard group, balanced over the ranks; under tp gathered over tp), the user's optimizer steps
that whole parameter, and each rank keeps its part of the result. The user's optimizer, and so
its states, is built per parameter where it steps (its owner), at its first step; its group
options (the learning rate a schedule sets included) follow the wrapper's. Element-wise
optimizers keep stepping flat shards as they are.

Checkpoints: the user's optimizer's states of each parameter are saved whole, under the
parameter's single-process name as ``get_state_dict`` names a plain optimizer's
(``optimizer.state.<name>.<key>``, of any shape: factored moments too; a Python number as DCP
keeps one, pickled), written by the rank that steps it (:meth:`WholeParams.whole_state`). On
load, under any layout, the rank that will step a parameter reads its states whole and the
user's optimizer built at its first step takes them through ``load_state_dict``
(:meth:`WholeParams.load_whole_state`). Under DiLoCo each replica's states are saved and read
back under ``replica<r>/<key>`` (as DiLoCo's own per-replica states). A fault-tolerant
replica's copy of a live one carries them too (:func:`live_states`, :func:`load_live_states`:
the tensors by name, a number as a 0-d tensor whose key says its type).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainmesh.core.errors import ConfigError

from .muon import Local

Factory = Callable[[Any], torch.optim.Optimizer]


class WholeParams(torch.optim.Optimizer):
    """``factory``'s optimizer stepping each parameter whole (module docstring)."""

    needs_whole_params = True

    def __init__(self, params, factory: Factory) -> None:
        probe = factory([nn.Parameter(torch.zeros(1))])   # its defaults: lr for the schedule
        super().__init__(params, {**probe.defaults, "whole": True})
        self.factory = factory
        self.wholes = Local()
        """Set by the engine for the layout (:func:`~.muon_owners.install`)."""
        self.inner: dict[Any, tuple[nn.Parameter, torch.optim.Optimizer]] = {}
        """Per parameter stepped here: (its whole copy, the user's optimizer over it)."""
        self.pending: dict[str, dict[str, Any]] = {}
        """Per parameter: states loaded from a checkpoint, taken at its first step here."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            options = {k: v for k, v in group.items() if k not in ("params", "whole")}
            for p in group["params"]:
                if p.grad is None:
                    continue
                new = self.wholes.map(p, [p.detach(), p.grad],
                                      lambda name, whole: self._step_whole(name or id(p), whole, options))
                p.copy_(new)
        return loss

    def _step_whole(self, key: Any, whole: list[torch.Tensor], options: dict) -> torch.Tensor:
        value, grad = whole
        if key not in self.inner:
            copy = nn.Parameter(value.clone())
            opt = self.factory([{**options, "params": [copy]}])
            saved = self.pending.pop(key, None)
            if saved is not None:
                state = opt.state_dict()
                opt.load_state_dict({**state, "state": {0: saved}})
            self.inner[key] = (copy, opt)
        copy, opt = self.inner[key]
        opt.param_groups[0].update(options)          # the schedule's lr of this step
        copy.data.copy_(value)
        copy.grad = grad.clone()
        opt.step()
        return copy.detach().clone()

    def owns(self, name: str) -> bool:
        """Whether this rank steps parameter ``name`` (and so holds its states)."""
        owns = getattr(self.wholes, "owns", None)
        return owns is None or owns(name)

    def whole_state(self) -> dict[str, dict[str, Any]]:
        """The user's optimizer's states of the parameters this rank steps, by parameter name
        (those loaded and not stepped since too): {name: {state key: whole tensor or number}}."""
        out = {name: dict(state) for name, state in self.pending.items()}
        for key, (copy, opt) in self.inner.items():
            if isinstance(key, str) and opt.state.get(copy):
                out[key] = {k: _saved(v, f"{type(opt).__name__}'s state {k!r} of {key}")
                            for k, v in opt.state[copy].items()}
        return out

    def load_whole_state(self, states: dict[str, dict[str, Any]]) -> None:
        """Take a checkpoint's states of the parameters this rank steps (the others' start
        afresh); each goes to the user's optimizer when it is built, at the parameter's next
        step here."""
        self.inner.clear()
        self.pending = {name: dict(state) for name, state in states.items()}


def _saved(value: Any, what: str) -> Any:
    """An optimizer state as a checkpoint holds it: a tensor, or a number or None (as DCP keeps
    a non-tensor value); anything else is refused naming it."""
    if value is None or torch.is_tensor(value) or isinstance(value, bool | int | float):
        return value
    raise ConfigError("optimizer", f"{what} is a {type(value).__name__}; a checkpoint holds "
                      "an optimizer's tensors, numbers and None")


LIVE = "whole/"
"""Prefix of a parameter's name among the live state's optimizer entries (:func:`live_states`)."""
_KINDS = {"t": None, "i": int, "f": float, "b": bool, "n": type(None)}
"""A live entry's key ``<kind>:<state key>``: a tensor, or a number (int, float, bool) or None
travelling as a 0-d tensor (None: an empty one) and taken back as what it was."""


def whole_parts(sync: Any) -> list[Any]:
    """``sync`` or those of its parts (DiLoCo's replica strategy, the dense and expert parts)
    whose optimizer steps whole parameters."""
    if isinstance(getattr(sync, "optimizer", None), WholeParams):
        return [sync]
    return [p for part in getattr(sync, "parts", []) for p in whole_parts(part)]


def whole_optimizers(sync: Any) -> list[WholeParams]:
    """The optimizers stepped on whole parameters of ``sync`` and of its parts."""
    return [part.optimizer for part in whole_parts(sync)]


def live_states(sync: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The whole-parameter states this rank holds, as live-state entries: {``whole/<name>``:
    {``<kind>:<key>``: a tensor of its own}} (copies: a replica copying them in the same
    process shares nothing with this one)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for opt in whole_optimizers(sync):
        for name, state in opt.whole_state().items():
            entry = out[LIVE + name] = {}
            for k, v in state.items():
                if torch.is_tensor(v):
                    entry[f"t:{k}"] = v.detach().clone()
                elif v is None:
                    entry[f"n:{k}"] = torch.zeros(0)
                else:
                    kind = "b" if isinstance(v, bool) else "i" if isinstance(v, int) else "f"
                    entry[f"{kind}:{k}"] = torch.tensor(v, dtype={"b": torch.bool, "i": torch.int64,
                                                                  "f": torch.float64}[kind])
    return out


def load_live_states(sync: Any, optim: dict[str, dict[str, torch.Tensor]]) -> None:
    """Take :func:`live_states` of the same rank of another replica (the same layout: each
    parameter's states go to the optimizer that steps it here; the others' start afresh)."""
    for opt in whole_optimizers(sync):
        states = {}
        for entry, values in optim.items():
            name = entry[len(LIVE):]
            if not entry.startswith(LIVE) or not opt.owns(name) or not _holds(opt, name):
                continue
            states[name] = {k[2:]: _taken(k[0], v) for k, v in values.items()}
        opt.load_whole_state(states)


def _holds(opt: WholeParams, name: str) -> bool:
    names = getattr(opt.wholes, "names", None)      # ByName: this part's parameters by id
    return names is None or name in names.values()


def _taken(kind: str, value: torch.Tensor) -> Any:
    if kind == "t":
        return value.clone()
    if kind == "n":
        return None
    return _KINDS[kind](value.item())


def whole_params(factory: Factory) -> Factory:
    """``factory`` whose optimizer the engine hands whole parameters under every sharding."""
    def build(params) -> torch.optim.Optimizer:
        return WholeParams(params, factory)
    return build


def declared(factory: Factory) -> Factory:
    """``factory``, or, where the optimizer it builds declares ``needs_whole_params`` and has
    no ``wholes`` map of its own, :class:`WholeParams` over it."""
    def build(params) -> torch.optim.Optimizer:
        params = list(params)
        opt = factory(params)
        if getattr(opt, "needs_whole_params", False) and not hasattr(opt, "wholes"):
            return WholeParams(params, factory)
        return opt
    return build
