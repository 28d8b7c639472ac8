"""Two data-parallel strategies in one: the dense parameters over DP, the experts over ``edp``.

Under expert parallelism the replicated (dense) parameters see every DP rank's tokens and are
reduced over ``dp``; an expert's parameters live on the ranks of one ``ep`` index and saw, through
the all-to-all, the tokens of their whole ``ep`` group: their gradients are reduced over ``edp``
(the ranks holding the same experts, dp / ep of them), and ZeRO shards their states over it.
:class:`ExpertSplitSync` holds one strategy of the same kind for each subset and presents them
to the engine as one :class:`~trainmesh.data_parallel.base.GradSync`: every call goes to the
dense strategy, then the expert one, in that order on every rank. The optimizer the user's
factory builds is made once per subset; :class:`CombinedOptimizer` shows them as one (its
``param_groups`` are both optimizers' own groups, so a learning-rate schedule drives both).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from trainmesh.data_parallel.base import CountedFn, GradSync, OptimizerFactory


class CombinedOptimizer(torch.optim.Optimizer):
    """The optimizers of several strategies as one; ``step()`` steps the strategies (optimizer
    step, then whatever makes their parameters whole)."""

    def __init__(self, syncs: list[GradSync]) -> None:   # no super().__init__: no params of its own
        self.syncs = syncs
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


class ExpertSplitSync(GradSync):
    """The dense strategy and the expert strategy behind one interface (module docstring)."""

    def __init__(self, dense: GradSync, experts: GradSync) -> None:
        super().__init__(dense.named_params + experts.named_params, dense.comm, dense.options)
        self.parts = [dense, experts]
        self.dense, self.experts = dense, experts

    def build_optimizer(self, factory: OptimizerFactory,
                        options: Callable[[str], dict] | None) -> torch.optim.Optimizer:
        for part in self.parts:
            part.build_optimizer(factory, options)
        self.optimizer = CombinedOptimizer(self.parts)
        return self.optimizer

    def before_backward(self, *, is_last: bool) -> None:
        for part in self.parts:
            part.before_backward(is_last=is_last)

    def expect_backwards(self, n: int) -> None:
        for part in self.parts:
            part.expect_backwards(n)

    def local_unused(self) -> int:
        return sum(part.local_unused() for part in self.parts)

    def agree_unused(self, anywhere: bool) -> None:
        for part in self.parts:
            part.agree_unused(anywhere)

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
        for part in self.parts:          # collectives: the dense strategy's first, on every rank
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

    def offloaded_bytes(self) -> dict[str, int]:
        out = [part.offloaded_bytes() for part in self.parts]
        return {k: sum(o[k] for o in out) for k in out[0]}

    @property
    def comm_buffer_peak_bytes(self) -> int:      # type: ignore[override]
        return sum(part.comm_buffer_peak_bytes for part in self.parts)

    @comm_buffer_peak_bytes.setter
    def comm_buffer_peak_bytes(self, value: int) -> None:   # GradSync.__init__ sets it
        pass
