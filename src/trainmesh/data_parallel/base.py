"""The seam between the engine and a data-parallel strategy (DDP, ZeRO-1/2/3).

A strategy owns how this rank's gradients are reduced over the DP axis, what the optimizer
updates, and what it holds. The engine alone drives it, through the executor's step hooks::

    for i, microbatch in enumerate(microbatches):
        strategy.before_backward(is_last=(i == m - 1))   # reduce in this backward?
        ... forward, backward ...                        # (a pipeline: expect_backwards(m) once)
    strategy.finish(scale)          # wait for reductions; grads *= scale (1 / global token count)
    sq = strategy.grad_sq_sum(counted)                   # this rank's share of ||g||^2
    strategy.clip(coef); strategy.step(); strategy.zero_grad()

What every strategy shares lives here: the options (:class:`SyncOptions`), the components
every strategy holds — which gradients are final (:class:`~.readiness.Readiness`, the pipeline's
multi-backward bookkeeping included) and the reductions in flight with their transient memory
(:class:`~.inflight.Reductions`) — and the scaling, clipping and overflow check of the reduced
gradients (:meth:`GradSync.reduced_grads`). Bucketed strategies also hold a
:class:`~.buckets.Bucketer`. :func:`~trainmesh.data_parallel.make_grad_sync` composes them.

A strategy covers the parameters it is given over the group ``options.axis``: several can live
side by side on disjoint parameter subsets (e.g. dense parameters over ``dp``, experts' over
``edp``), each with its own hooks, buckets and collectives.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainmesh.core.errors import ConfigError

from ..comm import Comm
from .inflight import Reductions
from .master import MasterWeights
from .readiness import Readiness

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
# (name, parameter) -> does this rank count it in the global gradient norm? (TP duplicates: once)
CountedFn = Callable[[str, nn.Parameter], bool]


@dataclass(frozen=True)
class SyncOptions:
    """What every data-parallel strategy is built with."""

    bucket_mb: float = 25.0
    """Gradient bucket size in MiB (all-reduce or reduce-scatter granularity)."""
    find_unused_parameters: bool = False
    """Reduce the gradients of parameters that received none instead of raising an error."""
    reduce_dtype: torch.dtype | None = None
    """dtype the gradients are reduced in (mixed precision); None: the gradients' own."""
    param_dtype: torch.dtype | None = None
    """Mixed precision at ZeRO 0-2: the dtype the model holds its parameters and gradients in,
    fp32 masters kept with the optimizer (:mod:`.master`); None: the parameters are the masters."""
    device: torch.device | None = None
    """Where the strategy's buffers live; None: the parameters' device (sharded init: ZeRO-3
    meets parameters still on the meta device)."""
    offload: str = "none"
    """ZeRO >= 1: ``cpu`` or ``nvme`` keeps the fp32 masters and optimizer states of this rank's
    shard off the device and steps them on the CPU (:mod:`.offload`)."""
    offload_dir: str | None = None
    """``nvme``: the directory of the state files (None: a fresh one under the temp dir)."""
    offload_params: bool = False
    """ZeRO-3 with offload: the parameter shards live in host memory too."""
    axis: str = "dp"
    """The mesh group the gradients are reduced (and ZeRO's states sharded) over: ``dp``, or a
    derived group of :class:`~trainmesh.core.mesh.ParallelMesh` (``dp_cp`` under context
    parallelism, ``edp`` for expert parameters, ``dp_shard`` under HSDP)."""
    replicate_axis: str | None = None
    """HSDP: the group across which ZeRO's shards are replicated (``dp_replicate``): each
    reduced gradient shard is all-reduced over it. None: no replicas."""


def unique_named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters in registration order, each shared parameter once (first name)."""
    seen: set[int] = set()
    out = []
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def frozen_named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters that take no gradient (``requires_grad=False``) in registration order, each
    shared one once: no gradient sync, no optimizer, never sharded by a DP strategy."""
    return [(name, p) for name, p in module.named_parameters() if not p.requires_grad]


def untrained_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a checkpoint holds beside the strategy's state: the frozen parameters, then the
    persistent buffers (BatchNorm statistics), in registration order."""
    buffers = [(name, b) for name, b in module.named_buffers()
               if name.rpartition(".")[2] not in _owner(module, name)._non_persistent_buffers_set]
    return [*frozen_named_parameters(module), *buffers]


def _owner(module: nn.Module, name: str) -> nn.Module:
    path = name.rpartition(".")[0]
    return module.get_submodule(path) if path else module


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
    """A data-parallel strategy over one mesh group (``options.axis``, the DP axis by default)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], comm: Comm,
                 options: SyncOptions | None = None) -> None:
        self.named_params = named_params
        self.comm = comm
        self.options = options or SyncOptions()
        self.axis = self.options.axis
        self.dp = comm.mesh.size(self.axis)
        self.device = self.options.device or (named_params[0][1].device if named_params
                                              else torch.device("cpu"))
        self.optimizer: torch.optim.Optimizer | None = None
        self.master: MasterWeights | None = None         # mixed precision at ZeRO 0-2
        self.readiness = Readiness(named_params, find_unused=self.options.find_unused_parameters)
        self.reductions = Reductions(comm, self.axis, self.device,
                                     replicate=self.options.replicate_axis)

    @property
    def comm_buffer_peak_bytes(self) -> int:
        """Peak bytes of transient communication memory (:class:`~.inflight.Reductions`)."""
        return self.reductions.peak_bytes

    @property
    def replicas(self) -> int:
        """HSDP: how many replicas of each shard (1 without)."""
        axis = self.options.replicate_axis
        return self.comm.mesh.size(axis) if axis else 1

    def _check_unused(self) -> None:
        """Raise naming the parameters without a gradient in this step's backwards (unless
        the options ask to reduce them anyway)."""
        self.readiness.check_unused(self.comm.mesh.rank)

    def local_unused(self) -> int:
        """How many of this rank's parameters received no gradient in this step (0 unless
        ``find_unused_parameters``: otherwise :meth:`_check_unused` raises)."""
        return self.readiness.local_unused()

    def unused_counts(self) -> list[int]:
        """:meth:`local_unused` per strategy part (one here; a composite: one per part): the
        engine sums them over the world along with the loss."""
        return [self.local_unused()]

    def agree_unused(self, anywhere: Sequence[bool], across: Callable[[torch.Tensor], None] | None = None
                     ) -> None:
        """The unused check: ``anywhere`` (per part of :meth:`unused_counts`: some rank of the
        world has an unused parameter of it, from the engine's one reduction of the step's
        totals) costs one all-reduce over the group of a flag per parameter (and ``across``
        the fault-tolerant replicas present); a parameter no rank of the group used gets no
        update this step (:meth:`step`), one used on some ranks keeps its reduced gradient, as
        DDP's ``find_unused_parameters``."""
        self.readiness.agree(any(anywhere), self.comm, self.axis, self.device,
                             replicate=self.reductions.replicate, across=across)

    def pass_unreached(self, reached: set[int], among: set[int] | None = None) -> None:
        """Before a backward pass (unused parameters allowed): the parameters it goes through
        (``among``: id()s, None: all) that its graph does not reach (``reached``: id()s) pass it
        at once, without a gradient, so that buckets and units complete as on the ranks where
        they take part (:mod:`.readiness`)."""
        for p in self.readiness.unreached(reached, among):
            self._no_grad(p)

    def _no_grad(self, p: nn.Parameter) -> None:
        """``p`` sits out this backward pass (strategies that count gradients into buckets)."""
        self.readiness.passed(p)

    @property
    def _unused(self) -> list[nn.Parameter]:
        return self.readiness.unused

    def _end_step(self) -> None:
        """``zero_grad``: the next step starts with no parameter used."""
        self.readiness.end_step()

    @abstractmethod
    def build_optimizer(self, factory: OptimizerFactory,
                        options: Callable[[str], dict] | None) -> torch.optim.Optimizer:
        """Call the user's factory with the parameters (or flat shards) this rank updates."""

    @abstractmethod
    def before_backward(self, *, is_last: bool) -> None:
        """Called before each microbatch's backward; reduce only when ``is_last`` (or per stage)."""

    def expect_backwards(self, n: int, held: Sequence[nn.Parameter] = ()) -> None:
        """Pipeline mode: this step runs ``n`` backward passes through every parameter (in any
        interleaving of stages); reduce each gradient once it has been through all ``n``, and
        those of ``held`` (weights tied across stages) once :meth:`release` is called for them.
        Replaces the per-microbatch ``before_backward`` calls. Strategies without a pipeline
        mode override it with :meth:`_no_pipeline`."""
        self.before_backward(is_last=True)
        self.readiness.expect(n, held)

    def release(self, p: nn.Parameter) -> None:
        """A gradient held back by :meth:`expect_backwards` is final now: reduce it as after
        its last backward (the pipeline summed it over the stages sharing the weight first)."""
        if self.readiness.holds(p):
            self._on_grad_ready(p)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """The post-accumulate-grad hook of strategies that reduce whole gradients after their
        last backward (DDP, ZeRO-1); others never hold a gradient back."""
        raise ConfigError("pp", f"{type(self).__name__} cannot hold back the gradient of a weight "
                                "tied across pipeline stages (--zero 0 or 1)")

    def _no_pipeline(self) -> None:
        raise ConfigError("pp", f"{type(self).__name__} cannot run under a pipeline (--pp > 1)")

    @abstractmethod
    def finish(self, scale: float) -> None:
        """Wait for every reduction of this step; multiply the reduced gradients by ``scale``."""

    @abstractmethod
    def grad_sq_sum(self, counted: CountedFn) -> torch.Tensor:
        """Sum of squares of the gradient entries this rank contributes to the global norm."""

    def _pending_sq(self) -> float:
        """What a sum of squares of the held gradients is multiplied by (the deferred scale)."""
        return self.master.scale ** 2 if self.master is not None else 1.0

    def _optimizer_step(self) -> None:
        assert self.optimizer is not None, "build_optimizer first"
        if self.master is not None:
            self.master.step(self.optimizer)
        else:
            self.optimizer.step()

    def grads_of(self, names: Sequence[str]) -> list[torch.Tensor]:
        """After ``finish``: the tensors holding this rank's reduced gradient of the parameters
        ``names``, in that order (here their whole ``.grad``; ZeRO: their pieces of the
        gradient shard). Changing them changes what the optimizer reads."""
        by_name = dict(self.named_params)
        return [by_name[n].grad for n in names if n in by_name and by_name[n].grad is not None]

    @abstractmethod
    def reduced_grads(self) -> list[torch.Tensor]:
        """The tensors holding this rank's reduced gradient (what the optimizer reads)."""

    def _scale(self, factor: float) -> None:
        if self.master is not None:     # applied in fp32, when unscaled into the masters
            self.master.scale *= factor
            return
        if factor != 1.0:
            for g in self.reduced_grads():
                g.mul_(factor)

    def clip(self, coef: float) -> None:
        """Multiply this rank's gradients by ``coef``."""
        self._scale(coef)

    def grads_finite(self) -> torch.Tensor:
        """1.0 if every gradient entry this rank holds is finite, else 0.0 (fp16 overflow check)."""
        flags = [torch.isfinite(g).all() for g in self.reduced_grads()]
        return torch.stack(flags).all().float() if flags else torch.ones(())

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

    def offloaded_bytes(self) -> dict[str, int]:
        """Model-state bytes this rank keeps off the compute device: {"cpu", "nvme"}."""
        return {"cpu": 0, "nvme": 0}

    # ---------------------------------------------------------------- live state (fault tolerance)
    def live_state(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
        """What a replica that copies the live state gets from this rank (the same rank of it
        takes it with :meth:`load_live_state`): here the parameters and optimizer states by
        name, whole along the group (:meth:`logical_state`); sharded strategies: their shards."""
        params, optim = self.logical_state()
        return list(params.items()), optim

    def load_live_state(self, params: dict[str, torch.Tensor],
                        optim: dict[str, dict[str, torch.Tensor]]) -> None:
        """Take :meth:`live_state` of the same rank of another replica (the same layout)."""
        self.load_logical_state(params, optim)

    # ---------------------------------------------------------------- what a step reduces and reports
    # The engine's step knows no strategy by name: where one differs (DiLoCo: each replica
    # averages over its own tokens and clips by its own norm), it overrides these.
    def extra_sums(self, count: float) -> list[float]:
        """Values riding along the engine's one world all-reduce of the step's loss and token
        count (``count``: this rank's tokens, 0 where it holds no loss); none here."""
        return []

    def token_total(self, tokens: float, sums: Sequence[float]) -> float:
        """The token count the gradients are averaged over, given the world's ``tokens`` and
        the world's sums of :meth:`extra_sums` (``sums``): every token of the global batch."""
        return tokens

    def norm(self, counted: CountedFn, global_norm: Callable[[], float]) -> float:
        """The gradient norm the step clips by and checks for non-finite values: the global
        one (``global_norm()``, a world all-reduce)."""
        return global_norm()

    def step_metrics(self, grad_norm: float) -> dict[str, Any]:
        """What a step's metrics say of it (after :meth:`step`): the gradient norm before
        clipping, and whatever the strategy adds."""
        return {"grad_norm": grad_norm}

    # ---------------------------------------------------------------- the optimizer's tensors
    # What the optimizer updates (fp32 in every precision: the parameters, their fp32 masters,
    # or ZeRO's flat shards of them), for a step taken outside it (DiLoCo's outer step).
    def optimizer_params(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates, in its parameter-group order."""
        assert self.optimizer is not None, "build_optimizer first"
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @abstractmethod
    def logical_of(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors laid out like :meth:`optimizer_params` -> each parameter's whole value by
        name (ZeRO: a collective over the strategy's group)."""

    @abstractmethod
    def shards_from(self, whole: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Whole values by parameter name -> tensors laid out like :meth:`optimizer_params`
        (this rank's shard)."""

    def resident(self) -> Any:
        """A context in which the optimizer's parameters and states are in memory (offload)."""
        return nullcontext()

    def params_changed(self) -> None:
        """The optimizer's parameters were written from outside: make the model's parameters
        follow (16-bit copies of fp32 masters; ZeRO-1/2: gathered whole again)."""
        if self.master is not None:
            self.master.copy_to_params()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The consolidated weights, where the strategy shards the parameters themselves
        (ZeRO-3: a collective over DP); None where the module's own tensors are whole along DP."""
        return None
