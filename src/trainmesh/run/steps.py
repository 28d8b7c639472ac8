"""How the training loop gets its steps: a step policy yields every step this rank took.

The loop of :mod:`trainmesh.run.trainer` is the same for every run; what differs is the policy
it takes:

- :class:`LocalSteps` (every run but a fault-tolerant one, the parameter server's trainers
  included): each step once, in order, on this DP rank's slice of the global batch;
- :class:`~trainmesh.run.ft_steps.QuorumSteps` (a fault-tolerant replica): each step is a quorum
  decision; the global batch is split among the replicas present; an attempt can be discarded
  and redone, and a returning replica jumps ahead with the live state it copied.

A policy also says which replica writes what a step leads to (checkpoint, evaluation,
TensorBoard) and where the metrics records go.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from trainmesh.core.step import StepReport
from trainmesh.data.corpus import dp_slice
from trainmesh.data.packing import documents_in
from trainmesh.engine.engine import Engine
from trainmesh.observe.flops import document_len
from trainmesh.observe.progress import Progress
from trainmesh.observe.tensorboard import TensorBoardLog

MAX_NONFINITE_SKIPS = 10
"""--on-nonfinite skip: this many non-finite steps in a row end the run as with stop."""


def nonfinite_ends_run(on_nonfinite: str, in_a_row: int) -> str | None:
    """Whether a non-finite step that makes ``in_a_row`` in a row ends the run: the policy as
    the headline names it (``stop``; ``skip, 10 in a row``), or None where the step is skipped.
    The same on every replica of a fault-tolerant run: the count is part of the training state."""
    if on_nonfinite == "skip":
        return None if in_a_row < MAX_NONFINITE_SKIPS else f"skip, {in_a_row} in a row"
    return on_nonfinite


@dataclass(frozen=True)
class StepDone:
    """A step this rank took (applied, or skipped for an fp16 overflow or a non-finite value)."""

    step: int
    report: StepReport
    """What the engine's step returned (loss, gradient norm, learning rate, ...)."""
    t0: float
    """When its (last) attempt began (``perf_counter`` seconds)."""
    dt: float
    """Seconds of that attempt."""
    row: dict[str, Any] = field(default_factory=dict)
    """Fields the metrics row of the step adds (a fault-tolerant step's ``replicas``)."""
    lead: bool = True
    """This rank's replica writes the step's checkpoint, evaluation and TensorBoard scalars."""

    @property
    def loss(self) -> float:
        """The step's loss (:attr:`report`'s)."""
        return self.report.loss


class Records(Protocol):
    """Where the metrics records go (:class:`~trainmesh.observe.metrics.MetricsWriter`)."""

    def write(self, record: dict[str, Any]) -> None: ...


class StepPolicy(Protocol):
    def resumes(self) -> bool:
        """Whether this rank loads the newest checkpoint before its first step."""

    def records(self, start: int, board: TensorBoardLog) -> Records:
        """Where this rank's metrics records go, the run starting at step ``start``; the
        metrics file's writer hands each to ``board`` too."""

    def run(self, start: int, last: int, *, enabled: bool,
            before_step: Callable[[int], None] | None) -> Iterator[StepDone]:
        """The steps ``start..last`` this rank takes, in order."""

    def summarize(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The run's summary record as this policy reports it."""

    @property
    def led_last(self) -> bool:
        """This rank's replica writes what the run leaves at its end (trace, timeline)."""

    @property
    def summary(self) -> bool:
        """This rank's records include the run's summary (printed too)."""


class LocalSteps:
    """Every step once, in order, on this DP rank's rows (module docstring)."""

    led_last = True
    summary = True

    def __init__(self, engine: Engine, dataset: Any, *, seed: int, global_batch: int,
                 device: torch.device, tokens: int,
                 records: Callable[[int, TensorBoardLog], Records], resumes: bool = True) -> None:
        self.engine, self.dataset, self.device = engine, dataset, device
        self.seed, self.global_batch, self.tokens = seed, global_batch, tokens
        self._records, self._resumes = records, resumes

    def resumes(self) -> bool:
        """Asked for with --resume, or an elastic restart (the trainer decides); never for an
        engine without checkpoints (a parameter-server trainer's)."""
        return self._resumes

    def records(self, start: int, board: TensorBoardLog) -> Records:
        return self._records(start, board)

    def summarize(self, summary: dict[str, Any]) -> dict[str, Any]:
        return summary

    def _batch(self, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """This rank's rows of step ``step``, and what the step's row says of the global batch
        (a packed batch's ``documents`` and ``document_len``)."""
        index, count = self.engine.batch_share()
        whole = self.dataset.batch(self.seed, step, self.global_batch)
        docs = documents_in(whole)
        batch = dp_slice(whole, index, count)
        return {k: v.to(self.device) for k, v in batch.items()}, ({} if docs is None else {
            "documents": docs, "document_len": document_len(whole["position_ids"])})

    def run(self, start: int, last: int, *, enabled: bool,
            before_step: Callable[[int], None] | None) -> Iterator[StepDone]:
        with Progress(total=last, enabled=enabled, start=start - 1) as bar:
            for step in range(start, last + 1):
                batch, row = self._batch(step)
                if before_step is not None:
                    before_step(step)
                t0 = time.perf_counter()
                report = self.engine.step(batch)
                dt = time.perf_counter() - t0
                yield StepDone(step, report, t0, dt, row)
                bar.update(step, loss=report.loss,
                           tokens_per_s=self.tokens / dt if dt > 0 else 0.0)


def restart_count() -> int:
    """This worker's restarts by its elastic agent (0: its first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
