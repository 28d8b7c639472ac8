"""ZeRO-3, FSDP style: parameters, gradients and optimizer states all sharded over the group.

The model is cut into *units* (:func:`find_units`): every element of a layer list
(``ModuleList``/``Sequential``, e.g. each GPT block), every other child that owns parameters,
and the root for whatever is left (a parameter shared by modules of different units belongs to
their closest common unit). Per unit and optimizer group, the parameters form one flat padded
buffer of which this rank keeps a fp32 chunk, inside the group's flat shard — the
``nn.Parameter`` the optimizer updates. A unit's full parameters exist only around its use:

- forward: a pre-hook gathers the unit (all_gather, in the compute dtype: FSDP2-style mixed
  precision) and prefetches the next unit of the previous forward's order; a post-hook frees it
  and hooks the unit's outputs, whose gradient marks the start of the unit's backward;
- backward: that hook gathers the unit again (prefetching the next unit of backward); once every
  parameter of the unit has its gradient (the unit is a bucket of the shared
  :class:`~.buckets.Bucketer`) the gradients, staged in ``reduce_dtype``, are reduce-scattered
  into this rank's fp32 gradient shard, and the unit is freed.

Gradient shards live from a step's first reduction to its optimizer step, as FSDP2's sharded
gradients do: ``zero_grad`` frees the flat gradient shards' storage; in backward each unit's
reductions land in a chunk of its own (allocated as the unit is reduced, so the gradient memory
grows with backward), and once every reduction has landed (``finish``) the flat shards are
allocated again and take the chunks (same layout, same tensors: the optimizer's ``.grad``).
Under ``--offload`` (each final slice streamed to the host as it lands) the flat shards stay.

Gathering and freeing: :mod:`.residency`. Under activation recomputation a unit's forward re-runs
inside backward: it is then gathered (if not yet) and kept for its backward. Traffic per step
with m microbatches: all_gather 2m·Ψ·(compute bytes), reduce_scatter m·Ψ·(reduce bytes).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from trainmesh.core.compat import in_backward, queue_backward_callback
from trainmesh.core.step import tensors_in
from trainmesh.observe.metrics import storage_bytes

from ..comm import Comm
from .base import SyncOptions
from .buckets import Bucketer
from .flat import FlatLayout, Slot
from .residency import Piece as _Piece
from .residency import Residency
from .residency import State as _State
from .residency import Unit as _Unit
from .sharded import Groups, ShardedSync
from .units import UnitSpec, find_units, owner


class Zero3(ShardedSync):
    """ZeRO stage 3 over the mesh's DP axis (any ``nn.Module``; units found automatically)."""

    stage = 3

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], comm: Comm, *,
                 module: nn.Module, param_dtype: torch.dtype | None = None,
                 options: SyncOptions | None = None,
                 materialize: Callable[[list[tuple[str, nn.Parameter]]], None] | None = None,
                 units: UnitSpec | None = None) -> None:
        super().__init__(named_params, comm, options)
        self.module = module
        self.unit_spec = units
        """``zero3_units=``: which modules are units (None: :func:`find_units`'s default)."""
        self.param_dtype = param_dtype
        self.materialize = materialize
        """Sharded init: gives a unit's meta parameters their values before it is sharded."""
        self.units: list[_Unit] = []
        self.group_shards: list[torch.Tensor] = []
        self._fwd: list[_Unit] = []          # this forward's pre-forward order
        self._last_fwd: list[_Unit] = []     # the previous forward's (drives forward prefetch)
        self._post: list[_Unit] = []         # this forward's post-forward order
        self._bwd: list[_Unit] = []          # expected backward order: reversed post-forward
        self._bwd_pos = 0
        self._in_bwd = False
        self._last = False                   # this backward is the step's last (final reductions)
        self._chunks: dict[tuple[int, int], torch.Tensor] = {}   # (id(unit), piece) -> landed grads
        self._grads_freed = False            # the flat gradient shards' storage is released
        self._next: _Unit | None = None      # the unit of backward to prefetch (_prefetch)
        self._at: _Unit | None = None        # ... once this unit's backward is half done
        self._due = 0                        # ... after this many more of its gradients
        self._unit_of: dict[int, _Unit] = {} # id(param) -> its unit
        self._checked: list[_Unit] = []      # the last forward order the ranks agreed on
        self._unreached: dict[int, list[nn.Parameter]] = {}   # id(unit) -> passing when it opens

    # ---------------------------------------------------------------- set-up
    @torch.no_grad()
    def _setup(self, groups: Groups) -> None:
        paths: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            paths.setdefault(id(p), []).append(name.rpartition(".")[0])
        unit_names = self._unit_names()
        modules = dict(self.module.named_modules())
        group_of = {id(p): gi for gi, (_, named) in enumerate(groups) for _, p in named}
        owned: dict[str, list[tuple[str, nn.Parameter]]] = {}
        for name, p in self.named_params:
            owned.setdefault(owner(paths[id(p)], unit_names), []).append((name, p))
        sizes = [0] * len(groups)
        for uname in unit_names:
            if uname not in owned:
                continue
            unit = _Unit(len(self.units), name=uname, module=modules[uname])
            offset = 0
            for gi in range(len(groups)):
                named = [(n, p) for n, p in owned[uname] if group_of[id(p)] == gi]
                if not named:
                    continue
                layout = FlatLayout(named, world=self.dp, rank=self.rank_in_dp)
                unit.pieces.append(_Piece(gi, layout, offset, sizes[gi]))
                offset += layout.padded
                sizes[gi] += layout.chunk
            unit.params = [p for _, p in owned[uname]]      # the bucket its gradients fill
            self._unit_of.update((id(p), unit) for p in unit.params)
            self.units.append(unit)
        dtypes = [groups[gi][1][0][1].dtype for gi in range(len(groups))]
        home = torch.device("cpu") if self.options.offload_params else self.device   # --offload-params
        pin = home != self.device and self.device.type == "cuda"
        self.group_shards = [torch.zeros(n, dtype=dt, device=home, pin_memory=pin) for n, dt in zip(sizes, dtypes)]
        self.residency = Residency(self.comm, self.axis, self.device, self.reductions, self.units,
                                   self.group_shards)
        # Each unit is a bucket reduced as soon as it is complete (units finish in backward
        # order, the same on every rank: the ranks agree on each unit before gathering it).
        self.bucketer = Bucketer(self.units, lambda unit: self._post_backward(unit), ordered=False)
        # One unit's reduce-scatter in flight (its buffer and the backend's copy of it), in the
        # background during the next unit's backward: it lands before that unit's prefetch and
        # before the next unit is staged (_prefetch, _stage).
        self.reductions.max_inflight = 1
        for shard in self.group_shards:
            sp = nn.Parameter(shard)
            grad = torch.zeros(shard.shape, dtype=shard.dtype, device=self.device)
            if home == self.device:
                sp.grad = grad
            self.shard_params.append(sp)
            self.grad_shards.append(grad)
        for unit in self.units:
            self._shard_unit(unit)
        for _, p in self.named_params:
            p.register_post_accumulate_grad_hook(self._on_grad)
        for unit in self.units:
            unit.module.register_forward_pre_hook(partial(self._pre_forward, unit))
            unit.module.register_forward_hook(partial(self._post_forward, unit))

    def _unit_names(self) -> list[str]:
        """Module paths of the units (:func:`find_units`)."""
        return find_units(self.module, self.unit_spec)

    def _shard_unit(self, unit: _Unit) -> None:
        """Keep this rank's chunk of the unit's parameters; point them at the gathered buffer."""
        dtype = self.param_dtype or self.group_shards[unit.pieces[0].group].dtype
        unit.full = torch.zeros(sum(pc.layout.padded for pc in unit.pieces), dtype=dtype, device=self.device)
        for pi, pc in enumerate(unit.pieces):
            if self.materialize is not None:   # one unit in flight: built, sharded, freed below
                self.materialize([(s.name, s.param) for s in pc.layout.slots])
            flat = pc.layout.new(self.group_shards[pc.group].dtype, self.device)
            pc.layout.fill(flat)
            self.residency.chunk(pc).copy_(pc.layout.chunk_of(flat, 0))
            grad = self.grad_shards[pc.group][pc.shard_start : pc.shard_start + pc.layout.chunk]
            for sp in pc.layout.shard_pieces():
                self._norm_pieces.append((sp.slot.name, sp.slot.param, grad[sp.lo : sp.hi]))
            for s in pc.layout.slots:
                unit.views.append((s.param, unit.full[pc.offset + s.start : pc.offset + s.end].view(s.shape)))
        unit.arm()
        unit.state = _State.GATHERED
        self.reductions.count(unit.nbytes)
        self._free(unit)

    def _gather(self, unit: _Unit, *, wait: bool, agreed: bool = False) -> None:
        """``agreed``: the unit is the one the agreed order predicts here (its agreement goes
        with its gather, as a prefetch's does: :mod:`.agreement`)."""
        if unit.state is _State.FREE:
            self.reductions.settle()     # landed reductions' buffers released before gathering
        self.residency.gather(unit, wait=wait, agreed=agreed)

    def _free(self, unit: _Unit) -> None:
        self.residency.free(unit)

    # ---------------------------------------------------------------- forward hooks
    def _pre_forward(self, unit: _Unit, module: nn.Module, args: Any) -> None:
        if in_backward():          # recomputation inside backward: keep it for its backward
            self._gather(unit, wait=True)
            return
        i = len(self._fwd)
        self._fwd.append(unit)
        last = self._last_fwd
        self._gather(unit, wait=True, agreed=i < len(last) and last[i] is unit)
        if i + 1 < len(last) and last[i] is unit and last[i + 1] is not unit:
            self._gather(last[i + 1], wait=False)         # prefetch the next unit

    def _post_forward(self, unit: _Unit, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward():
            return
        self._free(unit)
        self._post.append(unit)
        outs = [t for t in tensors_in(output) if t.requires_grad]
        if outs and torch.is_grad_enabled():
            register_multi_grad_hook(outs, lambda _: self._pre_backward(unit), mode="any")

    # ---------------------------------------------------------------- backward hooks
    def _pre_backward(self, unit: _Unit) -> None:
        if not self._in_bwd:
            self._in_bwd = True
            self.check_order()
            self._bwd, self._bwd_pos = list(reversed(self._post)), 0
            queue_backward_callback(self._end_of_backward)
        if unit.done:
            return
        pos = self._bwd_pos
        self._gather(unit, wait=True, agreed=pos < len(self._bwd) and self._bwd[pos] is unit)
        for j in range(self._bwd_pos, len(self._bwd)):
            if self._bwd[j] is unit:
                self._bwd_pos = j + 1
                nxt = self._bwd[j + 1] if j + 1 < len(self._bwd) else None
                if nxt is not None and not nxt.done:
                    # prefetch the next unit of backward once half of this unit's gradients are in
                    self._next, self._at, self._due = nxt, unit, (len(unit.params) + 1) // 2
                break
        self._open_unreached(unit)

    def check_order(self) -> None:
        """At a backward's start the DP ranks agree on the forward's order: the backward
        prefetches from it and the next forward from its pre-forward order, so every rank's
        prefetches are the same units (:mod:`.agreement`)."""
        self.residency.agreements.order(self._fwd, self._post)
        self._checked = list(self._fwd)

    def _prefetch(self) -> None:
        """Start gathering the next unit of backward (``_next``) once the reduce-scatter in
        flight has landed (else the gathered unit, the reduction's buffer and the backend's copies
        of both would be live at once). Called at a point of the program every rank reaches
        alike (half the unit's gradients in, or the unit complete): never by whether a
        collective has landed, which varies by rank, so every rank issues its gather and the
        unit's reduce-scatter in the same order."""
        nxt, self._next, self._at = self._next, None, None
        if nxt is None or nxt.done or nxt.state is not _State.FREE:
            return
        self.reductions.land()
        self._gather(nxt, wait=False)

    def _on_grad(self, p: nn.Parameter) -> None:
        self.readiness.mark(p)
        self.reductions.settle()
        if self._next is not None and self._unit_of.get(id(p)) is self._at:
            self._due -= 1
            if self._due <= 0:
                self._prefetch()
        self.bucketer.give(p)          # the unit complete: reduce-scatter it (_post_backward)

    def _stage(self, unit: _Unit) -> list[torch.Tensor]:
        """The unit's gradients, held by its parameters until the unit is complete (as FSDP2
        holds them: they grow with the unit's backward), added into flat padded buffers in
        ``reduce_dtype`` (zeroed when allocated: zeros where a parameter has none)."""
        self.reductions.drain()          # the previous unit's reduction lands first: one at a time
        bufs = [self.reductions.alloc(pc.layout.padded, self.reduce_dtype or unit.full.dtype)
                for pc in unit.pieces]
        for buf, pc in zip(bufs, unit.pieces):
            for slot in pc.layout.slots:
                if slot.param.grad is not None:
                    buf[slot.start : slot.end].add_(slot.param.grad.reshape(-1))
                    slot.param.grad = None
        return bufs

    def pass_unreached(self, reached: set[int], among: set[int] | None = None) -> None:
        """In a unit the pass reaches, the parameters it does not reach pass at once. A unit
        it does not reach at all (an expert no row of this rank's microbatch chose, which a
        peer's rows may have) passes when its backward opens (:meth:`_open_unreached`): where
        a peer that reached it is inside that unit's backward, so both reduce it at the same
        place of the group's sequence — not earlier, nor at the end of the backward."""
        self._unreached = {}
        for unit in self.units:
            passing = [p for p in unit.params
                       if id(p) not in reached and (among is None or id(p) in among)]
            if not any(id(p) in reached for p in unit.params):
                if passing:
                    self._unreached[id(unit)] = passing
                continue
            for p in passing:
                self.readiness.passed(p)
                self.bucketer.give(p)   # nothing staged: its part of the buffer stays 0

    def _open_unreached(self, unit: _Unit) -> None:
        """The unit's backward opens (the gradient reached its outputs): if this pass reaches
        none of its parameters, they pass now (:meth:`pass_unreached`)."""
        for p in self._unreached.pop(id(unit), ()):
            self.readiness.passed(p)
            self.bucketer.give(p)

    def _post_backward(self, unit: _Unit) -> None:
        """Reduce-scatter the unit's gradients into the gradient shards; free the unit."""
        if self._next is not None and unit is self._at:
            self._prefetch()             # its prefetch before its reduce-scatter, on every rank
        self._reduce_unit(unit, final=self._last)
        unit.done = True
        self._free(unit)

    def _reduce_unit(self, unit: _Unit, *, final: bool) -> None:
        """Reduce-scatter the unit's staged gradients (zeros if none) into the gradient shards
        (``final``: the step's last reduction of the unit, see :class:`~.inflight.Flight`)."""
        bufs = self._stage(unit)
        for pi, (pc, buf) in enumerate(zip(unit.pieces, bufs)):
            where = slice(pc.shard_start, pc.shard_start + pc.layout.chunk)
            if self._grads_freed:        # this step's chunk of the unit's gradient shard
                dst = self._chunks.get((id(unit), pi))
                if dst is None:
                    dst = torch.zeros(pc.layout.chunk, dtype=self.grad_shards[pc.group].dtype, device=self.device)
                    self._chunks[(id(unit), pi)] = dst
            else:
                dst = self.grad_shards[pc.group][where]
            self.reductions.reduce_scatter(buf, dst, accumulate=True, transient=True,
                                           final=(pc.group, where) if final else None)

    def _grads_in(self) -> None:
        """Every reduction has landed: the flat gradient shards are allocated again and take the
        units' chunks (a unit never reduced this step stays zero)."""
        if not self._grads_freed:
            return
        for g in self.grad_shards:
            g.untyped_storage().resize_(g.numel() * g.element_size())
            g.zero_()
        for unit in self.units:
            for pi, pc in enumerate(unit.pieces):
                chunk = self._chunks.pop((id(unit), pi), None)
                if chunk is not None:
                    self.grad_shards[pc.group][pc.shard_start : pc.shard_start + pc.layout.chunk].copy_(chunk)
        self._grads_freed = False

    def _free_grads(self) -> None:
        """After the optimizer step: release the flat gradient shards' storage (none between
        steps), except where an offloaded optimizer streams them to the host as they land."""
        self._chunks.clear()
        if self.offloaded is not None or self.options.offload_params:
            for g in self.shard_grads:
                g.zero_()
            return
        for g in self.grad_shards:
            g.untyped_storage().resize_(0)
        self._grads_freed = True

    def _end_of_backward(self) -> None:
        """Reduce every unit no hook reduced (unused parameters: zeros, so every rank issues the
        same collectives), free every unit still gathered. Idempotent. Nothing is prefetched
        now: the backward is over."""
        self._next, self._at = None, None
        for unit in self.units:
            if not unit.done:
                self._post_backward(unit)
            self._free(unit)
        self._in_bwd, self._next, self._at = False, None, None

    # ---------------------------------------------------------------- the seam
    def before_backward(self, *, is_last: bool) -> None:
        self._end_of_backward()          # the previous microbatch's, if its callback did not run
        self._last = is_last
        if self._checked:
            self._last_fwd = self._checked     # an order every DP rank ran (check_order)
        self._fwd, self._post = [], []
        self.readiness.start()
        self.bucketer.arm()
        for unit in self.units:
            unit.done = False

    def expect_backwards(self, n: int, held: Sequence[nn.Parameter] = ()) -> None:
        self._no_pipeline()

    def finish(self, scale: float) -> None:
        self._backward_done()
        self._check_unused()
        self._end_of_backward()
        self.reductions.drain()
        self._grads_in()
        self._scale(scale)

    def zero_grad(self) -> None:
        self._end_step()
        self._free_grads()
        self._reset_master()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        on_device = not self.options.offload_params
        return {"params": list(self.group_shards) if on_device else [], "grads": self.shard_grads,
                "optimizer": self._optimizer_tensors()}

    def offloaded_bytes(self) -> dict[str, int]:
        out = super().offloaded_bytes()
        if self.options.offload_params:
            out["cpu"] += storage_bytes(self.group_shards)
        return out

    def _ranges(self, gi: int) -> dict[int, list[slice]]:
        out: dict[int, list[slice]] = {}
        for pc in self._group_pieces(gi):
            for piece in pc.layout.shard_pieces():
                out.setdefault(id(piece.slot.param), []).append(
                    slice(pc.shard_start + piece.lo, pc.shard_start + piece.hi))
        return out

    def _stretches(self, gi: int) -> list[tuple[Slot, slice, int, int]]:
        return [(piece.slot, slice(pc.shard_start + piece.lo, pc.shard_start + piece.hi),
                 piece.offset, piece.hi - piece.lo)
                for pc in self._group_pieces(gi) for piece in pc.layout.shard_pieces()]

    # ---------------------------------------------------------------- checkpoints
    def _group_pieces(self, gi: int) -> list[_Piece]:
        return [pc for unit in self.units for pc in unit.pieces if pc.group == gi]

    def _slots(self, gi: int) -> list[Slot]:
        return [s for pc in self._group_pieces(gi) for s in pc.layout.slots]

    def _whole(self, gi: int, shard: torch.Tensor) -> list[tuple[Slot, torch.Tensor]]:
        out = []
        for pc in self._group_pieces(gi):
            flat = pc.layout.new(shard.dtype, self.device)
            self.comm.all_gather(flat, shard[pc.shard_start : pc.shard_start + pc.layout.chunk].to(self.device), self.axis)
            out += [(s, pc.layout.view(flat, s)) for s in pc.layout.slots]
        return out

    @torch.no_grad()
    def _take_shard(self, gi: int, whole: dict[int, torch.Tensor], dst: torch.Tensor) -> None:
        for pc in self._group_pieces(gi):
            for piece in pc.layout.shard_pieces():
                src = whole.get(id(piece.slot.param))
                if src is not None:
                    n = piece.hi - piece.lo
                    dst[pc.shard_start + piece.lo : pc.shard_start + piece.hi].copy_(
                        src.reshape(-1)[piece.offset : piece.offset + n])

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Consolidated fp32 weights on every DP rank (a collective: call it on all of them)."""
        values = {id(slot.param): value.clone() for gi, shard in enumerate(self.group_shards)
                  for slot, value in self._whole(gi, shard)}
        return {name: values[id(t)] if id(t) in values else t.detach().clone()
                for name, t in self.module.state_dict(keep_vars=True).items()}
