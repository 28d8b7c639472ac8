"""Several strategies shown as one: each over its own parameter subset and mesh group.

:class:`CompositeSync` holds strategies built over disjoint parameter subsets (e.g. the dense
parameters over ``dp`` and the experts over ``edp``, each a DDP, ZeRO-1/2 or ZeRO-3 strategy
of :func:`~trainmesh.data_parallel.make_grad_sync`) and presents them to the engine as one
:class:`~.base.GradSync`: every call goes to each part in order — the same order on every
rank, so their collectives never interleave differently. The optimizer the user's factory
builds is made once per part; :class:`CombinedOptimizer` shows them as one (its
``param_groups`` are the parts' own groups, so a learning-rate schedule drives every part).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from .base import CountedFn, GradSync, OptimizerFactory


class CombinedOptimizer(torch.optim.Optimizer):
    """The optimizers of several strategies as one; ``step()`` steps the strategies (optimizer
    step, then whatever makes their parameters whole)."""

    def __init__(self, syncs: Sequence[GradSync]) -> None:   # no super().__init__: no params of its own
        self.syncs = list(syncs)
        self.parts = [s.optimizer for s in syncs]
        self.defaults = dict(self.parts[0].defaults)
        self.param_groups = [g for o in self.parts for g in o.param_groups]
        self.state = {k: v for o in self.parts for k, v in o.state.items()}
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}

    def step(self, closure=None):   # noqa: ARG002 - the strategies run their own optimizers
        for sync in self.syncs:
            sync.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for sync in self.syncs:
            sync.zero_grad()


class CompositeSync(GradSync):
    """The strategies ``parts`` (disjoint parameter subsets) behind one interface."""

    def __init__(self, parts: Sequence[GradSync]) -> None:
        super().__init__([np for part in parts for np in part.named_params], parts[0].comm,
                         parts[0].options)
        self.parts = list(parts)

    def build_optimizer(self, factory: OptimizerFactory,
                        options: Callable[[str], dict] | None) -> torch.optim.Optimizer:
        for part in self.parts:
            part.build_optimizer(factory, options)
        self.optimizer = CombinedOptimizer(self.parts)
        return self.optimizer

    def before_backward(self, *, is_last: bool) -> None:
        for part in self.parts:
            part.before_backward(is_last=is_last)

    def expect_backwards(self, n: int, held: Sequence[nn.Parameter] = ()) -> None:
        for part in self.parts:
            part.expect_backwards(n, held)

    def release(self, p: nn.Parameter) -> None:
        for part in self.parts:
            part.release(p)

    def local_unused(self) -> int:
        return sum(part.local_unused() for part in self.parts)

    def unused_counts(self) -> list[int]:
        return [n for part in self.parts for n in part.unused_counts()]

    def agree_unused(self, anywhere: Sequence[bool], across: Callable[[torch.Tensor], None] | None = None
                     ) -> None:
        at = 0
        for part in self.parts:          # only a part with an unused parameter somewhere talks
            n = len(part.unused_counts())
            part.agree_unused(anywhere[at : at + n], across)
            at += n

    def pass_unreached(self, reached: set[int], among: set[int] | None = None) -> None:
        for part in self.parts:
            part.pass_unreached(reached, among)

    def finish(self, scale: float) -> None:
        for part in self.parts:
            part.finish(scale)

    def grad_sq_sum(self, counted: CountedFn) -> torch.Tensor:
        return sum((part.grad_sq_sum(counted).reshape(()).double() for part in self.parts),
                   torch.zeros((), dtype=torch.float64))

    def grads_of(self, names) -> list[torch.Tensor]:
        return [g for part in self.parts for g in part.grads_of(names)]

    def reduced_grads(self) -> list[torch.Tensor]:
        return [g for part in self.parts for g in part.reduced_grads()]

    def clip(self, coef: float) -> None:
        for part in self.parts:
            part.clip(coef)

    def grads_finite(self) -> torch.Tensor:
        return torch.stack([part.grads_finite().reshape(()).float() for part in self.parts]).min()

    def step(self) -> None:
        assert self.optimizer is not None, "build_optimizer first"
        self.optimizer.step()      # steps the parts (so an LR schedule sees its optimizer step)

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = [part.held_tensors() for part in self.parts]
        return {k: [t for h in held for t in h[k]] for k in held[0]}

    def logical_state(self):
        params: dict[str, torch.Tensor] = {}
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for part in self.parts:          # collectives: part by part, on every rank
            p, o = part.logical_state()
            params.update(p)
            optim.update(o)
        return params, optim

    def load_logical_state(self, params: dict[str, torch.Tensor],
                           optim: dict[str, dict[str, torch.Tensor]]) -> None:
        for part in self.parts:
            names = [n for n, _ in part.named_params]
            part.load_logical_state({n: params[n] for n in names if n in params},
                                    {n: optim[n] for n in names if n in optim})

    def live_state(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
        """Each part's :meth:`~.base.GradSync.live_state`, named ``part<i>/...``."""
        params: list[tuple[str, torch.Tensor]] = []
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for i, part in enumerate(self.parts):   # collectives (whole along a group): part by part
            p, o = part.live_state()
            params += [(f"part{i}/{n}", t) for n, t in p]
            optim.update({f"part{i}/{n}": v for n, v in o.items()})
        return params, optim

    def load_live_state(self, params: dict[str, torch.Tensor],
                        optim: dict[str, dict[str, torch.Tensor]]) -> None:
        for i, part in enumerate(self.parts):   # collectives: part by part, on every rank
            mine = f"part{i}/"
            part.load_live_state({n[len(mine):]: t for n, t in params.items() if n.startswith(mine)},
                                 {n[len(mine):]: v for n, v in optim.items() if n.startswith(mine)})

    def optimizer_params(self) -> list[torch.Tensor]:
        return [t for part in self.parts for t in part.optimizer_params()]

    def logical_of(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        out, at = {}, 0
        for part in self.parts:          # collectives: part by part, on every rank
            n = len(part.optimizer_params())
            out.update(part.logical_of(tensors[at : at + n]))
            at += n
        return out

    def shards_from(self, whole: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [t for part in self.parts for t in part.shards_from(whole)]

    def resident(self) -> Any:
        stack = ExitStack()
        for part in self.parts:
            stack.enter_context(part.resident())
        return stack

    def params_changed(self) -> None:
        for part in self.parts:
            part.params_changed()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Each part's consolidated weights (ZeRO-3: collectives, part by part), every
        parameter taken from the part that holds it; None where no part shards parameters."""
        fulls = [part.full_state_dict() for part in self.parts]
        if all(f is None for f in fulls):
            return None
        merged = dict(next(f for f in fulls if f is not None))
        for part, full in zip(self.parts, fulls):
            if full is not None:
                merged.update({n: full[n] for n, _ in part.named_params if n in full})
        return merged

    def offloaded_bytes(self) -> dict[str, int]:
        out = [part.offloaded_bytes() for part in self.parts]
        return {k: sum(o[k] for o in out) for k in out[0]}

    @property
    def comm_buffer_peak_bytes(self) -> int:      # type: ignore[override]
        return sum(part.comm_buffer_peak_bytes for part in self.parts)
