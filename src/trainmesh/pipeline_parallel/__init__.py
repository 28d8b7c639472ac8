"""Pipeline parallelism: schedules as data (:mod:`.schedules`), their simulation and bubble
analysis (:mod:`.analysis`) and pictures (:mod:`.render`, imported on demand: it pulls in rich
and, when drawing, matplotlib).
"""
from __future__ import annotations

from .analysis import (ScheduleSummary, bubble_fraction, bubble_fraction_per_rank,
                       check_complete, completeness_problems, peak_inflight_microbatches,
                       simulate, summarize)
from .schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, KINDS, SCHEDULES,
                        Action, Schedule, ScheduleError, TimedAction, Timeline, build_schedule)

__all__ = [
    "Action", "BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "FORWARD", "KINDS", "SCHEDULES",
    "Schedule", "ScheduleError", "ScheduleSummary", "TimedAction", "Timeline",
    "bubble_fraction", "bubble_fraction_per_rank", "build_schedule", "check_complete",
    "completeness_problems", "peak_inflight_microbatches", "simulate", "summarize",
]
