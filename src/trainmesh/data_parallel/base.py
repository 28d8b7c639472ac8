"""The seam between the engine and a data-parallel strategy (DDP, ZeRO-1/2/3).

A strategy owns how this rank's gradients are reduced over the DP axis, what the optimizer
updates, and what it holds. The engine drives one step as::

    for i, microbatch in enumerate(microbatches):
        strategy.before_backward(is_last=(i == m - 1))   # reduce in this backward?
        ... forward, backward ...
    strategy.finish(scale)          # wait for reductions; grads *= scale (1 / global token count)
    sq = strategy.grad_sq_sum(counts)                    # this rank's share of ||g||^2
    strategy.clip(coef); strategy.step(); strategy.zero_grad()
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..comm import Comm
from ..errors import ConfigError

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
# (name, parameter) -> does this rank count it in the global gradient norm? (TP duplicates: once)
CountsFn = Callable[[str, nn.Parameter], bool]


def unique_named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters in registration order, each shared parameter once (first name)."""
    seen: set[int] = set()
    out = []
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def group_parameters(named: list[tuple[str, nn.Parameter]],
                     options: Callable[[str], dict] | None) -> list[tuple[dict, list[tuple[str, nn.Parameter]]]]:
    """Split parameters into optimizer groups by the options ``options(name)`` gives them."""
    groups: dict[tuple, tuple[dict, list]] = {}
    for name, p in named:
        opts = dict(options(name)) if options else {}
        key = tuple(sorted(opts.items()))
        groups.setdefault(key, (opts, []))[1].append((name, p))
    return list(groups.values())


class GradSync(ABC):
    """A data-parallel strategy over the mesh's DP axis."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], comm: Comm) -> None:
        self.named_params = named_params
        self.comm = comm
        self.dp = comm.mesh.size("dp")
        self.optimizer: torch.optim.Optimizer | None = None
        self.comm_buffer_peak_bytes = 0
        self._ready: set[int] = set()                   # params whose gradient is final
        self._remaining: dict[int, int] | None = None   # pipeline mode: backwards left per param

    def _grad_final(self, p: nn.Parameter) -> bool:
        """Bookkeeping of a post-accumulate-grad hook: whether ``p``'s gradient is now final for
        this backward (in pipeline mode: after all its expected backward passes)."""
        if self._remaining is not None:
            self._remaining[id(p)] -= 1
            if self._remaining[id(p)] > 0:
                return False
        self._ready.add(id(p))
        return True

    @abstractmethod
    def build_optimizer(self, factory: OptimizerFactory,
                        options: Callable[[str], dict] | None) -> torch.optim.Optimizer:
        """Call the user's factory with the parameters (or flat shards) this rank updates."""

    @abstractmethod
    def before_backward(self, *, is_last: bool) -> None:
        """Called before each microbatch's backward; reduce only when ``is_last`` (or per stage)."""

    def expect_backwards(self, n: int) -> None:
        """Pipeline mode: this step runs ``n`` backward passes through every parameter (in any
        interleaving of stages); reduce each gradient once it has been through all ``n``.
        Replaces the per-microbatch ``before_backward`` calls. Strategies without a pipeline
        mode refuse it."""
        raise ConfigError("pp", f"{type(self).__name__} cannot run under a pipeline (--pp > 1)")

    @abstractmethod
    def finish(self, scale: float) -> None:
        """Wait for every reduction of this step; multiply the reduced gradients by ``scale``."""

    @abstractmethod
    def grad_sq_sum(self, counts: CountsFn) -> torch.Tensor:
        """Sum of squares of the gradient entries this rank contributes to the global norm."""

    @abstractmethod
    def clip(self, coef: float) -> None:
        """Multiply this rank's gradients by ``coef``."""

    @abstractmethod
    def step(self) -> None:
        """Optimizer step, then whatever makes the parameters whole again (ZeRO all-gather)."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Zero the gradient buffers (never set them to None: they are views)."""

    @abstractmethod
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The persistent tensors this rank keeps: {"params", "grads", "optimizer"}."""

    @abstractmethod
    def logical_state(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
        """Checkpointing: this rank's parameters and optimizer states by parameter name, whole
        along the DP axis (collective over DP for sharded strategies): ({name: param},
        {name: {state key: tensor}})."""

    @abstractmethod
    def load_logical_state(self, params: dict[str, torch.Tensor],
                           optim: dict[str, dict[str, torch.Tensor]]) -> None:
        """Checkpointing: take whole-along-DP parameters and optimizer states by name (each
        rank keeps its shard)."""

    def grads_finite(self) -> torch.Tensor:
        """1.0 if every gradient entry this rank holds is finite, else 0.0 (fp16 overflow check)."""
        flags = [torch.isfinite(t).all() for t in self.held_tensors()["grads"]]
        return torch.stack(flags).all().float() if flags else torch.ones(())
