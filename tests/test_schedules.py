"""Pipeline schedules as data: completeness, simulation, bubble, in-flight memory, grid, CLI.

Pure Python: no model, no processes.
"""
from __future__ import annotations

import json

import pytest

from trainmesh.cli import main
from trainmesh.core.errors import ConfigError
from trainmesh.pipeline_parallel.analysis import (
    bubble_fraction,
    bubble_fraction_per_rank,
    check_complete,
    completeness_problems,
    peak_inflight_microbatches,
    simulate,
)
from trainmesh.pipeline_parallel.render import draw_timeline, format_grid
from trainmesh.pipeline_parallel.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    TimedAction,
    Timeline,
    build_schedule,
)

JSON_KEYS = {"schedule", "pp", "microbatches", "virtual_stages", "actions", "bubble_fraction",
             "bubble_fraction_per_rank", "peak_inflight_microbatches"}


def _allowed(name: str, p: int, m: int, v: int) -> bool:
    if v > 1 and name != "interleaved":
        return False
    return not (name == "interleaved" and m % p)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_is_exactly_p_minus_1_over_m_plus_p_minus_1(name: str) -> None:
    for p in range(1, 9):
        for m in range(1, 17):
            tl = simulate(build_schedule(name, p, m))
            assert bubble_fraction(tl) == (p - 1) / (m + p - 1), (name, p, m)
            for x in bubble_fraction_per_rank(tl):
                assert x == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


def test_naive_bubble_is_p_minus_1_over_p() -> None:
    for p in range(1, 6):
        for m in (1, 3, 4):
            assert bubble_fraction(simulate(build_schedule("naive", p, m))) == \
                pytest.approx((p - 1) / p)


@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_bubble_smaller_than_1f1b(v: int) -> None:
    for p in range(2, 7):
        for m in (p, 2 * p, 3 * p):
            inter = bubble_fraction(simulate(build_schedule("interleaved", p, m, v)))
            plain = bubble_fraction(simulate(build_schedule("1f1b", p, m)))
            assert inter < plain, (p, m, v, inter, plain)


def test_interleaved_bubble_time_shrinks_by_v() -> None:
    p, m, v = 4, 8, 2
    plain = simulate(build_schedule("1f1b", p, m))
    inter = simulate(build_schedule("interleaved", p, m, v))
    idle = [inter.makespan - inter.busy(r) for r in range(p)]
    assert idle == pytest.approx([(plain.makespan - plain.busy(r)) / v for r in range(p)])


def test_zero_bubble_beats_1f1b_with_same_peak_bound() -> None:
    for p in range(2, 7):
        for m in (p, 2 * p + 1):
            zb = build_schedule("zb1p", p, m)
            assert bubble_fraction(simulate(zb)) < bubble_fraction(simulate(build_schedule("1f1b", p, m)))
            assert max(peak_inflight_microbatches(zb)) <= p
    # ZB-H1 idles (p-1) forward-times per rank where 1F1B idles 3(p-1) with F=I=W=1
    tl = simulate(build_schedule("zb1p", 4, 8))
    assert [tl.makespan - tl.busy(r) for r in range(4)] == [3.0] * 4


def test_peak_inflight() -> None:
    for p in range(1, 9):
        for m in range(1, 17):
            assert peak_inflight_microbatches(build_schedule("gpipe", p, m)) == [m] * p
            peaks = peak_inflight_microbatches(build_schedule("1f1b", p, m))
            assert all(peaks[r] <= p - r for r in range(p)), (p, m, peaks)
            assert peaks == [min(p - r, m) for r in range(p)]


def test_peak_inflight_from_timeline_matches_schedule() -> None:
    s = build_schedule("interleaved", 4, 8, 2)
    assert peak_inflight_microbatches(simulate(s)) == peak_inflight_microbatches(s)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_schedule_is_complete_and_runs(name: str, p: int) -> None:
    for m in (1, p, 2 * p + 1):
        for v in (1, 2):
            if not _allowed(name, p, m, v):
                continue
            s = build_schedule(name, p, m, v)
            assert completeness_problems(s) == []
            tl = simulate(s)  # raises on deadlock
            assert [len(r) for r in tl.ranks] == [len(a) for a in s.actions]
            assert s.num_stages == p * v
            for rank, acts in enumerate(s.actions):
                assert {a.stage for a in acts} == set(s.stages_of_rank(rank))
                assert all(s.stage_to_rank(a.stage) == rank for a in acts)


def test_incomplete_and_deadlocked_schedules_raise() -> None:
    good = build_schedule("1f1b", 2, 2)
    missing = Schedule("bad", 2, 2, 1, [good.actions[0][:-1], good.actions[1]])
    with pytest.raises(ScheduleError, match="rank 0, stage 0, microbatch 1"):
        check_complete(missing)
    # rank 0 runs B0 before F0's gradient can ever come back
    swapped = [Action("F", 0, 1), Action("B", 0, 0), Action("F", 0, 0), Action("B", 0, 1)]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(Schedule("bad", 2, 2, 1, [swapped, good.actions[1]]))
    wrong_rank = [[Action("F", 1, 0), Action("B", 1, 0)], [Action("F", 0, 0), Action("B", 0, 0)]]
    assert completeness_problems(Schedule("bad", 2, 1, 1, wrong_rank))


@pytest.mark.parametrize("name,p,m,v,field", [
    ("interleaved", 4, 6, 2, "microbatches"),
    ("1f1b", 4, 8, 2, "virtual-stages"),
    ("gpipe", 0, 8, 1, "pp"),
    ("gpipe", 2, 0, 1, "microbatches"),
    ("interleaved", 2, 2, 0, "virtual-stages"),
    ("pipedream", 2, 2, 1, "schedule"),
])
def test_invalid_combinations_raise_config_error(name, p, m, v, field) -> None:
    with pytest.raises(ConfigError) as exc:
        build_schedule(name, p, m, v)
    assert exc.value.field == "--" + field


def test_labels_and_grid() -> None:
    assert str(Action("F", 1, 3)) == "1F3"
    assert build_schedule("gpipe", 2, 2).labels()[0] == ["F0", "F1", "B0", "B1"]
    assert build_schedule("interleaved", 2, 2, 2).labels()[0][:2] == ["0F0", "0F1"]
    lines = format_grid(simulate(build_schedule("1f1b", 2, 2))).splitlines()
    assert lines == ["stage 0 | F0 F1 .  .  B0 B0 .  B1 B1",
                     "stage 1 | .  F0 B0 B0 F1 B1 B1 .  ."]
    interleaved = format_grid(simulate(build_schedule("interleaved", 2, 2, 2))).splitlines()
    assert interleaved[0].startswith("rank 0 |")     # a rank holding stages 0 and 2


def test_draw_simulated_and_measured_timelines(tmp_path) -> None:
    svg = draw_timeline(simulate(build_schedule("interleaved", 2, 4, 2)), tmp_path / "t.svg")
    assert svg.read_text().lstrip().startswith("<?xml") and "bubble" in svg.read_text()
    measured = Timeline([[TimedAction(Action("F", 0, 0), 10.00, 10.31),
                          TimedAction(Action("B", 0, 0), 10.52, 11.13)],
                         [TimedAction(Action("F", 1, 0), 10.32, 10.50),
                          TimedAction(Action("B", 1, 0), 10.51, 10.90)]], time_unit="s")
    png = draw_timeline(measured, tmp_path / "m.png", title="measured")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        draw_timeline(measured, tmp_path / "m.pdf")


def test_pictures_share_one_time_scale(tmp_path) -> None:
    """zb1p's short W passes do not stretch its picture: the same work, about the same width
    (the planted bug, a scale from the shortest action, made zb1p's several times wider)."""
    def width(timeline) -> float:
        import re
        path = draw_timeline(timeline, tmp_path / "w.svg")
        return float(re.search(r'width="([0-9.]+)pt"', path.read_text()).group(1))
    zb = simulate(build_schedule("zb1p", 4, 8))
    for row in zb.ranks:     # a measured W is much shorter than its I
        for i, t in enumerate(row):
            if t.action.kind == "W":
                row[i] = TimedAction(t.action, t.start, t.start + 0.1 * (t.end - t.start))
    one = width(simulate(build_schedule("1f1b", 4, 8)))
    assert 0.6 * one < width(zb) < 1.4 * one
    assert 0.6 * one < width(simulate(build_schedule("interleaved", 4, 8, 2))) < 1.4 * one


def test_cli_json(capsys) -> None:
    rc = main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved",
               "--virtual-stages", "2", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == JSON_KEYS
    assert data["schedule"] == "interleaved" and data["virtual_stages"] == 2
    assert set(data["actions"]) == {"0", "1", "2", "3"}
    assert len(data["actions"]["0"]) == 2 * 8 * 2 and data["actions"]["0"][0] == "0F0"
    assert set(data["bubble_fraction_per_rank"]) == set(data["peak_inflight_microbatches"])
    assert 0 < data["bubble_fraction"] < 3 / 11


def test_cli_text_and_svg(capsys, tmp_path) -> None:
    out = tmp_path / "gpipe.svg"
    assert main(["schedule", "--pp", "3", "--microbatches", "4", "--schedule", "gpipe",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "stage 2 |" in text and "bubble fraction 0.3333" in text
    assert out.exists() and out.stat().st_size > 1000


@pytest.mark.parametrize("argv,field", [
    (["--pp", "4", "--microbatches", "6", "--schedule", "interleaved"], "microbatches"),
    (["--out", "timeline.pdf"], "--out"),
    (["--pp", "0"], "pp"),
    (["--virtual-stages", "2"], "virtual-stages"),
    (["--schedule", "bogus"], "--schedule"),
])
def test_cli_bad_input_exits_2_naming_field(capsys, argv, field) -> None:
    try:
        rc = main(["schedule", *argv])
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert field in err and len(err.splitlines()) == 1, err
