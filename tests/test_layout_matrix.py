"""The whole mesh composes: a pairwise matrix generated from the axis table, each layout run by
`trainmesh train` against one process with the same model flags (loss within LOSS_ABS, grad
norm within NORM_REL, 20 steps; tests/helpers.py ``assert_equivalent``).

The rows: :data:`PINNED` (the layouts refusals used to hide: MoE under cp, under sequence
parallelism and with ep over dp x cp; HSDP with tp, pp, cp and ep; offload with sequence
parallelism), then rows picked greedily (most new pairs per process) from every valid layout
of the table's :data:`~trainmesh.core.axes.FEATURES` (at most :data:`MAX_WORLD` processes)
until every pair of features of two axes is in some row — a covering array. The 16-process
layout of ``test_the_whole_mesh_in_one_run`` (ZeRO-3 x tp + SP x pp x cp x ep) counts too.
``test_every_pair_is_run_or_refused`` holds the table to it: a feature added to FEATURES fails
it until each of its pairs is in a row or refused by a rule, and each of the table's RULES is a
refusal case here (exit 2 before any worker, one line naming its flag).

Planted bugs this module catches (each seen failing with an assertion): the MoE slot counts not
summed over cp (moe-cp2: grad norm 4% off) nor over tp under sequence parallelism (moe-tp2-sp:
6% off); the replicated shard's all-reduce skipped under HSDP (dp4-shard2-zero3-tp2: grad norm
57% off); offload's host copies of the shards not taken again after sequence parallelism's tp
sum (dp2-zero1-offload-tp2-sp: 7% off).
"""
from __future__ import annotations

import itertools
import types
from dataclasses import fields

import pytest
from helpers import SMALL, assert_equivalent, one_process, run_train, summary

from trainmesh.config.parallel import ParallelConfig
from trainmesh.config.train import FLAGS, build_train_config
from trainmesh.core import axes
from trainmesh.core.errors import ConfigError

MAX_WORLD = 8
MOE = ["--experts", "4", "--moe-aux-loss", "0.1"]
"""The MoE rows' model: every block's MLP a mixture of 4 experts (top 2), a load-balancing
coefficient large enough that its gradient shows in the norm."""
STEPS = 20
FLAG_OF = {f.field: name for name, f in FLAGS.items()}
SHAPE = {"layers": 2, "d_model": 32, "heads": 4, "seq_len": 16, "vocab_size": 64,
         "global_batch": 8, "steps": STEPS, "warmup_steps": 5}

PINNED: dict[str, dict] = {
    "moe-cp2": {"experts": 4, "cp": 2},
    "moe-tp2-sp": {"experts": 4, "tp": 2, "sequence_parallel": True},
    "moe-dp2-cp2-ep2": {"experts": 4, "dp": 2, "cp": 2, "ep": 2},
    "moe-dp4-shard2-zero3-ep2": {"experts": 4, "dp": 4, "dp_shard": 2, "zero": 3, "ep": 2},
    "dp4-shard2-zero3-tp2": {"dp": 4, "dp_shard": 2, "zero": 3, "tp": 2},
    "dp4-shard2-zero2-pp2": {"dp": 4, "dp_shard": 2, "zero": 2, "pp": 2, "microbatches": 2},
    "dp4-shard2-zero3-cp2": {"dp": 4, "dp_shard": 2, "zero": 3, "cp": 2},
    "dp2-zero1-offload-tp2-sp": {"dp": 2, "zero": 1, "offload": "cpu", "tp": 2,
                                 "sequence_parallel": True},
}
WHOLE_MESH = {"experts": 4, "dp": 2, "zero": 3, "tp": 2, "sequence_parallel": True, "pp": 2,
              "microbatches": 2, "cp": 2, "ep": 2}
"""ZeRO-3 x tp + SP x pp x cp x ep: 16 processes."""


LAUNCH_WEIGHT = 6
"""The greedy cover's cost of a launch beside its processes' (each process steps 20 times, a
launch adds its launcher and start-up): cheap rows, but not many rows of one pair each."""

DEFAULTS = {**{f.name: f.default for f in fields(ParallelConfig)}, "experts": 0}


def _facts(settings: dict) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{**DEFAULTS, **settings})


def features_of(settings: dict) -> frozenset[str]:
    facts = _facts(settings)
    return frozenset(f.name for f in axes.FEATURES if f.on(facts))


def world_of(settings: dict) -> int:
    f = _facts(settings)
    return f.dp * f.tp * f.pp * f.cp


def valid(settings: dict) -> bool:
    """Whether `trainmesh train` accepts the layout on the matrix's model."""
    try:
        build_train_config({**SHAPE, **settings})
    except ConfigError:
        return False
    return True



def pairs_of(names: frozenset[str]) -> set[tuple[str, str]]:
    axis = {f.name: f.axis for f in axes.FEATURES}
    return {(a, b) for a, b in itertools.combinations(sorted(names), 2) if axis[a] != axis[b]}


def every_pair() -> set[tuple[str, str]]:
    return pairs_of(frozenset(f.name for f in axes.FEATURES))


def refused_pairs() -> set[tuple[str, str]]:
    return {tuple(sorted(r.pair)) for r in axes.RULES if r.pair is not None}


def candidates() -> list[dict]:
    """Every layout of one choice per axis (its default or one of its features) on at most
    MAX_WORLD processes, ZeRO only where dp x cp has ranks to shard over, in a fixed order (not
    yet checked against the rules)."""
    by_axis: dict[str, list[dict]] = {}
    for f in axes.FEATURES:
        by_axis.setdefault(f.axis, [{}]).append(f.settings)
    out = []
    for choice in itertools.product(*by_axis.values()):
        settings: dict = {}
        for part in choice:
            settings.update({k: max(v, settings.get(k, v)) if k == "dp" else v
                             for k, v in part.items()})
        facts = _facts(settings)
        if facts.zero and facts.dp * facts.cp == 1:
            continue                     # ZeRO with no group to shard over: pairs in name only
        if world_of(settings) <= MAX_WORLD:
            out.append(settings)
    return out


def generated_rows() -> dict[str, dict]:
    """:data:`PINNED`, then greedy rows until every pair no rule refuses is covered: each the
    valid layout with the most uncovered pairs per process (a launch weighing as
    :data:`LAUNCH_WEIGHT` processes), then the fewest processes."""
    rows = dict(PINNED)
    covered = set().union(*(pairs_of(features_of(s)) for s in [*rows.values(), WHOLE_MESH]))
    todo = every_pair() - refused_pairs() - covered
    pool = [(s, pairs_of(features_of(s))) for s in candidates()]
    invalid: set[int] = set()
    while todo:
        ranked = sorted(range(len(pool)), key=lambda i: (
            -len(pool[i][1] & todo) / (world_of(pool[i][0]) + LAUNCH_WEIGHT), world_of(pool[i][0]), i))
        best = next((i for i in ranked if pool[i][1] & todo and i not in invalid
                     and (valid(pool[i][0]) or invalid.add(i))), None)
        if best is None:
            break                        # what is left cannot be run here: the coverage test says
        settings, pairs = pool[best]
        rows["gen-" + "-".join(sorted(features_of(settings)))] = settings
        todo -= pairs
    return rows


ROWS = generated_rows()


def flags_of(settings: dict) -> list[str]:
    out = []
    for key, value in settings.items():
        flag = FLAG_OF[key]
        out += [flag] if value is True else [flag, str(value)]
    return out


# ---------------------------------------------------------------- the table's own checks
def test_every_pair_is_run_or_refused():
    covered = set().union(*(pairs_of(features_of(s)) for s in [*ROWS.values(), WHOLE_MESH]))
    missing = every_pair() - covered - refused_pairs()
    assert not missing, f"pairs of features neither run by the matrix nor refused: {sorted(missing)}"
    for name, settings in ROWS.items():
        assert valid(settings), name
        assert world_of(settings) <= MAX_WORLD, name
    assert len(ROWS) <= 14, sorted(ROWS)        # few launches: the suite's time


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rule", axes.RULES, ids=[f"{r.flag}-{i}" for i, r in enumerate(axes.RULES)])
def test_each_rule_exits_2_before_any_worker(rule, no_launch, refused):
    line = refused(["train", *SMALL, *flags_of(rule.example)], rule.flag)
    assert no_launch == []
    assert rule.why.format(c=_facts(rule.example), experts=rule.example.get("experts"))[:30] in line


def test_the_planner_reads_the_group_sizes():
    """The table's per-kind group sizes (what a planner divides states and traffic by)."""
    hsdp = axes.group_sizes(ParallelConfig(dp=4, dp_shard=2, zero=3, cp=2, ep=2))
    assert hsdp == {"dense": (4, 2), "expert": (4, 1)}
    assert axes.group_sizes(ParallelConfig(dp=2, cp=2)) == {"dense": (4, 1), "expert": (4, 1)}
    assert axes.sequence_groups(ParallelConfig(tp=2, cp=2, sequence_parallel=True), True) == ("cp", "tp")
    assert axes.refusal(ParallelConfig(dp=2, ep=2), experts=0).flag == "--ep"
    assert axes.refusal(ParallelConfig(dp=2, ep=2), experts=4) is None


def test_mesh_groups_follow_the_views():
    """The views number the ranks alike: every group is a line of its view, HSDP's shard group
    under cp spans cp and dp_shard, and experts' groups cut the dp x cp line."""
    d = axes.Layout(dp=4, tp=2, cp=2, ep=2, dp_shard=2)
    assert d.members("dp_shard_cp")[0] == [0, 2, 4, 6]
    assert d.members("dp_replicate")[0] == [0, 8]
    assert d.members("ep")[0] == [0, 2] and d.members("edp")[0] == [0, 4, 8, 12]
    for name in axes.GROUPS:
        groups = d.members(name)
        assert sorted(r for g in groups for r in g) == list(range(d.world)), name


# ---------------------------------------------------------------- the runs
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(ROWS))
def test_layout_matches_one_process(name, reference_run, tmp_path):
    settings = ROWS[name]
    moe = settings.get("experts", 0) > 0
    ref = reference_run([*one_process("adamw"), *(MOE if moe else [])])
    row = {k: v for k, v in settings.items() if k != "experts"}
    proc, run = run_train([*SMALL, "--optimizer", "adamw", *(MOE if moe else []), *flags_of(row)],
                          tmp_path, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_equivalent(ref, run)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_whole_mesh_in_one_run(reference_run, tmp_path):
    """MoE at dp 2 x ZeRO-3 x tp 2 + SP x pp 2 x cp 2 x ep 2: 16 processes, as one process."""
    ref = reference_run([*one_process("adamw"), *MOE])
    row = {k: v for k, v in WHOLE_MESH.items() if k != "experts"}
    proc, run = run_train([*SMALL, "--optimizer", "adamw", *MOE, *flags_of(row)], tmp_path,
                          timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_equivalent(ref, run)
    assert len(summary(run)["ranks"]) == 16
