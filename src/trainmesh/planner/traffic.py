"""Communication per step, per mesh axis and op: payload bytes and bytes on the wire.

**Payload** follows docs/METRICS.md's ``comm_bytes_per_step`` (the nccl-tests convention): all_reduce
counts the tensor, all_gather the gathered output, reduce_scatter the unreduced input, send/recv
the tensor. With Psi parameters on the rank's DP group, g bytes per reduced gradient value and
q bytes per gathered parameter value (both the compute dtype by default), m microbatches:

* DDP: dp.all_reduce g*Psi (once per step, after the last microbatch).
* ZeRO-1: dp.reduce_scatter g*Psi + dp.all_gather q*Psi.
* ZeRO-2: dp.reduce_scatter m*g*Psi (after every microbatch) + dp.all_gather q*Psi.
* ZeRO-3: dp.reduce_scatter m*g*Psi + dp.all_gather 2*m*q*Psi (before each unit's forward
  and again before its backward). Inside a pipeline with ``--zero3-reshard step`` each unit is
  gathered once per step and kept for every microbatch: dp.all_gather q*Psi (``microbatch``:
  2*m*q*Psi as without a pipeline, fewer under a split backward, which keeps a unit from ``I``
  to ``W``).
* HSDP (``--dp-shard S`` < dp, ZeRO >= 1): the ZeRO terms above over the S ranks of the shard
  group, keyed ``dp_shard`` (Psi padded to a multiple of S), and every reduce-scatter's result,
  this rank's g*Psi/S shard, all-reduced over the dp/S replicas, keyed ``dp_replicate``:
  dp_replicate.all_reduce g*Psi/S at ZeRO-1, m*g*Psi/S at ZeRO-2 and 3. Nothing is keyed ``dp``.
* TP (per microbatch, A = b*s*h values): tp.all_reduce of A, 2 per layer forward and 2 per layer
  backward, + 1 for the vocab-parallel embedding's forward (first stage), + 1 for the head
  input's backward (last stage), + 3 fp32 b*s-sized reductions of the vocab-parallel cross
  entropy (max, sum of exponentials, target logit). Sequence parallel (as trainmesh's
  ``tensor_parallel`` does it): each layer's 4 all_reduces become 4 all_gathers + 4
  reduce_scatters of A; the embedding keeps its forward all_reduce and adds a backward
  all_gather (its output is split by sequence); the head gathers its input (all_gather forward,
  reduce_scatter backward); and once per step, after the data-parallel reduction, the
  gradients of the parameters TP replicates but sees only part of the sequence of (norms,
  row-parallel biases; a MoE block's router and experts) are all-reduced: whole, or under ZeRO
  this rank's pieces of its gradient shard (1/N of them, N the group ZeRO shards over).
  A MoE block's MLP is not split over tp: it keeps only its attention's collectives.
* PP: per microbatch a rank sends and receives A (A/t with SP) once per boundary of each chunk
  it holds: pp.send = pp.recv = m*A*(chunks not last + chunks not first); for one chunk
  ``[stage < p-1] + [stage > 0]``.
* Muon (``--optimizer muon``): :func:`muon_ops`.
* other: per step the loss sum and token count (two float64) and the squared grad norm (one
  float32) are all-reduced over the world, 20 bytes (+4 for fp16's overflow flag): small.

Groups of one rank send nothing. Pass the real element counts (padded shards included) for an
exact match with what trainmesh measures.

**Wire bytes** per rank use ring algorithms: all_reduce 2(n-1)/n of the payload, reduce_scatter
and all_gather (n-1)/n, send/recv 1. That is why ZeRO-1/2 move what DDP moves (2(n-1)/n*Psi)
and ZeRO-3 1.5x that.
"""
from __future__ import annotations

Traffic = dict[str, dict[str, float]]
"""Mesh axis (``dp``, ``tp``, ``pp``, ``other``) -> op -> payload bytes per step."""

AXES = ("dp", "tp", "pp", "other")

SCALAR_BYTES = 20
"""Loss sum + token count (2 x float64) + squared grad norm (float32), all-reduced each step."""


def ring_factor(op: str, n: int) -> float:
    """Wire bytes per payload byte for one rank of an ``n``-rank ring."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "broadcast"):
        return (n - 1) / n
    if op in ("gather", "scatter"):   # the root's link: n - 1 of the n pieces
        return (n - 1) / n
    return 1.0  # send, recv


def empty() -> Traffic:
    return {axis: {} for axis in AXES}


def _add(ops: dict[str, float], op: str, nbytes: float) -> None:
    if nbytes > 0:
        ops[op] = ops.get(op, 0.0) + nbytes


def zero3_regathers(cfg: object) -> bool:
    """Whether ZeRO-3 gathers every unit per microbatch under layout ``cfg`` (a
    :class:`~trainmesh.config.parallel.ParallelConfig`): always without a pipeline; inside one only with
    ``--zero3-reshard microbatch``."""
    return getattr(cfg, "pp", 1) == 1 or getattr(cfg, "zero3_reshard", "step") == "microbatch"


def dp_ops(psi: float, *, dp: int, zero: int, microbatches: int, grad_bytes: int,
           param_bytes: int, regather: bool = True) -> dict[str, float]:
    """Payload per step on the DP axis; ``psi`` is the element count reduced and gathered
    (for ZeRO, the flat buffer padded to a multiple of ``dp``). ``regather``: ZeRO-3 gathers
    each unit per microbatch (False: once per step, ``--zero3-reshard step`` in a pipeline)."""
    ops: dict[str, float] = {}
    if dp == 1:
        return ops
    m = microbatches
    if zero == 0:
        _add(ops, "all_reduce", grad_bytes * psi)
        return ops
    rs_rounds = 1 if zero == 1 else m
    ag_rounds = 2 * m if zero == 3 and regather else 1
    _add(ops, "reduce_scatter", rs_rounds * grad_bytes * psi)
    _add(ops, "all_gather", ag_rounds * param_bytes * psi)
    return ops


def data_parallel_ops(psi: float, *, dp: int, shard: int, zero: int, microbatches: int,
                      grad_bytes: int, param_bytes: int, regather: bool = True) -> Traffic:
    """The DP traffic by metrics key: ``{"dp": ...}``, or under HSDP (``shard`` < ``dp``, ZeRO
    >= 1) ``{"dp_shard": ..., "dp_replicate": ...}``; ``psi`` padded to a multiple of the
    group ZeRO shards over."""
    if zero == 0 or shard >= dp:
        return {"dp": dp_ops(psi, dp=dp, zero=zero, microbatches=microbatches, grad_bytes=grad_bytes,
                             param_bytes=param_bytes, regather=regather)}
    inner = dp_ops(psi, dp=shard, zero=zero, microbatches=microbatches, grad_bytes=grad_bytes,
                   param_bytes=param_bytes, regather=regather)
    rounds = 1 if zero == 1 else microbatches
    across: dict[str, float] = {}
    _add(across, "all_reduce", rounds * grad_bytes * psi / shard)
    return {"dp": {}, "dp_shard": inner, "dp_replicate": across}


def ep_ops(*, ep: int, moe_layers: int, tokens: int, top_k: int, hidden: int, value_bytes: int,
           microbatches: int, experts: int, forwards: int = 1) -> dict[str, float]:
    """Payload per step on the ``ep`` axis (docs/EXPERT_PARALLEL.md) of a rank holding
    ``moe_layers`` MoE layers, routing balanced (each rank receives as many rows as it sends):
    per layer and microbatch the counts (8 E) and ``2 (S + R) d b`` with ``S = R = tokens k``;
    a forward run again by full recomputation (``forwards`` 2) repeats its dispatch and combine."""
    ops: dict[str, float] = {}
    if ep > 1:
        rows = tokens * top_k
        passes = 2 + 2 * forwards          # dispatch and combine, forward (again) and backward
        _add(ops, "all_to_all", microbatches * moe_layers
             * (passes * rows * hidden * value_bytes + forwards * 8 * experts))
    return ops


def tp_ops(*, tp: int, layers: int, tokens: int, hidden: int, value_bytes: int,
           microbatches: int, first: bool, last: bool, sequence_parallel: bool = False,
           partial_grad_bytes: float = 0.0, forwards: int = 1,
           moe_layers: int = 0) -> dict[str, float]:
    """Payload per step on the TP axis of a rank holding ``layers`` blocks (tokens = b*s),
    ``moe_layers`` of them with a mixture of experts as their MLP.

    A MoE block's MLP is not split over tp (its experts are whole; under SP it routes the
    rank's own tokens): only its attention's collectives remain, 2 of the 4 per layer.
    ``partial_grad_bytes``: bytes of the replicated parameters' gradients that sequence
    parallelism all-reduces once per step, after the data-parallel reduction (under ZeRO the
    rank's pieces of them in its gradient shard). ``forwards`` 2: full
    recomputation runs each block's forward again up to its last kept tensor, which leaves out
    the MLP's closing collective: per dense block 2 all_gathers and 1 reduce_scatter more (SP),
    or 1 all_reduce more; per MoE block (whose experts keep tensors after the attention) the
    attention's forward again, 1 all_gather and 1 reduce_scatter (SP) or 1 all_reduce.
    """
    ops: dict[str, float] = {}
    if tp == 1:
        return ops
    act = tokens * hidden * value_bytes
    m = microbatches
    again = forwards - 1
    dense = layers - moe_layers
    if sequence_parallel:
        _add(ops, "all_reduce", m * int(first) * act + partial_grad_bytes)
        _add(ops, "all_gather", m * ((4 + 2 * again) * dense + (2 + again) * moe_layers
                                     + int(first) + int(last)) * act)
        _add(ops, "reduce_scatter", m * ((4 + again) * dense + (2 + again) * moe_layers
                                         + int(last)) * act)
    else:
        _add(ops, "all_reduce", m * ((4 + again) * dense + (2 + again) * moe_layers
                                     + int(first) + int(last)) * act)
    if last:
        _add(ops, "all_reduce", m * 3 * tokens * 4)
    return ops


def pp_ops(*, pp: int, rank: int, virtual_stages: int, microbatches: int, tokens: int,
           hidden: int, value_bytes: int, tp: int = 1,
           sequence_parallel: bool = False) -> dict[str, float]:
    """Payload per step on the PP axis of pipeline ``rank`` (sends equal receives)."""
    ops: dict[str, float] = {}
    if pp == 1:
        return ops
    v = virtual_stages
    act = tokens * hidden * value_bytes / (tp if sequence_parallel else 1)
    boundaries = (v - int(rank == pp - 1)) + (v - int(rank == 0))
    _add(ops, "send", microbatches * boundaries * act)
    _add(ops, "recv", microbatches * boundaries * act)
    return ops


def muon_ops(*, matrices: float, tp_split: float, shard: int, zero: int, tp: int) -> Traffic:
    """Muon's Newton-Schulz exchanges per step (docs/TRAINING.md, Optimizers), fp32: ``matrices``
    hidden-matrix values this rank holds (its tp shards), ``tp_split`` of them cut over tp.
    Under ZeRO (``shard`` ranks) each rank's stretches of the matrices go to their owners and
    the results' stretches come back, an all-to-all each way per bucket: dp.all_to_all
    2 x 4 x matrices / shard (its stretches, 1/shard of the matrices; the way back its owned
    matrices whole, as much on average). Under tp each cut matrix goes to its tp owner and its
    result comes back: two all-to-alls of the rank's shards of them (tp.all_to_all
    2 x 4 x tp_split; the way back is the rank's owned matrices whole, tp_split on average);
    under ZeRO only in its ZeRO owner's TP group, for the 1/shard of them it owns on average."""
    out: Traffic = {}
    zeroed = zero >= 1 and shard > 1
    if zeroed:
        out["dp"] = {"all_to_all": 2 * 4.0 * matrices / shard}
    if tp > 1 and tp_split > 0:
        out["tp"] = {"all_to_all": 2 * 4.0 * tp_split / (shard if zeroed else 1)}
    return out


def other_ops(*, world: int, precision: str) -> dict[str, float]:
    """The per-step scalar reductions over the whole world (small)."""
    if world == 1:
        return {}
    return {"all_reduce": float(SCALAR_BYTES + (4 if precision == "fp16" else 0))}


def total_payload(traffic: Traffic) -> float:
    """Sum of payload bytes over every axis and op."""
    return sum(b for ops in traffic.values() for b in ops.values())


def wire_bytes(ops: dict[str, float], n: int) -> float:
    """Bytes one rank puts on the wire for ``ops`` in a group of ``n`` ranks (ring)."""
    return sum(nbytes * ring_factor(op, n) for op, nbytes in ops.items())
