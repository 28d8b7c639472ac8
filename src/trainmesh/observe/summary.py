"""The run's summary record (docs/METRICS.md): one builder for every kind of run.

The mesh trainer, the parameter server's trainers and a fault-tolerant run's launcher each
report their run with :func:`summary_record`: the same leading fields in the same order (world
size, layout, parameter count, final loss, steps, the rank rows), then what that kind of run
adds (throughput, MoE routing, staleness, fault tolerance's tally).
"""
from __future__ import annotations

from typing import Any

from trainmesh.observe.layout import layout_record


def summary_record(cfg: Any, *, final_loss: float, steps: int, ranks: list[dict[str, Any]],
                   world_size: int | None = None, **extra: Any) -> dict[str, Any]:
    """The ``summary`` record of the run of ``cfg`` (its TrainConfig): ``world_size`` (default:
    the configuration's, servers included), its layout, its logical parameter count, then
    ``final_loss``, ``steps`` taken, the ``ranks`` rows and ``extra`` fields, in that order."""
    return {"event": "summary",
            "world_size": cfg.parallel.world_size if world_size is None else world_size,
            "layout": layout_record(cfg), "params": cfg.num_params(), "final_loss": final_loss,
            "steps": steps, "ranks": ranks, **extra}
