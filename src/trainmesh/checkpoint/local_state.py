"""A rank's share of the checkpoint state dict, as ``get_state_dict`` names it.

Keys follow ``torch.distributed.checkpoint.state_dict.get_state_dict`` flattened as DCP saves
it (torchtitan's layout): ``model.<name>`` for every parameter, frozen parameter and persistent
buffer under its single-process name; ``optimizer.state.<name>.<key>`` (``exp_avg``,
``exp_avg_sq``, ``step``, ``momentum_buffer``, ...); ``optimizer.param_groups.<i>.<option>``
and ``optimizer.param_groups.<i>.params`` (the names in group ``i``), written by rank 0. An
optimizer stepped on whole parameters (:mod:`trainmesh.data_parallel.whole_params`) gives its
states whole, from the rank that steps each parameter (under DiLoCo, per replica).

Each value is a :class:`~.chunks.Chunks` of views into what the rank holds — ZeRO's flat shards
cut into boxes, placed in the global tensor through the tp / ep slicing — so nothing is copied
or gathered to save. Pieces several ranks hold (replicas over dp, tp-replicated tensors, HSDP
replicas) appear in each of their plans with the same offsets; DCP's planner writes each once.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from trainmesh.checkpoint.chunks import Chunks, GlobalMap, flat_boxes, tp_ep_map
from trainmesh.comm import Comm
from trainmesh.core.errors import ConfigError
from trainmesh.core.layout import Group
from trainmesh.core.placement import Placements
from trainmesh.data_parallel.base import GradSync
from trainmesh.data_parallel.composite import CompositeSync
from trainmesh.data_parallel.diloco import REPLICA, DiLoCo
from trainmesh.data_parallel.shard_step import elementwise
from trainmesh.data_parallel.sharded import ShardedSync
from trainmesh.data_parallel.whole_params import whole_optimizers
from trainmesh.tensor_parallel.state import shard_dim, shard_parts

MODEL, STATE, GROUPS = "model.", "optimizer.state.", "optimizer.param_groups."


def global_map(name: str, local_shape: Sequence[int], comm: Comm, placements: Placements) -> GlobalMap:
    """Where the tensor this rank holds of ``name`` (whole along dp) sits in the global one."""
    placement = placements.get(name)
    if not local_shape or placement is None:
        return GlobalMap.whole(local_shape)
    mesh = comm.mesh
    return tp_ep_map(local_shape, tp_dim=shard_dim(placement), tp_rank=mesh.index(Group.tp),
                     tp=mesh.size(Group.tp), parts=shard_parts(placement),
                     ep_dim=placement.ep_dim if placements.ep_split(name) else None,
                     ep_rank=mesh.index(Group.ep), ep=mesh.size(Group.ep))


def local_shape(name: str, global_shape: Sequence[int], comm: Comm, placements: Placements) -> tuple[int, ...]:
    """The shape of the tensor this rank holds of ``name`` (whole along dp), from the global one."""
    shape = list(global_shape)
    placement = placements.get(name)
    if placement is not None and shape:
        if shard_dim(placement) is not None:
            shape[placement.tp_dim] //= comm.mesh.size(Group.tp)
        if placements.ep_split(name):
            shape[placement.ep_dim] //= comm.mesh.size(Group.ep)
    return tuple(shape)


def _whole(gmap: GlobalMap, tensor: torch.Tensor) -> Chunks:
    chunks = Chunks(gmap.global_shape, tensor.dtype)
    chunks.add_local(gmap, tensor.detach(), ((0,) * tensor.dim(), tuple(tensor.shape)))
    return chunks


def flat_pieces(sync: ShardedSync, gi: int) -> Iterator[tuple[Any, Any, int, int]]:
    """(slot, index into group ``gi``'s shard, first element of the slot's flat range, count):
    the stretches of this rank's shard, for ZeRO-3 (a 1-D shard of unit pieces) and ZeRO-1/2
    (a (buckets, chunk) shard)."""
    if hasattr(sync, "units"):
        for unit in sync.units:
            for pc in unit.pieces:
                if pc.group == gi:
                    for p in pc.layout.shard_pieces():
                        yield p.slot, slice(pc.shard_start + p.lo, pc.shard_start + p.hi), p.offset, p.hi - p.lo
    else:
        for p in sync.groups[gi].layout.shard_pieces():
            yield p.slot, (p.bucket, slice(p.lo, p.hi)), p.offset, p.hi - p.lo


def _sharded_state(sync: ShardedSync, comm: Comm, placements: Placements, out: dict[str, Any]) -> None:
    """ZeRO: each flat stretch of this rank's shards (parameters and element-wise states)
    cut into boxes of its parameter; per-parameter scalars (step counts) whole."""
    for gi, sp in enumerate(sync.shard_params):
        members = {m.name: m for m in sync.stepper.groups[gi]}
        states = {k: v for k, v in sync.optimizer.state.get(sp, {}).items() if elementwise(v, sp)}
        for slot, index, offset, count in flat_pieces(sync, gi):
            gmap = global_map(slot.name, slot.shape, comm, placements)
            stepped = members[slot.name].scalars is not None
            sources = [(MODEL + slot.name, sp.detach())]
            sources += [(f"{STATE}{slot.name}.{k}", v) for k, v in sorted(states.items()) if stepped]
            for key, source in sources:
                chunks = out.setdefault(key, Chunks(gmap.global_shape, source.dtype))
                add_flat(chunks, gmap, source[index], slot.shape, offset)
        for m in sync.stepper.groups[gi]:
            for key, v in sorted((m.scalars or {}).items()):
                if torch.is_tensor(v):
                    out[f"{STATE}{m.name}.{key}"] = v.detach()


def add_flat(chunks: Chunks, gmap: GlobalMap, flat: torch.Tensor, shape: Sequence[int], offset: int) -> None:
    """Add to ``chunks`` the elements ``[offset, offset + len(flat))`` of a local tensor of
    ``shape`` (row-major), held as the 1-D view ``flat``: a view per box, nothing copied."""
    strides = _strides(shape)
    for offs, sizes in flat_boxes(shape, offset, offset + flat.numel()):
        start = sum(o * st for o, st in zip(offs, strides)) - offset
        n = int(torch.Size(sizes).numel())
        chunks.add_local(gmap, flat[start : start + n].view(sizes), (offs, sizes))


def _strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(tuple(shape)):
        strides.append(acc)
        acc *= s
    return strides[::-1]


def leaves(sync: GradSync) -> list[GradSync]:
    """The strategies whose state a composite is made of (one that keeps a state of its own,
    as DiLoCo does, is a leaf)."""
    if isinstance(sync, CompositeSync) and type(sync).logical_state is CompositeSync.logical_state:
        return [leaf for part in sync.parts for leaf in leaves(part)]
    return [sync]


@contextmanager
def save_state(grad_sync: GradSync, comm: Comm, placements: Placements,
               untrained: Sequence[tuple[str, torch.Tensor]] = (),
               tied: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
    """This rank's state dict for a save (views into its state: use it inside the context,
    which keeps offloaded states in host memory). Strategies without flat shards (DDP, DiLoCo)
    give their tensors whole along dp (DiLoCo: its replicas' states, gathered over replicas:
    collectives, in the same order on every rank). ``tied``: alias -> name of a weight the
    model holds under several names, saved under each (a PyTorch ``state_dict`` has them all)."""
    out: dict[str, Any] = {}
    refused: str | None = None
    with ExitStack() as stack:
        for sync in leaves(grad_sync):
            try:
                _whole_param_state(sync, out)
            except ConfigError as exc:   # said on every rank, after the gather below
                refused = str(exc)
            if isinstance(sync, ShardedSync):
                stack.enter_context(sync.resident())
                _sharded_state(sync, comm, placements, out)
                continue
            params, optim = sync.logical_state()
            for name, t in params.items():
                gmap = global_map(name, t.shape, comm, placements)
                out[MODEL + name] = _whole(gmap, t)
                for key, v in sorted(optim.get(name, {}).items()):
                    same = v.dim() and tuple(v.shape) == tuple(t.shape)
                    out[f"{STATE}{name}.{key}"] = _whole(gmap if same else GlobalMap.whole(v.shape), v)
        for name, t in untrained:
            out[MODEL + name] = _whole(global_map(name, t.shape, comm, placements), t)
        for alias, name in sorted((tied or {}).items()):   # under each name, as state_dict()
            if MODEL + name in out:
                out[MODEL + alias] = out[MODEL + name]
        everyone = comm.all_gather_object((param_groups(grad_sync), refused))   # collective: small
        why = next((r for _, r in everyone if r is not None), None)
        if why is not None:
            field, _, message = why.partition(": ")
            raise ConfigError(field, message)
        if comm.mesh.rank == 0:
            out.update(merge_groups([groups for groups, _ in everyone]))
        yield out


def _whole_param_state(sync: GradSync, out: dict[str, Any]) -> None:
    """An optimizer stepped on whole parameters: its states of the parameters this rank steps,
    whole (``optimizer.state.<name>.<key>``: tensors, and numbers as DCP keeps non-tensor
    values; the strategy itself holds none of them). Under DiLoCo each replica's own, as
    ``<name>.replica<r>/<key>`` (written by that replica's ranks: no gather)."""
    prefix = replica_prefix(sync)
    for opt in whole_optimizers(sync):
        for name, state in opt.whole_state().items():
            for key, v in sorted(state.items()):
                out[f"{STATE}{name}.{prefix}{key}"] = (_whole(GlobalMap.whole(v.shape), v)
                                                       if torch.is_tensor(v) else v)


def replica_prefix(sync: GradSync) -> str:
    """Where ``sync``'s replica keeps its own states among a parameter's: DiLoCo's
    ``replica<r>/``, else nothing."""
    return REPLICA.format(sync.replica) if isinstance(sync, DiLoCo) else ""


def param_groups(grad_sync: GradSync) -> list[tuple[dict[str, Any], list[str]]]:
    """This rank's optimizer groups: (options, parameter names)."""
    out = []
    for sync in leaves(grad_sync):
        if sync.optimizer is None:
            continue
        groups = sync.optimizer.param_groups
        names = ([[m.name for m in g] for g in sync.stepper.groups] if isinstance(sync, ShardedSync)
                 else [[n for n, _ in sync.named_params]] + [[] for _ in groups[1:]])
        for group, named in zip(groups, names):
            out.append(({k: v for k, v in group.items() if k != "params"}, named))
    return out


def merge_groups(everyone: list[list[tuple[dict[str, Any], list[str]]]]) -> dict[str, Any]:
    """The ranks' groups merged (same options: one group) as ``optimizer.param_groups.<i>.*``."""
    merged: list[tuple[dict[str, Any], list[str]]] = []
    for groups in everyone:
        for options, names in groups:
            same = next((g for g in merged if repr(sorted(g[0].items())) == repr(sorted(options.items()))), None)
            if same is None:
                merged.append((options, []))
                same = merged[-1]
            same[1].extend(n for n in names if n not in same[1])
    out: dict[str, Any] = {}
    for i, (options, names) in enumerate(merged):
        out.update({f"{GROUPS}{i}.{k}": v for k, v in options.items()})
        out[f"{GROUPS}{i}.params"] = names
    return out
