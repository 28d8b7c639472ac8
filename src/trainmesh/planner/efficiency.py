"""The compute efficiency the time model assumes without a measured run: from published runs.

The time model (:mod:`.steptime`) prices compute at ``efficiency x peak`` and adds what it models
on top: pipeline bubbles, tensor/context/expert-parallel collectives on the critical path, data
parallel traffic not hidden behind backward, offload. A published run's *implied* efficiency
(``Reference.efficiency``, :mod:`.references`; computed by
:func:`~.calibrate.implied_efficiency` and checked against it by a test) is the one that makes
the planner's step time for the run's own layout equal the published one.

:func:`assumed_efficiency` takes the median over the published bf16/fp16 runs on the same
accelerator, or its family (A100s; Hopper: H100, H200 and torchtitan's 500 W cards), preferring
those within 10x of the model's active parameters (what sets the matmuls' sizes); an accelerator
with no published run takes the median of every run. The plan states the value and the runs it
came from. ``trainmesh plan --calibrate`` takes the efficiency from a measured run instead
(:mod:`.calibrate`).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from .published import published
from .references import H100_500W, REFERENCES, Reference

FAMILIES = {"a100-80gb": "a100", "a100-40gb": "a100", "h100": "hopper", "h200": "hopper",
            H100_500W: "hopper"}
"""Accelerators whose published runs stand in for each other when one has none near in size."""
SIZE_WINDOW = 10.0
"""Runs within this factor of the model's parameter count are near it in size."""


@dataclass(frozen=True)
class Assumed:
    """The efficiency a plan assumes and where it comes from."""

    efficiency: float
    runs: tuple[str, ...]
    """The published runs whose median it is (empty: calibrated or given)."""
    source: str
    """One line for the plan's output."""


def assumed_efficiency(gpu: str, params: float, *, exclude: str | None = None) -> Assumed:
    """Median implied efficiency of the published runs on ``gpu`` (module doc): the first of
    (this accelerator, near in size), (its family, near), (this accelerator), (its family), every
    run, that has runs; "near" counts only with two runs or more, so no run sets its own value
    alone. ``exclude``: leave that run out (a run checked against the others)."""
    pool = [(i, r) for i, r in enumerate(REFERENCES) if r.efficiency and r.name != exclude]
    family = FAMILIES.get(gpu)
    card = [(i, r) for i, r in pool if r.accelerator == gpu]
    kin = [(i, r) for i, r in pool if family is not None and FAMILIES.get(r.accelerator) == family]

    def near(runs: list[tuple[int, Reference]]) -> list[tuple[int, Reference]]:
        close = [(i, r) for i, r in runs if _size(r) / SIZE_WINDOW <= params <= _size(r) * SIZE_WINDOW]
        return close if len(close) >= 2 else []

    for chosen, where in ((near(card), f"{gpu}, near in size"), (near(kin), f"{family} accelerators, near in size"),
                          (card, gpu), (kin, f"{family} accelerators"), (pool, "every accelerator")):
        if chosen:
            break
    values = [r.efficiency for _, r in chosen]
    eff = statistics.median(values)
    return Assumed(eff, tuple(r.name for _, r in chosen),
                   f"efficiency {eff:.0%} of peak: the median of {len(values)} published runs "
                   f"({where}: {'; '.join(r.name for _, r in chosen)}); --calibrate RUN.jsonl "
                   "to take it from a measured run")


def _size(ref: Reference) -> float:
    return published(ref.model).shape.active_params
