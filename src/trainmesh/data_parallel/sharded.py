"""What every ZeRO stage shares: an element-wise optimizer over flat shards, the gradient norm
counted once per shard element, clipping and the overflow check on the shards, and the
bookkeeping of transient communication memory.

A stage subclass builds, in :meth:`ShardedSync._setup`, one flat shard ``nn.Parameter`` per
optimizer group (what this rank updates) with its ``.grad`` (the reduced gradient shard), and
lists which parameter each stretch of the gradient shard belongs to (for the norm). For
checkpoints it says how to gather a shard-shaped tensor whole (``_whole``) and how to cut this
rank's shard out of whole tensors (``_take_shard``).
"""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from trainmesh.core.dtypes import wide
from trainmesh.core.errors import ConfigError

from ..comm import Comm
from .base import CountedFn, GradSync, OptimizerFactory, SyncOptions, group_parameters
from .flat import Slot
from .offload import HostMaster, make_store
from .shard_step import Index, Member, ShardStepper, elementwise

# Optimizers whose update of an element depends only on that element's own history: they can
# update any flat piece of a parameter. Anything else (LBFGS, Adafactor, Muon, ...) cannot.
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.ASGD, torch.optim.Rprop)

Groups = list[tuple[dict, list[tuple[str, nn.Parameter]]]]


def check_elementwise(optimizer: torch.optim.Optimizer, stage: int) -> None:
    """Refuse an optimizer ZeRO cannot shard (a class may opt in with ``elementwise = True``;
    one that needs whole parameters and takes a ``wholes`` map, Muon or a wrapped optimizer, is
    given them there: :mod:`.muon_owners`)."""
    if (isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) or getattr(optimizer, "elementwise", False)
            or (getattr(optimizer, "needs_whole_params", False) and hasattr(optimizer, "wholes"))):
        return
    valid = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    raise ConfigError("optimizer", f"--zero {stage} updates flat shards that cut through parameters, "
                      f"so it needs an element-wise optimizer ({valid}); got {type(optimizer).__name__} "
                      "(use --zero 0 for it)")


class ShardedSync(GradSync):
    """Base of the ZeRO stages over the strategy's mesh group (``options.axis``)."""

    stage = 0

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], comm: Comm,
                 options: SyncOptions | None = None) -> None:
        super().__init__(named_params, comm, options)
        self.bucket_bytes = int(self.options.bucket_mb * 2**20)
        self.reduce_dtype = self.options.reduce_dtype
        self.rank_in_dp = comm.mesh.index(self.axis)
        self.shard_params: list[nn.Parameter] = []      # one per optimizer group
        self.grad_shards: list[torch.Tensor] = []       # its reduced gradient (its .grad unless mixed)
        self._norm_pieces: list[tuple[str, nn.Parameter, torch.Tensor]] = []
        self.offloaded: HostMaster | None = None         # --offload cpu / nvme
        self.stepper = ShardStepper([])                  # per-parameter steps (build_optimizer)

    # ---------------------------------------------------------------- set-up
    @abstractmethod
    def _setup(self, groups: Groups) -> None:
        """Build the flat buffers and, per group, ``self.shard_params``, ``self.grad_shards``
        and ``self._norm_pieces``: (name, parameter, view of the gradient shard)."""

    def build_optimizer(self, factory: OptimizerFactory,
                        options: Callable[[str], dict] | None = None) -> torch.optim.Optimizer:
        groups = group_parameters(self.named_params, options)
        for _, named in groups:
            dtypes = {p.dtype for _, p in named}
            if len(dtypes) > 1:
                raise ConfigError("model", f"ZeRO needs one dtype per parameter group; got {sorted(map(str, dtypes))}")
        self._setup(groups)
        if self.options.offload != "none":
            self._offload()
        self.stepper = ShardStepper([
            [Member(s.name, s.param, s.shape, self._ranges(gi).get(id(s.param), [])) for s in self._slots(gi)]
            for gi in range(len(self.shard_params))])
        self.stepper.bind(self.shard_params)
        if len(groups) == 1 and not groups[0][0]:
            optimizer = factory([self.shard_params[0]])
        else:
            optimizer = factory([{**opts, "params": [sp]} for (opts, _), sp in zip(groups, self.shard_params)])
        check_elementwise(optimizer, self.stage)
        self.optimizer = optimizer
        return optimizer

    def _offload(self) -> None:
        """The optimizer's parameters become host fp32 masters of the shards (:mod:`.offload`)."""
        lows = self.master.lows if self.master is not None else [sp.data for sp in self.shard_params]
        store = make_store(self.options.offload, directory=self.options.offload_dir,
                           rank=self.comm.mesh.rank)
        self.offloaded = HostMaster(self.shard_params, lows, self.grad_shards, store=store,
                                    device=self.device)
        self.master = self.offloaded
        self.shard_params = self.offloaded.masters
        self.reductions.on_final = self.offloaded.stream   # stream each final shard slice
        self.reductions.eager = True                       # ... as soon as it has landed

    def resident(self) -> Any:
        return self._resident()

    def params_changed(self) -> None:
        super().params_changed()
        self._after_load()

    def optimizer_params(self) -> list[torch.Tensor]:
        return list(self.shard_params)

    def logical_of(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {slot.name: value.clone() for gi, t in enumerate(tensors) for slot, value in self._whole(gi, t)}

    @torch.no_grad()
    def shards_from(self, whole: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for gi, sp in enumerate(self.shard_params):
            dst = torch.zeros_like(sp.data)
            self._take_shard(gi, {id(s.param): whole[s.name] for s in self._slots(gi) if s.name in whole}, dst)
            out.append(dst)
        return out

    def _resident(self) -> Any:
        """Offloaded states in host memory for the duration (checkpoints)."""
        return self.offloaded.resident(self.optimizer) if self.offloaded is not None else nullcontext()

    def _reset_master(self) -> None:
        """After a step (or a skipped one): no deferred gradient factor, no host gradients."""
        if self.master is not None:
            self.master.scale = 1.0
        if self.offloaded is not None:
            self.offloaded.discard_grads()

    def _backward_done(self) -> None:
        """``finish`` begins: the offloaded shards note how much of them streamed in backward."""
        if self.offloaded is not None:
            self.offloaded.backward_done()

    def _scale(self, factor: float) -> None:
        if self.offloaded is not None:   # the reductions are done: copy what did not stream
            self.offloaded.prefetch_grads()
        super()._scale(factor)

    def offloaded_bytes(self) -> dict[str, int]:
        if self.offloaded is None:
            return super().offloaded_bytes()
        return self.offloaded.offloaded_bytes(self.optimizer)

    # ---------------------------------------------------------------- step
    @property
    def shard_grads(self) -> list[torch.Tensor]:
        return self.grad_shards

    def reduced_grads(self) -> list[torch.Tensor]:
        return self.shard_grads

    def grads_of(self, names: Sequence[str]) -> list[torch.Tensor]:
        pieces: dict[str, list[torch.Tensor]] = {}
        for name, _, view in self._norm_pieces:
            pieces.setdefault(name, []).append(view)
        out = [v for n in names for v in pieces.get(n, [])]
        if self.offloaded is not None:   # the host copies were taken in backward: again at the step
            held = {v.untyped_storage().data_ptr() for v in out}
            for gi, g in enumerate(self.grad_shards):
                if g.untyped_storage().data_ptr() in held:
                    self.offloaded.restream(gi)
        return out

    def grad_sq_sum(self, counted: CountedFn) -> torch.Tensor:
        # Shards are disjoint over the group: every rank contributes its own elements, each
        # once; under HSDP the replicas hold the same shard and only the first one counts it.
        if self.reductions.replicate and self.comm.mesh.index(self.reductions.replicate) != 0:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        flags = [counted(name, p) for name, p, _ in self._norm_pieces]
        if all(flags):   # padding is zero, so the whole shard is the same sum
            parts = [g.to(wide(g.dtype)).pow(2).sum() for g in self.shard_grads]
        else:
            parts = [v.to(wide(v.dtype)).pow(2).sum() for (_, _, v), f in zip(self._norm_pieces, flags) if f]
        total = torch.stack(parts).sum() if parts else torch.zeros((), device=self.device)
        return total * self._pending_sq()

    def step(self) -> None:
        """The optimizer step on the flat shards, parameter by parameter as torch.optim steps
        them (:mod:`.shard_step`): a parameter no rank of the group used this step is left
        alone (value, states, step count), then :meth:`_after_step`."""
        assert self.optimizer is not None, "build_optimizer first"
        self.stepper.idle = {id(p) for p in self._unused}
        if self.master is not None:
            self.master.step(self.optimizer, run=self.stepper.step)
        else:
            self.stepper.step(self.optimizer)
        self._after_step()

    @abstractmethod
    def _stretches(self, gi: int) -> list[tuple[Slot, Index, int, int]]:
        """(slot, index into this rank's shard of group ``gi``, first element of the parameter
        it holds, element count): every stretch of a parameter the shard holds."""

    @abstractmethod
    def _ranges(self, gi: int) -> dict[int, list[Index]]:
        """id(param) -> the stretches of this rank's shard of group ``gi`` holding it."""

    def _after_step(self) -> None:
        """Make the parameters whole again (ZeRO-1/2 all-gather); nothing at ZeRO-3."""

    # ---------------------------------------------------------------- checkpoints
    @abstractmethod
    def _whole(self, gi: int, shard: torch.Tensor) -> list[tuple[Slot, torch.Tensor]]:
        """Collective over DP: each parameter's whole value of a tensor laid out like group
        ``gi``'s shard (the parameters, or an optimizer state)."""

    @abstractmethod
    def _take_shard(self, gi: int, whole: dict[int, torch.Tensor], dst: torch.Tensor) -> None:
        """Copy this rank's shard of group ``gi`` from whole tensors by id(param) into ``dst``
        (parameters missing from ``whole`` are left as they are)."""

    def logical_state(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
        """Whole parameters and optimizer states by parameter name (collective over DP)."""
        assert self.optimizer is not None, "build_optimizer first"
        params: dict[str, torch.Tensor] = {}
        optim: dict[str, dict[str, torch.Tensor]] = {}
        with self._resident():
            self._logical_state(params, optim)
        return params, optim

    def _logical_state(self, params: dict[str, torch.Tensor],
                       optim: dict[str, dict[str, torch.Tensor]]) -> None:
        self._check_gather_plan()
        for gi, sp in enumerate(self.shard_params):
            for slot, value in self._whole(gi, sp.detach()):
                params[slot.name] = value.clone()
            members = self.stepper.groups[gi]
            stepped = {m.name for m in members if m.scalars is not None}
            # One gather per state key, in the same order on every rank: sorted, never the
            # state dict's own order (after a load it may differ from rank to rank).
            for key, v in sorted(self.optimizer.state.get(sp, {}).items()):
                if elementwise(v, sp):
                    for slot, value in self._whole(gi, v):
                        if slot.name in stepped:     # a parameter never stepped has no state
                            optim.setdefault(slot.name, {})[key] = value.clone()
            for m in members:                        # per parameter: its step count, ...
                for key, v in (m.scalars or {}).items():
                    if torch.is_tensor(v):
                        optim.setdefault(m.name, {})[key] = v.clone()

    def _check_gather_plan(self) -> None:
        """Before gathering states whole: every DP rank is about to gather the same state keys
        in the same order (one small object gather); otherwise ranks would exchange each
        other's moments and a checkpoint would hold garbage."""
        plan = [sorted(k for k, v in self.optimizer.state.get(sp, {}).items() if torch.is_tensor(v))
                for sp in self.shard_params]
        plans = self.comm.all_gather_object(plan, self.axis)
        if any(p != plan for p in plans):
            raise RuntimeError(f"checkpoint: DP ranks hold different optimizer states {plans}; "
                               "refusing to save")

    @torch.no_grad()
    def load_logical_state(self, params: dict[str, torch.Tensor],
                           optim: dict[str, dict[str, torch.Tensor]]) -> None:
        """Keep this rank's shard of whole parameters and optimizer states given by name."""
        assert self.optimizer is not None, "build_optimizer first"
        with self._resident():
            self._load_shards(params, optim)
            if self.master is not None:
                self.master.copy_to_params()
        self._after_load()

    def _load_shards(self, params: dict[str, torch.Tensor],
                     optim: dict[str, dict[str, torch.Tensor]]) -> None:
        by_name = dict(self.named_params)
        whole = {id(by_name[n]): t for n, t in params.items() if n in by_name}
        for gi, sp in enumerate(self.shard_params):
            self._take_shard(gi, whole, sp.data)
            members = self.stepper.groups[gi]
            saved = {m.name: optim[m.name] for m in members if optim.get(m.name)}
            moments = {k for m in members for k, v in saved.get(m.name, {}).items()
                       if v.dim() > 0 and v.shape == m.shape}
            state = {}
            for key in sorted(moments):              # the same order on every rank
                values = {id(m.param): saved[m.name][key] for m in members
                          if key in saved.get(m.name, {})}
                state[key] = torch.zeros_like(sp.data)
                self._take_shard(gi, values, state[key])
            self.optimizer.state.pop(sp, None)
            if state:
                self.optimizer.state[sp] = state
            self.stepper.load(gi, [{k: v.clone() for k, v in saved[m.name].items() if k not in moments}
                                   if m.name in saved else None for m in members])

    def live_state(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
        """Fault-tolerant replicas of shard groups copy shards: :meth:`local_shards`."""
        return self.local_shards()

    def load_live_state(self, params: dict[str, torch.Tensor],
                        optim: dict[str, dict[str, torch.Tensor]]) -> None:
        self.load_local_shards(params, optim)

    def local_shards(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
        """This rank's flat shards (``shard<i>``, one per optimizer group) and their optimizer
        states, as held (no collective): what the same rank of another replica holds (HSDP,
        fault-tolerant replicas); in mixed precision the shards are the fp32 masters. Shards in
        memory only (no offload)."""
        assert self.optimizer is not None and self.offloaded is None, "shards in memory only"
        optim = {f"shard{gi}": {**{k: v for k, v in self.optimizer.state.get(sp, {}).items()
                                   if elementwise(v, sp)}, **self.stepper.local_state(gi)}
                 for gi, sp in enumerate(self.shard_params)}
        return [(f"shard{gi}", sp.detach()) for gi, sp in enumerate(self.shard_params)], optim

    @torch.no_grad()
    def load_local_shards(self, params: dict[str, torch.Tensor],
                          optim: dict[str, dict[str, torch.Tensor]]) -> None:
        """Take :meth:`local_shards` of the same rank of another replica; then (collective over
        the group, every rank) make the parameters whole again."""
        assert self.optimizer is not None and self.offloaded is None, "shards in memory only"
        for gi, sp in enumerate(self.shard_params):
            sp.data.copy_(params[f"shard{gi}"])
            entries = optim.get(f"shard{gi}", {})
            state = {k: v.clone() for k, v in entries.items() if elementwise(v, sp)}
            self.optimizer.state.pop(sp, None)
            if state:
                self.optimizer.state[sp] = state
            self.stepper.load_local_state(gi, {k: v for k, v in entries.items() if not elementwise(v, sp)})
        if self.master is not None:   # the 16-bit shards from the fp32 masters
            self.master.copy_to_params()
        self._after_load()

    @abstractmethod
    def _slots(self, gi: int) -> list[Slot]:
        """Every parameter slot of group ``gi``."""

    def _after_load(self) -> None:
        """Make the model's parameters whole again after a load (ZeRO-1/2)."""

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """Optimizer states, and the fp32 master shards where the parameters are 16-bit (none
        on the device under offload: :meth:`offloaded_bytes` counts them)."""
        if self.offloaded is not None:
            return []
        opt = self.optimizer.state.values() if self.optimizer else []
        masters = self.master.masters if self.master is not None else []
        return [*masters, *(t for st in opt for t in st.values() if torch.is_tensor(t))]
