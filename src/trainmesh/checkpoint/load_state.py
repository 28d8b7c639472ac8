"""What a rank reads from a checkpoint, and where it goes: straight into what it holds.

ZeRO's flat shards are read in place: each stretch of this rank's shard is the same few boxes of
its parameter as when saving (:mod:`.local_state`), now views DCP reads into, for the
parameters (the fp32 masters in mixed precision) and for each element-wise optimizer state
(fresh shard-shaped tensors); per-parameter scalars (step counts) are read whole. So a rank
holds nothing beyond its own shards while loading. Strategies without flat shards (DDP, whose
every rank holds whole tensors along dp; DiLoCo, which spreads its replicas' states itself) read
their tensors whole along dp and take them through ``load_logical_state``. An optimizer stepped
on whole parameters (:mod:`trainmesh.data_parallel.whole_params`) has its states of each
parameter read whole by the rank that will step it (under DiLoCo, its own replica's).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from trainmesh.checkpoint.chunks import Chunks, tensor_meta
from trainmesh.checkpoint.local_state import (
    MODEL,
    STATE,
    add_flat,
    global_map,
    leaves,
    local_shape,
    replica_prefix,
)
from trainmesh.comm import Comm
from trainmesh.core.placement import Placements
from trainmesh.data_parallel.base import GradSync
from trainmesh.data_parallel.sharded import ShardedSync
from trainmesh.data_parallel.whole_params import whole_parts

Missing = Callable[[str], Exception]


def whole_chunks(name: str, t: torch.Tensor, comm: Comm, placements: Placements) -> Chunks:
    """``t``, this rank's tensor of ``name`` whole along dp, as chunks of the global tensor."""
    gmap = global_map(name, t.shape, comm, placements)
    chunks = Chunks(gmap.global_shape, t.dtype)
    chunks.add_local(gmap, t.detach(), ((0,) * t.dim(), tuple(t.shape)))
    return chunks


def saved_states(md: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{parameter name: {state key: its tensor metadata}} of a checkpoint's optimizer states."""
    out: dict[str, dict[str, Any]] = {}
    for fqn, meta in md.items():
        if fqn.startswith(STATE) and tensor_meta(meta) is not None:
            name, _, key = fqn[len(STATE):].rpartition(".")
            out.setdefault(name, {})[key] = meta
    return out


@contextmanager
def load_plan(md: dict[str, Any], grad_sync: GradSync, comm: Comm, placements: Placements,
              missing: Missing) -> Iterator[tuple[dict[str, Any], Callable[[], None]]]:
    """(the targets to read: key -> chunks or tensor, the function that hands what was read to
    the strategies once it is read). Read inside the context (it keeps offloaded states in
    host memory). ``missing(key)``: the error for a parameter the checkpoint lacks."""
    states = saved_states(md)
    targets: dict[str, Any] = {}
    finish: list[Callable[[], None]] = []

    def meta_of(key: str) -> Any:
        meta = tensor_meta(md.get(key))
        if meta is None:
            raise missing(key)
        return meta
    with ExitStack() as stack:
        for sync in leaves(grad_sync):
            # an optimizer stepped on whole parameters: the strategy holds none of its states
            # (DiLoCo: its own states, but none of its replica strategy's)
            parts, prefix = whole_parts(sync), replica_prefix(sync)
            theirs = states if not parts else {} if not prefix else \
                {n: {k: m for k, m in d.items() if not _replicas_own(k)} for n, d in states.items()}
            if isinstance(sync, ShardedSync):
                stack.enter_context(sync.resident())
                finish.append(_sharded(sync, comm, placements, theirs, meta_of, targets))
            else:
                finish.append(_whole(sync, comm, placements, theirs, meta_of, targets))
            for part in parts:
                finish.append(_whole_param_states(part, md, targets, prefix))
        yield targets, lambda: [f() for f in finish] and None


def _replicas_own(key: str) -> bool:
    """A DiLoCo replica's state of its replica strategy's optimizer (``replica<r>/<key>``),
    not its parameters (``replica<r>/param``)."""
    head, slash, rest = key.partition("/")
    return bool(slash) and head.startswith("replica") and rest != "param"


def _sharded(sync: ShardedSync, comm: Comm, placements: Placements, states: dict[str, dict[str, Any]],
             meta_of: Callable[[str], Any], targets: dict[str, Any]) -> Callable[[], None]:
    """Targets in ``sync``'s own shards; returns what installs the states once read."""
    from trainmesh.checkpoint.local_state import flat_pieces
    installs = []
    for gi, sp in enumerate(sync.shard_params):
        members = sync.stepper.groups[gi]
        sizes = {m.name: meta_of(MODEL + m.name).size for m in members}
        moments = sorted({k for m in members for k, meta in states.get(m.name, {}).items()
                          if len(meta.size) and meta.size == sizes[m.name]})
        state = {k: torch.zeros_like(sp.data) for k in moments}
        scalars = {m.name: {k: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
                            for k, meta in states[m.name].items() if k not in moments}
                   for m in members if states.get(m.name)}
        for name, held in scalars.items():
            targets.update({f"{STATE}{name}.{k}": t for k, t in held.items()})
        for slot, index, offset, _ in flat_pieces(sync, gi):
            gmap = global_map(slot.name, slot.shape, comm, placements)
            dests = [(MODEL + slot.name, sp.data)]
            dests += [(f"{STATE}{slot.name}.{k}", state[k]) for k in moments if k in states.get(slot.name, {})]
            for key, dest in dests:
                chunks = targets.setdefault(key, Chunks(gmap.global_shape, meta_of(MODEL + slot.name).properties.dtype))
                chunks.dtype = dest.dtype
                add_flat(chunks, gmap, dest[index], slot.shape, offset)
        installs.append((gi, sp, state, [scalars.get(m.name) for m in members]))

    def install() -> None:
        for gi, sp, state, per_member in installs:
            sync.optimizer.state.pop(sp, None)
            if state:
                sync.optimizer.state[sp] = state
            sync.stepper.load(gi, per_member)
        sync.params_changed()   # 16-bit copies of the masters; ZeRO-1/2: whole again
    return install


def _whole(sync: GradSync, comm: Comm, placements: Placements, states: dict[str, dict[str, Any]],
           meta_of: Callable[[str], Any], targets: dict[str, Any]) -> Callable[[], None]:
    """Targets in fresh tensors whole along dp; returns what hands them to ``sync``."""
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for name, _ in sync.named_params:
        meta = meta_of(MODEL + name)
        shape = local_shape(name, meta.size, comm, placements)
        params[name] = torch.empty(shape, dtype=meta.properties.dtype)
        targets[MODEL + name] = whole_chunks(name, params[name], comm, placements)
        for key, smeta in sorted(states.get(name, {}).items()):
            same = len(smeta.size) and smeta.size == meta.size
            t = optim.setdefault(name, {})[key] = torch.empty(shape if same else tuple(smeta.size),
                                                              dtype=smeta.properties.dtype)
            targets[f"{STATE}{name}.{key}"] = whole_chunks(name, t, comm, placements) if same else t
    return lambda: sync.load_logical_state(params, optim)


def _whole_param_states(sync: GradSync, md: dict[str, Any], targets: dict[str, Any],
                        prefix: str = "") -> Callable[[], None]:
    """An optimizer stepped on whole parameters: the saved states (tensors, numbers) of the
    parameters this rank will step, read whole (nothing of the others; under DiLoCo its own
    replica's, ``prefix``); returns what hands them to it once read."""
    opt = sync.optimizer
    names = set([m.name for group in sync.stepper.groups for m in group] if isinstance(sync, ShardedSync)
                else [name for name, _ in sync.named_params])
    read: dict[str, list[str]] = {}
    for fqn, meta in md.items():
        name, _, key = fqn[len(STATE):].rpartition(".")
        if not fqn.startswith(STATE) or name not in names or not opt.owns(name) \
                or not key.startswith(prefix) or (prefix and key == prefix + "param"):
            continue
        read.setdefault(name, []).append(key)
        shape = tensor_meta(meta)
        targets[fqn] = (None if shape is None      # a number: the planner puts it here
                        else torch.empty(tuple(shape.size), dtype=shape.properties.dtype))
    return lambda: opt.load_whole_state({name: {k[len(prefix):]: targets[f"{STATE}{name}.{k}"]
                                                for k in keys} for name, keys in read.items()})
