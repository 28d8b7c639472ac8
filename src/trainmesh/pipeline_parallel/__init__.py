"""Pipeline parallelism: schedules as data (:mod:`.schedules`), their simulation and bubble
analysis (:mod:`.analysis`) and pictures (:mod:`.render`, imported on demand: it pulls in rich
and, when drawing, matplotlib); the runtime that executes them (:mod:`.runtime`, with
:mod:`.partition`, :mod:`.stage`, :mod:`.p2p` and :mod:`.timeline`), imported on first use.
Imports core and comm only.
"""
from __future__ import annotations

from .analysis import (
    ScheduleSummary,
    bubble_fraction,
    bubble_fraction_per_rank,
    check_complete,
    completeness_problems,
    peak_inflight_microbatches,
    simulate,
    summarize,
)
from .partition import balanced_cuts, named_pipeline_layers, partition
from .schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    KINDS,
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    TimedAction,
    Timeline,
    build_schedule,
)

__all__ = [
    "Action", "BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "FORWARD", "KINDS", "SCHEDULES",
    "Schedule", "ScheduleError", "ScheduleSummary", "TimedAction", "Timeline",
    "bubble_fraction", "bubble_fraction_per_rank", "build_schedule", "check_complete",
    "completeness_problems", "peak_inflight_microbatches", "simulate", "summarize",
    "balanced_cuts", "named_pipeline_layers", "partition",
    "PipelineExecutor", "gather_timeline", "write_timeline",
]

_LAZY = {"PipelineExecutor": "runtime", "gather_timeline": "timeline", "write_timeline": "timeline"}


def __getattr__(name: str):
    """The runtime pulls in the communication layer: import it only when asked for."""
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
