"""Efficiencies from step times: a published run's implied one, and ``trainmesh plan --calibrate``.

A run's *implied* efficiency makes the planner's step time for the run's own layout equal the
measured one (:func:`implied_efficiency`, bisection: the step time falls as efficiency rises).
The published runs' are stored in :mod:`.references` (a test recomputes them here).

``trainmesh plan --calibrate RUN.jsonl`` (:func:`calibrate`): the efficiency implied by a run
``trainmesh train`` measured (its layout, tokens per step and mean step time after the first
step), and its peak memory: the ratio of the measured to the predicted dynamic memory (peak less
model states and the fixed part) scales every layout's.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.errors import ConfigError

from .activations import TRAINMESH, Kernels
from .candidate import evaluate
from .cluster import Cluster
from .references import Reference
from .shapes import ModelShape

CALIBRATE_FLAG = "--calibrate"


def step_seconds(layout: ParallelConfig, model: ModelShape, cluster: Cluster,
                 kernels: Kernels = TRAINMESH, optimizer: str = "adamw") -> float:
    return evaluate(layout, model, cluster, kernels, optimizer=optimizer).time.total


def implied_efficiency(layout: ParallelConfig, model: ModelShape, cluster: Cluster,
                       measured_s: float, kernels: Kernels = TRAINMESH,
                       optimizer: str = "adamw") -> float:
    """The efficiency at which the planner's step time for ``layout`` is ``measured_s`` (clamped
    to (0.01, 1]: a step faster than the model allows at peak reads as 1)."""
    lo, hi = 0.01, 1.0
    if step_seconds(layout, model, replace(cluster, efficiency=hi), kernels, optimizer) >= measured_s:
        return hi
    for _ in range(50):
        mid = (lo + hi) / 2
        if step_seconds(layout, model, replace(cluster, efficiency=mid), kernels, optimizer) > measured_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def reference_setup(ref: Reference) -> tuple[ParallelConfig, ModelShape, Cluster]:
    """The layout, model and cluster of a published run (the cluster's efficiency unset)."""
    from trainmesh.core.gpus import gpu

    from .published import published
    row = gpu(ref.gpu)
    model = replace(published(ref.model).shape, micro_batch=ref.micro_batch, seq_len=ref.seq_len)
    layout = ParallelConfig(**{"precision": "bf16", **ref.layout})
    cluster = Cluster(**{"gpus": ref.gpus, "gpus_per_node": row.gpus_per_node, "gpu": ref.gpu,
                         "gpu_mem_bytes": int(ref.gpu_mem_bytes or row.mem_bytes),
                         "intra_node_bw": row.intra_node_bw, "inter_node_bw": row.inter_node_bw,
                         "peak_flops": (row.peak("bf16") or 0) * 1e12, **ref.cluster})
    return layout, model, cluster


def reference_efficiency(ref: Reference) -> float:
    """The efficiency a published run implies (what ``ref.efficiency`` stores)."""
    layout, model, cluster = reference_setup(ref)
    return implied_efficiency(layout, model, cluster, ref.step_time_s, ref.kernels)


@dataclass(frozen=True)
class Calibration:
    """What a measured run sets: the efficiency and the memory scale, and how."""

    efficiency: float
    memory_scale: float
    source: str


def read_run(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(summary record, step records) of a ``trainmesh train --metrics-out`` file; ConfigError
    naming --calibrate when it is missing or is not one."""
    try:
        lines = Path(path).read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except FileNotFoundError:
        raise ConfigError(CALIBRATE_FLAG, f"no such file {path!r}; valid: a metrics file written "
                          "by trainmesh train --metrics-out") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(CALIBRATE_FLAG, f"cannot read {path} as JSON lines: {exc}") from None
    summary = next((r for r in records if isinstance(r, dict) and r.get("event") == "summary"), None)
    steps = [r for r in records if isinstance(r, dict) and r.get("event") == "step"
             and isinstance(r.get("step_time_s"), (int, float)) and isinstance(r.get("tokens"), int)]
    if summary is None or not steps or not isinstance(summary.get("layout"), dict):
        raise ConfigError(CALIBRATE_FLAG, f"{path} has no summary with a layout and step records; "
                          "valid: a metrics file of a finished trainmesh train run")
    return summary, steps


def _layout(summary: dict[str, Any]) -> ParallelConfig:
    names = ParallelConfig.field_names()
    fields = {k: v for k, v in summary["layout"].items() if k in names}
    if fields.get("dp_shard") == fields.get("dp"):
        fields.pop("dp_shard", None)
    try:
        return ParallelConfig(**fields)
    except (ConfigError, TypeError) as exc:
        raise ConfigError(CALIBRATE_FLAG, f"the run's layout is not one trainmesh takes: {exc}") from None


def calibrate(path: str, model: ModelShape, cluster: Cluster, kernels: Kernels = TRAINMESH,
              optimizer: str = "adamw") -> Calibration:
    """The efficiency and memory scale a measured run implies for ``model`` on ``cluster``'s
    accelerators (the run's own layout on its own number of GPUs), the run trained with
    ``optimizer`` (Muon's step is part of its measured step time)."""
    summary, steps = read_run(path)
    params = summary.get("params")
    if not isinstance(params, int) or abs(params - model.params) > 0.02 * model.params:
        raise ConfigError(CALIBRATE_FLAG, f"the run trained {params} parameters, the model planned "
                          f"has {model.params}; valid: a run of the same model")
    layout = _layout(summary)
    timed = steps[1:] or steps
    step_s = statistics.mean(r["step_time_s"] for r in timed)
    tokens = statistics.mean(r["tokens"] for r in timed)
    batch = max(1, round(tokens / model.seq_len / (layout.dp * layout.microbatches)))
    run_model = replace(model, micro_batch=batch)
    gpus = layout.world_size
    run_cluster = replace(cluster, gpus=gpus, gpus_per_node=min(cluster.gpus_per_node, gpus),
                          efficiency=None, memory_scale=1.0)
    eff = implied_efficiency(layout, run_model, run_cluster, step_s, kernels, optimizer)
    scored = evaluate(layout, run_model, replace(run_cluster, efficiency=eff, fragmentation=1.0), kernels,
                      optimizer=optimizer)
    measured = max((r.get("peak_mem_bytes") or 0) for r in summary.get("ranks", []) if isinstance(r, dict))
    mem = scored.memory
    dynamic = mem.activations + mem.overhead - cluster.framework_overhead_bytes
    scale = (measured - mem.model_states) / dynamic if measured and dynamic > 0 else 1.0
    scale = min(max(scale, 0.25), 4.0)
    return Calibration(eff, scale, f"efficiency {eff:.0%} of peak and memory x{scale:.2f} from "
                       f"{path} (dp={layout.dp} pp={layout.pp} tp={layout.tp} cp={layout.cp} "
                       f"ep={layout.ep}, {step_s:.3g} s per step on {gpus} GPUs)")
