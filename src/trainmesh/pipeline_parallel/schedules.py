"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it runs.

A schedule says *what* each rank computes and in which order; it says nothing about sends and
receives. Those follow from the actions: the runner that executes a schedule sends a forward's
output to the rank of the next stage and a backward's input gradient to the rank of the previous
stage (see :meth:`Schedule.stage_to_rank`). The same action lists drive the runtime, the bubble
analysis (:mod:`.analysis`) and the pictures (:mod:`.render`).

Stages are *virtual* stages ``0 .. pp*v-1``: the model is cut into ``pp*v`` consecutive chunks
and rank ``r`` holds chunks ``r, r+pp, r+2pp, ...`` (round-robin, as Megatron's interleaved
schedule). With ``v = 1`` a rank holds exactly one stage, its own index.

Built-in schedules (:func:`build_schedule`):

* ``naive``       one microbatch at a time through the whole pipeline; no overlap at all.
* ``gpipe``       all forwards, then all backwards (Huang et al. 2019).
* ``1f1b``        PipeDream-flush: warm-up forwards, then one forward / one backward, cool-down.
* ``interleaved`` Megatron's interleaved 1F1B over ``v`` chunks per rank (Narayanan et al. 2021).
* ``zb1p``        ZB-H1 zero-bubble (Qi et al. 2023): backward split into input-grad ``I`` and
                  weight-grad ``W``; ``W`` is deferred to fill the cool-down bubble.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from trainmesh.config.parallel import SCHEDULES, check_pipeline  # noqa: F401 - SCHEDULES re-exported
from trainmesh.core.errors import ConfigError

FORWARD = "F"
"""Forward of one chunk on one microbatch."""
BACKWARD = "B"
"""Full backward of one chunk on one microbatch (input and weight gradients together)."""
BACKWARD_INPUT = "I"
"""Input-gradient half of a split backward (zero-bubble): unblocks the previous stage."""
BACKWARD_WEIGHT = "W"
"""Weight-gradient half of a split backward (zero-bubble): needs this stage's ``I`` first."""
KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)

# SCHEDULES (imported above) is declared with the layout rules in trainmesh.config.parallel.
ALIASES = {"zero-bubble": "zb1p", "zbh1": "zb1p", "zb-h1": "zb1p"}


class ScheduleError(ValueError):
    """A schedule that cannot be run: incomplete, duplicated, misplaced or deadlocked actions."""


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work: ``kind`` of virtual stage ``stage`` on microbatch ``microbatch``.

    ``str(action)`` is the stage-prefixed form ``"1F3"`` (stage 1, forward, microbatch 3);
    :meth:`label` drops the stage prefix where a rank holds a single stage (``"F3"``).
    """

    kind: str
    """One of ``F`` (forward), ``B`` (backward), ``I`` (input grad), ``W`` (weight grad)."""
    stage: int
    """Virtual stage index, ``0 .. pp*virtual_stages - 1``."""
    microbatch: int
    """Microbatch index, ``0 .. microbatches - 1``."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action.kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"Action stage and microbatch must be >= 0; got {self!r}")

    def label(self, *, with_stage: bool = True) -> str:
        """``"1F3"`` with the stage prefix, ``"F3"`` without."""
        core = f"{self.kind}{self.microbatch}"
        return f"{self.stage}{core}" if with_stage else core

    def __str__(self) -> str:
        return self.label(with_stage=True)

    @property
    def is_forward(self) -> bool:
        """True for ``F``."""
        return self.kind == FORWARD

    @property
    def frees_activations(self) -> bool:
        """True for the action that ends this (stage, microbatch)'s backward: ``B`` or ``W``."""
        return self.kind in (BACKWARD, BACKWARD_WEIGHT)


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of one pipeline step; ``actions[rank]`` is in execution order."""

    name: str
    """Schedule name, e.g. ``"1f1b"``."""
    pp: int
    """Pipeline ranks."""
    microbatches: int
    """Microbatches per step."""
    virtual_stages: int
    """Model chunks per rank (``v``); the model has ``pp * v`` stages."""
    actions: list[list[Action]] = field(repr=False)
    """One list per rank, in the order the rank runs them."""

    def __post_init__(self) -> None:
        if len(self.actions) != self.pp:
            raise ScheduleError(f"{self.name}: {len(self.actions)} action lists for pp={self.pp}")

    @property
    def num_stages(self) -> int:
        """Virtual stages in the whole pipeline: ``pp * virtual_stages``."""
        return self.pp * self.virtual_stages

    @property
    def splits_backward(self) -> bool:
        """True when backwards are split into ``I`` and ``W`` actions (zero-bubble)."""
        return any(a.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT) for acts in self.actions for a in acts)

    def stage_to_rank(self, stage: int) -> int:
        """The rank holding virtual stage ``stage`` (round-robin: ``stage % pp``)."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage must be in 0..{self.num_stages - 1}; got {stage}")
        return stage % self.pp

    def stages_of_rank(self, rank: int) -> list[int]:
        """Virtual stages held by ``rank``, chunk 0 first: ``[rank, rank+pp, ...]``."""
        return [rank + chunk * self.pp for chunk in range(self.virtual_stages)]

    def chunk_of(self, stage: int) -> int:
        """Index of ``stage`` among its rank's chunks (``stage // pp``)."""
        return stage // self.pp

    def is_first_stage(self, stage: int) -> bool:
        """True for stage 0, which reads the inputs (no activation to receive)."""
        return stage == 0

    def is_last_stage(self, stage: int) -> bool:
        """True for the last stage, which computes the loss (no gradient to receive)."""
        return stage == self.num_stages - 1

    def label(self, action: Action) -> str:
        """``"F3"`` when ``virtual_stages == 1``, else the stage-prefixed ``"1F3"``."""
        return action.label(with_stage=self.virtual_stages > 1)

    def labels(self) -> list[list[str]]:
        """Every rank's actions as printable labels."""
        return [[self.label(a) for a in acts] for acts in self.actions]


class TimedAction(NamedTuple):
    """One action as it ran (or would run): start and end in the timeline's time unit."""

    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """When each rank ran each of its actions: simulated (cost units) or measured (seconds).

    Produced by :func:`.analysis.simulate` and by the pipeline runtime (``--timeline-out``);
    consumed by the bubble analysis and :func:`.render.draw_timeline`.
    """

    ranks: list[list[TimedAction]]
    """Per rank, its actions in execution order with start and end times."""
    virtual_stages: int = 1
    """Chunks per rank; above 1 labels carry the stage prefix."""
    time_unit: str = "units"
    """``"units"`` for simulated costs, ``"s"`` for measured seconds."""
    name: str = ""
    """Schedule name, for titles."""

    @property
    def pp(self) -> int:
        """Number of ranks."""
        return len(self.ranks)

    @property
    def start(self) -> float:
        """Earliest action start over all ranks (0.0 when empty)."""
        starts = [t.start for row in self.ranks for t in row]
        return min(starts) if starts else 0.0

    @property
    def end(self) -> float:
        """Latest action end over all ranks (0.0 when empty)."""
        ends = [t.end for row in self.ranks for t in row]
        return max(ends) if ends else 0.0

    @property
    def makespan(self) -> float:
        """Step time: first action start to last action end, over all ranks."""
        return self.end - self.start

    def busy(self, rank: int) -> float:
        """Total time ``rank`` spent computing."""
        return sum(t.end - t.start for t in self.ranks[rank])

    def label(self, action: Action) -> str:
        """Printable label, stage-prefixed when ``virtual_stages > 1``."""
        return action.label(with_stage=self.virtual_stages > 1)


# --------------------------------------------------------------------------- builders


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build the named schedule for ``pp`` ranks, ``microbatches`` microbatches, ``v`` chunks.

    Raises :class:`~trainmesh.core.errors.ConfigError` naming the field for invalid combinations.
    """
    name = ALIASES.get(name, name)
    _check_args(name, pp, microbatches, virtual_stages)
    builder = {
        "naive": _naive_rank,
        "gpipe": _gpipe_rank,
        "1f1b": _one_f_one_b_rank,
        "interleaved": _interleaved_rank,
        "zb1p": _zb1p_rank,
    }[name]
    actions = [builder(rank, pp, microbatches, virtual_stages) for rank in range(pp)]
    return Schedule(name, pp, microbatches, virtual_stages, actions)


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards alone, in each rank's order: an evaluation pass. It cannot
    deadlock where the schedule does not: its dependencies are a subset of the schedule's."""
    actions = [[a for a in acts if a.kind == FORWARD] for acts in schedule.actions]
    return Schedule(f"{schedule.name}-forward", schedule.pp, schedule.microbatches,
                    schedule.virtual_stages, actions)


def _check_args(name: str, pp: int, microbatches: int, virtual_stages: int) -> None:
    for fld, value in (("--pp", pp), ("--microbatches", microbatches),
                       ("--virtual-stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(fld, f"must be a positive integer; got {value!r}")
    check_pipeline(name, pp=pp, microbatches=microbatches, virtual_stages=virtual_stages)


def _naive_rank(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """Microbatch after microbatch: F then B of each, waiting for the whole pipeline each time."""
    acts: list[Action] = []
    for mb in range(m):
        acts += [Action(FORWARD, rank, mb), Action(BACKWARD, rank, mb)]
    return acts


def _gpipe_rank(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """All forwards in microbatch order, then all backwards in microbatch order."""
    return ([Action(FORWARD, rank, mb) for mb in range(m)]
            + [Action(BACKWARD, rank, mb) for mb in range(m)])


def _one_f_one_b_rank(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """PipeDream-flush: ``pp-rank-1`` warm-up forwards, then alternate F and B, then the rest."""
    warmup = min(pp - rank - 1, m)
    return _warmup_steady_cooldown(
        [Action(FORWARD, rank, mb) for mb in range(m)],
        [Action(BACKWARD, rank, mb) for mb in range(m)], warmup)


def _interleaved_rank(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B.

    Microbatches go through a rank's chunks in rounds of ``pp``: forwards take microbatches
    ``0..pp-1`` through chunk 0, then through chunk 1, ..., then the next ``pp`` microbatches;
    backwards visit the chunks in reverse. Warm-up is ``(v-1)*pp + 2*(pp-rank-1)`` forwards
    (Megatron's count); with ``v == 1`` this is plain 1F1B.
    """
    if v == 1:
        return _one_f_one_b_rank(rank, pp, m, v)
    total = m * v
    fwd, bwd = [], []
    for k in range(total):
        mb = (k // (pp * v)) * pp + k % pp
        chunk = (k // pp) % v
        fwd.append(Action(FORWARD, chunk * pp + rank, mb))
        bwd.append(Action(BACKWARD, (v - 1 - chunk) * pp + rank, mb))
    warmup = min((v - 1) * pp + 2 * (pp - rank - 1), total)
    return _warmup_steady_cooldown(fwd, bwd, warmup)


def _zb1p_rank(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """ZB-H1: 1F1B with each B split into I then W; rank ``r`` defers its first ``r`` Ws.

    Deferred Ws run once the rank has done ``r`` more input-grads, and the last ones fill the
    cool-down, where 1F1B would idle. In-flight activations stay at most ``pp`` per rank.
    """
    warmup = min(pp - rank - 1, m)
    fwd = [Action(FORWARD, rank, mb) for mb in range(m)]
    acts = fwd[:warmup]
    weights_done = 0
    for k in range(m):  # k-th input-grad, preceded by a forward while forwards remain
        if warmup + k < m:
            acts.append(fwd[warmup + k])
        acts.append(Action(BACKWARD_INPUT, rank, k))
        if k >= rank:
            acts.append(Action(BACKWARD_WEIGHT, rank, weights_done))
            weights_done += 1
    acts += [Action(BACKWARD_WEIGHT, rank, mb) for mb in range(weights_done, m)]
    return acts


def _warmup_steady_cooldown(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then forward/backward pairs, then the remaining backwards."""
    acts = list(fwd[:warmup])
    steady = len(fwd) - warmup
    for k in range(steady):
        acts += [fwd[warmup + k], bwd[k]]
    return acts + bwd[steady:]
