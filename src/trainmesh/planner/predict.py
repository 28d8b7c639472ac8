"""Predict what ``trainmesh train --metrics-out`` measures for one layout of the built-in GPT.

For every rank: ``model_state_bytes`` (the ZeRO accounting of :mod:`.memory` on the rank's own
parameters, :mod:`.builtin`), ``comm_bytes_per_step`` (:mod:`.traffic`, docs/METRICS.md's keys and
payload convention) and ``peak_mem_bytes``. The first two are exact up to ZeRO shard padding and
a few bytes of scalars; compare them within 1% (the expert all-to-all within 5%: routing is
taken as balanced). The peak is :mod:`.peak`'s on the rank's own states, activations in flight
and buffers; on CPU (process RSS)::

    peak = base + runtime + model states + glibc's resident share of the dynamic memory

``base`` is measured, never assumed: a process's footprint after importing torch depends on the
wheel (~220 MiB for torch 2.13 CPU, ~650 MiB for a CUDA build with no GPU in use). A worker
records its own in the summary (``base_mem_bytes``: RSS after joining the job, before building
the model) and :func:`compare` predicts on top of it; a prediction made ahead of a run
(``trainmesh plan --model``) measures the planning process itself, which has imported the same
torch (:func:`measured_base_bytes`). Workers measure it after torch's deferred imports,
and the planning process adds what those imports take (:data:`~trainmesh.core.compat.DEFERRED_IMPORT_BYTES`)
where it has not done them; a worker forked by the launcher's fork server measures less than the planning
process (about 64 MiB of torch's code pages are shared with the server and not yet touched), so a
plan made ahead of a local run errs on the safe side. ``runtime`` (:data:`RUNTIME_BYTES`) is what
the first set-up and step add whatever the model: the kernel code they page in. On CUDA the
summary reports ``max_memory_allocated``, so base, runtime and the allocator's reserve are left
out there (not yet calibrated on a GPU); ``reserved=True`` predicts what the GPU must hold.
Compare the peak within 10% (benchmarks/plan_vs_measured.py, docs/PLANNER.md).
Activations follow :mod:`.activations` (the built-in GPT's own count, MoE blocks by what the
layer saves with balanced routing; pipeline microbatches in flight per schedule). Mixed
precision is predicted ZeRO-paper style (16-bit parameters and gradients, fp32 master in the
optimizer states); AdamW's per-tensor ``step`` counters (4 bytes
per parameter tensor, or per flat shard under ZeRO) are included. Under context parallelism each
rank holds s/cp tokens, sends the K/V traffic of docs/CONTEXT_PARALLEL.md (axis ``cp``) and
reduces gradients over dp x cp (axis ``dp_cp``, ZeRO shards over it).

The lead's measured-vs-predicted check calls :func:`predict_run` with the run's
:class:`~trainmesh.config.train.TrainConfig` and :func:`compare` with the metrics summary.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.axes import kind_groups
from trainmesh.core.layout import Layout

from ..models.gpt import GPTConfig
from . import rank_bytes
from .builtin import rank_model
from .memory import element_bytes
from .peak import CPU, CUDA, CUDA_ALLOCATED, CUDA_FIXED, Allocator
from .rank_bytes import sequence_sums, zero3_gathered_bytes
from .traffic import AXES, Traffic

__all__ = ["RankPrediction", "RunPrediction", "compare", "measured_base_bytes", "predict_layout",
           "predict_run", "sequence_sums", "zero3_gathered_bytes"]

RUNTIME_BYTES = 25 * 2**20
"""CPU: what a worker's RSS grows by beyond its measured base (taken after torch's deferred
imports, :func:`~trainmesh.core.compat.load_lazy_imports`) and its model: the kernel code that
building the model and the first step page in, 5-30 MiB measured (spawned and forked workers)."""

TOLERANCE = {"model_state_bytes": 0.01, "comm_bytes_per_step": 0.01, "peak_mem_bytes": 0.1,
             "init_peak_mem_bytes": 0.2, "ep.all_to_all": 0.05}
"""Relative tolerance of each predicted field (the all-to-all is predicted for balanced routing;
a real run's imbalance moves it by a few percent)."""


@dataclass(frozen=True)
class RankPrediction:
    """One rank's predicted ``ranks[i]`` entry of the metrics summary."""

    rank: int
    coords: dict[str, int]
    model_state_bytes: dict[str, int]
    comm_bytes_per_step: dict[str, dict[str, int]]
    activation_bytes: int
    peak_mem_bytes: int
    base_mem_bytes: int = 0
    """The base footprint ``peak_mem_bytes`` assumes (before runtime and model)."""
    init_peak_mem_bytes: int = 0
    """The set-up peak (sharded initialisation): see :func:`.rank_bytes.init_peak`."""
    offloaded_bytes: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "nvme": 0})
    """Model-state bytes kept off the compute device (``--offload``): in host memory or files."""

    def at(self, rank: int, coords: dict[str, int]) -> RankPrediction:
        """This prediction for another rank (of the same pipeline stage), with its own dicts."""
        return replace(self, rank=rank, coords=coords,
                       model_state_bytes=dict(self.model_state_bytes),
                       comm_bytes_per_step={k: dict(v) for k, v in self.comm_bytes_per_step.items()},
                       offloaded_bytes=dict(self.offloaded_bytes))

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "coords": self.coords, "model_state_bytes": self.model_state_bytes,
                "comm_bytes_per_step": self.comm_bytes_per_step,
                "activation_bytes": self.activation_bytes, "peak_mem_bytes": self.peak_mem_bytes,
                "base_mem_bytes": self.base_mem_bytes, "init_peak_mem_bytes": self.init_peak_mem_bytes,
                "offloaded_bytes": self.offloaded_bytes}


@dataclass(frozen=True)
class RunPrediction:
    """Predicted summary of one run: layout, logical parameter count, every rank."""

    layout: dict[str, Any]
    params: int
    ranks: list[RankPrediction]
    tolerance: dict[str, float] = field(default_factory=lambda: dict(TOLERANCE))
    row_bytes: int = 0
    """All-to-all bytes one row moves per step (the hidden width times the value's bytes, once
    per exchange of a row: dispatch and combine, forward, recomputed forward and backward):
    what a rank's expert receiving a row beyond the balanced count adds (:func:`compare`)."""

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "params": self.params, "world_size": len(self.ranks),
                "ranks": [r.to_json() for r in self.ranks], "tolerance": self.tolerance}


def _ints(traffic: Traffic) -> dict[str, dict[str, int]]:
    axes = [*AXES, *(a for a in traffic if a not in AXES)]
    return {axis: {op: int(round(b)) for op, b in traffic.get(axis, {}).items()} for axis in axes}


def _stage_prediction(gpt: GPTConfig, layout: ParallelConfig, pp_rank: int, *, optimizer: str,
                      micro_batch: int, base_bytes: int, runtime_bytes: int, allocator: Allocator,
                      host_resident: bool, documents: bool = False) -> RankPrediction:
    """The prediction of a rank of pipeline stage ``pp_rank`` (rank and coordinates left to fill:
    the ranks of one stage hold, keep and send alike)."""
    held = rank_model(gpt, pp=layout.pp, tp=layout.tp, rank=pp_rank,
                      virtual_stages=layout.virtual_stages, ep=layout.ep)
    states = rank_bytes.device_states(held, layout, optimizer)
    stage = rank_bytes.stage(held, layout, gpt, micro_batch, pp_rank, allocator.threshold)
    comm = _ints(rank_bytes.rank_traffic(held, layout, gpt, micro_batch, pp_rank, documents,
                                         optimizer=optimizer))
    offloaded = rank_bytes.offloaded(held, layout, optimizer, states)
    host = offloaded["cpu"] if host_resident else 0
    peak = int(base_bytes + runtime_bytes + sum(states.values()) + host
               + allocator.resident(stage, rank_bytes.buffers(held, layout, gpt, states)))
    return RankPrediction(-1, {}, states, comm, int(stage.kept), peak, int(base_bytes),
                          rank_bytes.init_peak(held, layout, gpt, states, base_bytes + runtime_bytes),
                          offloaded)


def predict_layout(gpt: GPTConfig, layout: ParallelConfig, *, global_batch: int,
                   optimizer: str = "adamw", base_bytes: int,
                   runtime_bytes: int = RUNTIME_BYTES,
                   allocator: Allocator = CPU, host_resident: bool = True,
                   documents: bool = False) -> RunPrediction:
    """Per-rank predictions for ``layout`` of ``gpt`` at ``global_batch`` sequences per step, on
    workers whose footprint before the model is ``base_bytes``. ``host_resident``: the device
    is the host (CPU), so states offloaded to host memory count in its peak; ``documents``:
    packed batches."""
    micro_batch = global_batch // (layout.dp * layout.microbatches)
    stages = [_stage_prediction(gpt, layout, pp_rank, optimizer=optimizer, micro_batch=micro_batch,
                                base_bytes=base_bytes, runtime_bytes=runtime_bytes,
                                allocator=allocator, host_resident=host_resident,
                                documents=documents)
              for pp_rank in range(layout.pp)]
    ranks = []
    for rank in range(layout.layout.world):   # every rank predicts as its pipeline stage does
        coords = layout.layout.coords(rank)
        ranks.append(stages[coords["pp"]].at(rank, coords))
    passes = 1 + (2 if layout.recompute == "full" else 1)   # each row received goes back
    return RunPrediction(layout.layout_record(), gpt.num_params(), ranks,
                         row_bytes=passes * gpt.d_model * element_bytes(layout.precision))


def measured_base_bytes(device: str = "cpu") -> int:
    """This process's footprint now, as the base of a worker on this machine: its RSS on CPU
    (torch is imported: the wheel's share is in it); 0 on CUDA, where the allocator counts."""
    if device == "cuda":
        return 0
    import torch

    from trainmesh.core.compat import DEFERRED_IMPORT_BYTES, lazy_imports_loaded
    from trainmesh.observe.metrics import memory_now
    base = memory_now(torch.device("cpu"))
    # a worker measures after torch's deferred imports; counted, not done (the launcher's check)
    return base if lazy_imports_loaded() else base + DEFERRED_IMPORT_BYTES


def predict_run(cfg: Any, *, base_bytes: int | None = None, reserved: bool = False) -> RunPrediction:
    """Predictions for a :class:`~trainmesh.config.train.TrainConfig` (what a run will measure).

    ``base_bytes`` defaults to :func:`measured_base_bytes` (this process, this machine).
    ``reserved``: on CUDA, what the GPU must hold (the caching allocator's reserve and the CUDA
    context) rather than what ``max_memory_allocated`` will measure.
    """
    device = getattr(cfg, "device", "cpu")
    if device == "auto":
        from trainmesh.core.distributed import choose_device, visible_gpus
        device, _ = choose_device("auto", local_ranks=cfg.parallel.world_size, gpus=visible_gpus())
    if base_bytes is None:
        base_bytes = measured_base_bytes(device)
    cuda = device == "cuda"   # CUDA: max_memory_allocated, the allocator's reserve left out
    runtime = (CUDA_FIXED if reserved else 0) if cuda else RUNTIME_BYTES
    allocator = (CUDA if reserved else CUDA_ALLOCATED) if cuda else CPU
    return predict_layout(cfg.gpt_config(), cfg.parallel, global_batch=cfg.global_batch,
                          optimizer=cfg.optimizer, base_bytes=base_bytes, runtime_bytes=runtime,
                          allocator=allocator, host_resident=not cuda,
                          documents=getattr(cfg, "documents", "stream") == "packed")


def _close(predicted: float, measured: float, rel: float) -> bool:
    return abs(predicted - measured) <= rel * max(abs(measured), 1.0)


def _routed(prediction: RunPrediction, summary: dict[str, Any], got: dict[str, Any]) -> float | None:
    """The all-to-all bytes per step this rank's routing adds over the balanced one the
    prediction assumes (its experts received R rows where its slots were S), from the
    summary's ``moe_rows`` and step count; None without them."""
    rows, steps = got.get("moe_rows"), summary.get("steps")
    if not rows or not steps or not prediction.row_bytes:
        return None
    sent = sum(sum(layer) for layer in rows["routed"])
    return prediction.row_bytes * (sum(rows["received"]) - sent) / steps


def _shard_means(prediction: RunPrediction, summary: dict[str, Any]) -> dict[int, float]:
    """SP under ZeRO: each rank sums over tp its pieces of the partial gradients in its
    gradient shard, and where a shard boundary cuts a parameter moves a few values between the
    ranks of the group; over the group they add up to what the prediction gives each rank
    1/N of. Rank -> the mean of ``tp.all_reduce`` over its dense group (empty elsewhere)."""
    layout = prediction.layout
    if not (layout.get("sequence_parallel") and layout.get("zero", 0) >= 1 and layout.get("tp", 1) > 1):
        return {}
    d = Layout.of(layout)
    tp = {r["rank"]: r["comm_bytes_per_step"].get("tp", {}).get("all_reduce", 0)
          for r in summary.get("ranks", [])}
    out = {}
    for group in d.members(kind_groups(d, "dense").reduce):
        if all(rank in tp for rank in group):
            out.update({rank: sum(tp[r] for r in group) / len(group) for rank in group})
    return out


def compare(prediction: RunPrediction, summary: dict[str, Any]) -> list[str]:
    """Every predicted number outside its tolerance of the measured ``summary`` (empty: all agree).

    ``summary`` is the ``{"event": "summary", ...}`` record of ``--metrics-out``. Two numbers
    depend on what no plan knows ahead: the all-to-all on the routing (predicted balanced; where
    the summary has ``moe_rows`` its imbalance is taken out and the rest compared as any
    traffic, else within :data:`TOLERANCE`'s ``ep.all_to_all``), and under SP with ZeRO each
    rank's share of the partial gradients on its shard boundaries (compared as the group's mean,
    :func:`_shard_means`).
    """
    problems = []
    measured = {r["rank"]: r for r in summary.get("ranks", [])}
    means = _shard_means(prediction, summary)
    if summary.get("params") not in (None, prediction.params):
        problems.append(f"params: predicted {prediction.params}, measured {summary['params']}")
    for pred in prediction.ranks:
        got = measured.get(pred.rank)
        if got is None:
            problems.append(f"rank {pred.rank}: missing from the summary")
            continue
        for kind, want in pred.model_state_bytes.items():
            have = got["model_state_bytes"].get(kind, 0)
            if not _close(want, have, TOLERANCE["model_state_bytes"]):
                problems.append(f"rank {pred.rank} model_state_bytes.{kind}: "
                                f"predicted {want}, measured {have}")
        for where, have in got.get("offloaded_bytes", {}).items():
            if where != "cpu":   # the store's files: written as it goes, not predicted here
                continue
            want = pred.offloaded_bytes.get(where, 0)
            if not _close(want, have, TOLERANCE["model_state_bytes"]):
                problems.append(f"rank {pred.rank} offloaded_bytes.{where}: "
                                f"predicted {want}, measured {have}")
        axes = sorted(set(AXES) | set(pred.comm_bytes_per_step) | set(got["comm_bytes_per_step"]))
        for axis in axes:
            ops = set(pred.comm_bytes_per_step.get(axis, {})) | set(got["comm_bytes_per_step"].get(axis, {}))
            for op in sorted(ops):
                want = pred.comm_bytes_per_step.get(axis, {}).get(op, 0)
                have = got["comm_bytes_per_step"].get(axis, {}).get(op, 0)
                rel = TOLERANCE.get(f"{axis}.{op}", TOLERANCE["comm_bytes_per_step"])
                routed = _routed(prediction, summary, got) if (axis, op) == ("ep", "all_to_all") else None
                if routed is not None:   # the routing's share taken out: the rest is exact
                    have, rel = have - routed, TOLERANCE["comm_bytes_per_step"]
                if (axis, op) == ("tp", "all_reduce") and pred.rank in means:
                    have = means[pred.rank]
                if not _close(want, have, rel):
                    problems.append(f"rank {pred.rank} comm_bytes_per_step.{axis}.{op}: "
                                    f"predicted {want}, measured {have}")
        shift = got.get("base_mem_bytes", pred.base_mem_bytes) - pred.base_mem_bytes
        for key in ("peak_mem_bytes", "init_peak_mem_bytes"):
            want = getattr(pred, key) + shift   # on the base the run measured
            if key in got and not _close(want, got[key], TOLERANCE[key]):
                problems.append(f"rank {pred.rank} {key}: predicted {want} (on the measured base), "
                                f"measured {got[key]}")
    return problems
