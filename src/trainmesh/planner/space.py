"""The layouts the advisor searches: every axis, the choices on each, and what refuses a
combination, in one place.

:data:`AXES` lists the axes in the order they are chosen, each with a function giving its
choices given the ones already made (a :class:`Choice` so far) and the :class:`Problem` (model,
cluster, batch). :func:`layouts` walks their product and keeps what :func:`refusal` lets
through. A refusal is either trainmesh's own (:class:`~trainmesh.config.parallel.ParallelConfig`
validation, the same that `trainmesh train` applies: a layout the trainer refuses is never
recommended) or one of the planner's :data:`PRUNE` rules, which leave out layouts that are
valid but never worth scoring, each with its reason.

Where the table of axes lives elsewhere (``core/axes.py``: each axis's degree and planner choices,
and the rules that refuse a combination), this is the only module that changes: :func:`choices`
reads each axis's choices from its row instead of :data:`AXES`, and :func:`refusal` asks its
rules instead of building a ParallelConfig.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.errors import ConfigError

from .activations import RECOMPUTE
from .cluster import Cluster
from .shapes import ModelShape

MAX_CP = 32
"""The largest context-parallel degree scored (sequences of ~1M tokens need about this)."""

Choice = dict[str, Any]
"""The fields chosen so far (ParallelConfig field -> value)."""


@dataclass(frozen=True)
class Problem:
    """What the choices depend on."""

    model: ModelShape
    cluster: Cluster
    precision: str
    global_batch: int
    axes_allowed: frozenset[str] = frozenset({"tp", "pp", "cp", "ep"})
    """Model-parallel axes the model declares plans for (``--model-dir``); all by default."""
    max_layers: int = 0
    """``pp`` at most this (the layers, or the nominal count without a shape)."""
    optimizer: str = "adamw"
    """The optimizer whose states and step the layouts are scored with (adamw, sgd, muon)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def _tp(c: Choice, p: Problem) -> list[int]:
    dims = (p.model.heads, p.model.hidden, p.model.kv_heads)
    return [t for t in _divisors(p.cluster.node_size)   # a TP group never leaves a node
            if p.cluster.gpus % t == 0 and all(not d or d % t == 0 for d in dims)
            and (t == 1 or "tp" in p.axes_allowed)]


def _cp(c: Choice, p: Problem) -> list[int]:
    if not p.model.has_shape or "cp" not in p.axes_allowed:
        return [1]
    rest = p.cluster.gpus // c["tp"]
    return [cp for cp in _powers_of_two(MAX_CP) if rest % cp == 0 and p.model.seq_len % (2 * cp) == 0]


def _pp(c: Choice, p: Problem) -> list[int]:
    rest = p.cluster.gpus // (c["tp"] * c["cp"])
    return [pp for pp in _divisors(rest) if pp <= p.max_layers and (pp == 1 or "pp" in p.axes_allowed)]


def _dp(c: Choice, p: Problem) -> list[int]:
    dp = p.cluster.gpus // (c["tp"] * c["cp"] * c["pp"])
    return [dp] if p.global_batch % (dp * p.model.micro_batch) == 0 else []


def _microbatches(c: Choice, p: Problem) -> list[int]:
    return [p.global_batch // (c["dp"] * p.model.micro_batch)]


def _ep(c: Choice, p: Problem) -> list[int]:
    if not p.model.experts or "ep" not in p.axes_allowed:
        return [1]
    group = c["dp"] * c["cp"]
    return [ep for ep in _powers_of_two(p.model.experts) if group % ep == 0 and p.model.experts % ep == 0]


def _schedule(c: Choice, p: Problem) -> list[tuple[str, int]]:
    """1F1B; interleaved over 2 virtual stages where each has a layer and microbatches come in
    rounds of pp."""
    out = [("1f1b", 1)]
    if c["pp"] > 1 and p.max_layers >= 2 * c["pp"] and c["microbatches"] % c["pp"] == 0:
        out.append(("interleaved", 2))
    return out


def _zero(c: Choice, p: Problem) -> list[int]:
    return [0, 1, 2, 3]


def _dp_shard(c: Choice, p: Problem) -> list[int | None]:
    """Plain ZeRO over all dp ranks, or HSDP sharding inside a node's worth of dp ranks."""
    shard = p.cluster.node_size // (c["tp"] * c["cp"])
    hsdp = c["zero"] >= 1 and 1 < shard < c["dp"] and c["dp"] % shard == 0
    return [None, shard] if hsdp else [None]


def _memory(c: Choice, p: Problem) -> list[tuple[str, str]]:
    """(recompute, offload) from the cheapest in time to the most saving in memory: recompute
    none, selective, full (a shape is needed to count what they save), then CPU offload (ZeRO >= 1)
    with each."""
    recomputes = list(RECOMPUTE) if p.model.has_shape else ["none"]
    offloads = ["none", "cpu"] if c["zero"] >= 1 else ["none"]
    return [(r, o) for o in offloads for r in recomputes]


def _cp_comm(c: Choice, p: Problem) -> list[str]:
    return ["ring", "allgather"] if c["cp"] > 1 else ["ring"]


def _strategy(c: Choice, p: Problem) -> list[str]:
    """The mesh; DiLoCo where its whole fp32 replicas could be (dp > 1, fp32)."""
    return ["mesh", "diloco"] if c["dp"] > 1 and p.precision == "fp32" else ["mesh"]


AXES: tuple[tuple[str | tuple[str, ...], Callable[[Choice, Problem], list[Any]]], ...] = (
    ("tp", _tp), ("cp", _cp), ("pp", _pp), ("dp", _dp), ("microbatches", _microbatches),
    ("ep", _ep), (("schedule", "virtual_stages"), _schedule), ("zero", _zero),
    ("dp_shard", _dp_shard), ("cp_comm", _cp_comm), ("strategy", _strategy),
    (("recompute", "offload"), _memory),
)
"""The axes in the order they are chosen, and each one's choices given those made before. The
last, the memory savers (recompute and offload), is ordered from the cheapest in time: the
advisor stops at the first that fits (:func:`groups`), as anything after it is slower."""

PRUNE: tuple[tuple[str, Callable[[Choice], bool]], ...] = (
    ("ZeRO-2/3 inside a pipeline reduce or gather again for every microbatch (Megatron and "
     "DeepSpeed pair pipelines with ZeRO-1)", lambda c: c.get("pp", 1) > 1 and c.get("zero", 0) >= 2),
    ("a ZeRO stage over one replica shards nothing; only worth it to offload",
     lambda c: c.get("dp", 1) * c.get("cp", 1) == 1 and c.get("zero", 0) >= 1
     and c.get("offload", "none") == "none"),
)
"""Valid layouts the advisor does not score, and why."""


def choices(axis: str | tuple[str, ...], choice: Choice, problem: Problem) -> list[Any]:
    """The choices of ``axis`` given the fields chosen so far."""
    return dict(AXES)[axis](choice, problem)


def refusal(fields: Choice) -> str | None:
    """Why ``fields`` is not scored (:data:`PRUNE`, then trainmesh's own validation), or None."""
    built = _build(fields)
    return built if isinstance(built, str) else None


def _build(fields: Choice) -> ParallelConfig | str:
    """The layout of ``fields``, or why it is refused."""
    for why, rule in PRUNE:
        if rule(fields):
            return why
    try:
        return ParallelConfig(**fields)
    except ConfigError as exc:
        return str(exc)


def _walk(index: int, choice: Choice, problem: Problem, stop: int) -> Iterator[Choice]:
    if index == stop:
        yield dict(choice)
        return
    axis, _ = AXES[index]
    for value in choices(axis, choice, problem):
        names = axis if isinstance(axis, tuple) else (axis,)
        values = value if isinstance(axis, tuple) else (value,)
        yield from _walk(index + 1, {**choice, **dict(zip(names, values))}, problem, stop)


COMPLETED = ("precision", "sequence_parallel", "offload_params")
"""Fields each layout gets without being an axis of its own (:func:`_complete`): the problem's
precision, sequence parallelism wherever tp > 1 (it only saves memory, with or without offload)
and, offloading at ZeRO-3, the parameter shards too."""


def _complete(fields: Choice, problem: Problem) -> Choice:
    return {**fields, "precision": problem.precision, "sequence_parallel": fields["tp"] > 1,
            "offload_params": fields["offload"] != "none" and fields["zero"] == 3}


def fields() -> set[str]:
    """Every :class:`~trainmesh.config.parallel.ParallelConfig` field the space sets: its axes'
    and :data:`COMPLETED`."""
    named = {n for axis, _ in AXES for n in (axis if isinstance(axis, tuple) else (axis,))}
    return named | set(COMPLETED)


def groups(problem: Problem) -> Iterator[Iterator[ParallelConfig]]:
    """For each choice of every axis but the memory savers, its layouts from the cheapest memory
    saver on (refused ones left out), built as they are asked for."""
    last = len(AXES) - 1
    for fields in _walk(0, {}, problem, last):
        yield _variants(fields, problem, last)


def _variants(fields: Choice, problem: Problem, last: int) -> Iterator[ParallelConfig]:
    for full in _walk(last, fields, problem, len(AXES)):
        built = _build(_complete(full, problem))
        if not isinstance(built, str):
            yield built


def layouts(problem: Problem) -> list[ParallelConfig]:
    """Every layout of ``problem`` that no refusal leaves out."""
    return [cfg for group in groups(problem) for cfg in group]
