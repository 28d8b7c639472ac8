"""`trainmesh report`: one self-contained HTML page per run, for every layout and mode of
tests/observed.py (dense dp/zero/pp, tp x cp, HSDP, MoE with ep, ps, DiLoCo, fault-tolerant with
a replica lost), each page's charts exactly those its records allow, their numbers those of the
metrics file; the pages checked in headless Chromium; the console and TensorBoard of the MoE run.
"""
from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from observed import OBSERVED

from trainmesh.cli import main
from trainmesh.observe.layout import layout_text

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def pages(observed_run, tmp_path_factory) -> dict[str, tuple[str, list[dict], Path]]:
    """name -> (the page's text, the run's records, the run's directory)."""
    tmp = tmp_path_factory.mktemp("pages")
    out = {}
    for name in OBSERVED:
        run = observed_run(name)
        page = tmp / f"{name}.html"
        assert main(["report", str(run / "run.jsonl"), "-o", str(page)]) == 0, name
        out[name] = (page.read_text(), _records(run / "run.jsonl"), run)
    return out


def figures(text: str) -> dict[str, dict]:
    """Figure name -> the numbers it plots (its ``data-series``)."""
    return {m.group(1): json.loads(html.unescape(m.group(2)))
            for m in re.finditer(r'<figure id="chart-([\w-]+)" data-series="([^"]*)">', text)}


def expected_headings(records: list[dict]) -> list[str]:
    """The sections a run's records call for, in page order (module docstring of the report)."""
    steps = [r for r in records if r["event"] == "step"]
    summary = next((r for r in records if r["event"] == "summary"), {})
    ranks = summary.get("ranks", [])

    def has(key: str) -> bool:
        return any(r.get(key) is not None for r in steps)

    faults = [r for r in records if r["event"] in ("quorum", "discarded")]
    wanted = [("Run", True), ("Ranks", bool(ranks)), ("Loss", has("loss")),
              ("Gradient norm", has("grad_norm")), ("Throughput", has("tokens_per_s")),
              ("Expert load balance", has("moe")), ("Tokens per expert", "moe" in summary),
              ("Replicas", has("replicas") or bool(faults)),
              ("Quorum events", has("replicas") or bool(faults)),
              ("Saves", any(r["event"] == "save" for r in records)),
              ("Memory per rank", any("peak_mem_bytes" in r for r in ranks)),
              ("Traffic per axis", any(sum(sum(o.values()) for o in r.get("comm_bytes_per_step", {})
                                           .values()) for r in ranks))]
    return [h for h, on in wanted if on]


def headings(text: str) -> list[str]:
    return [html.unescape(h) for h in re.findall(r"<h2>([^<]+)</h2>", text)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_page_is_self_contained_and_draws_what_its_run_has(pages):
    for name, (text, records, _) in pages.items():
        assert "<script" not in text and "<link" not in text, name
        assert not re.search(r'(src|href)="(https?:|//|file:)', text), name   # nothing from outside
        assert headings(text) == expected_headings(records), name
        assert text.count("<svg") == len(figures(text)) == len(headings(text)) - 2 - (
            "Quorum events" in headings(text)), name                   # one picture per chart
        summary = next(r for r in records if r["event"] == "summary")
        assert f"<td>{html.escape(layout_text(summary['layout']))} on {summary['world_size']} " \
               "processes</td>" in text, name
        steps = [r for r in records if r["event"] == "step"]
        loss = figures(text)["loss"]["loss-curve"]
        assert loss == {"x": [r["step"] for r in steps], "y": [r["loss"] for r in steps]}, name
        assert len(re.findall(r'id="memory-bar-rank\d+"', text)) == sum(
            "peak_mem_bytes" in r for r in summary["ranks"]), name


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_layout_row_and_rank_table_name_every_axis(pages):
    """Each run's layout in full: every mesh axis with its degree, HSDP's split, experts and ep,
    the strategy and fault tolerance; the rank table a column per coordinate."""
    named = {"dp2pp2": ["dp 2 x cp 1 x pp 2 x tp 1", "zero 1", "2 microbatches", "schedule 1f1b"],
             "tp2cp2": ["dp 1 x cp 2 x pp 1 x tp 2", "cp-comm ring"],
             "hsdp": ["dp 4 (shard 2 x replicate 2) x cp 1", "zero 2"],
             "moe": ["4 experts (top 2) on ep 2"], "ps": ["ps: 2 trainers + 1 server, sync"],
             "diloco": ["diloco: dp 2 x cp 1", "2 inner steps"], "ft": ["fault-tolerant (2 replicas)"]}
    columns = {"hsdp": ["dp", "dp-shard", "dp-replicate", "cp", "pp", "tp"],
               "moe": ["dp", "cp", "pp", "tp", "ep"], "ps": ["role", "dp", "cp", "pp", "tp"],
               "ft": ["replica", "restarts"]}
    for name, (text, _, _) in pages.items():
        row = re.search(r"<td>layout</td><td>([^<]+)</td>", text).group(1)
        assert all(p in row for p in named.get(name, [])) and "fp32" in row, (name, row)
        header = re.search(r"<h2>Ranks</h2>\s*<table><thead><tr>(.*?)</tr>", text).group(1)
        cols = re.findall(r"<th>([^<]+)</th>", header)
        want = columns.get(name, ["dp", "cp", "pp", "tp"])
        assert cols[1:1 + len(want)] == want, (name, cols)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_moe_page_draws_the_load_and_the_experts_from_the_metrics(pages):
    text, records, _ = pages["moe"]
    steps = [r for r in records if r["event"] == "step"]
    summary = next(r for r in records if r["event"] == "summary")
    data = figures(text)
    assert data["moe"]["moe-aux-curve"] == {"x": [r["step"] for r in steps],
                                            "y": [r["moe"]["aux_loss"] for r in steps]}
    assert data["moe"]["moe-load-curve"]["y"] == [r["moe"]["max_over_mean_load"] for r in steps]
    assert data["experts"]["expert-heatmap"] == summary["moe"]["expert_tokens"]
    assert 'id="expert-heatmap"' in text and 'id="moe-aux-curve"' in text
    saves = [r for r in records if r["event"] == "save"]
    assert [r["step"] for r in saves] == [2, 4]
    for r in saves:   # the bars are the save records' seconds
        assert data["saves"][f"save-bar-{r['step']}"] == r["blocking_s"]
        assert data["saves"][f"save-bar-total-{r['step']}"] == r["total_s"]
    evals = [r for r in records if r["event"] == "eval"]
    assert data["loss"].get("eval-curve") == {"x": [2, 4], "y": [r["loss"] for r in evals]}
    assert "traffic-bar-ep" in data["traffic"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fault_tolerant_page_marks_the_replica_lost(pages):
    """Replica 1 killed in step 3's all-reduce: the attempt discarded (2 replicas), step 3 redone
    by 1 replica (lost [1]), replica 1 back later (joined [1]); each mark where it happened
    with the stall the metrics file records."""
    text, records, _ = pages["ft"]
    steps = [r for r in records if r["event"] == "step"]
    data = figures(text)["replicas"]
    assert data["replicas-curve"] == {"x": [r["step"] for r in steps],
                                      "y": [r["replicas"] for r in steps]}
    assert min(r["replicas"] for r in steps) == 1 and steps[0]["replicas"] == 2
    marks, want = [v for k, v in data.items() if k != "replicas-curve"], []
    for r in records:
        if r["event"] == "discarded":
            want.append({"kind": "discarded", "step": r["step"], "replicas": r["replicas"],
                         "stall_s": r["attempt_s"], "who": []})
        elif r["event"] == "quorum":
            want += [{"kind": kind, "step": r["step"], "replicas": r["replicas"],
                      "stall_s": r.get("recovering_s") if kind == "lost" else None, "who": r[kind]}
                     for kind in ("lost", "joined") if r[kind]]
    assert marks == want and [m["kind"] for m in marks][:2] == ["discarded", "lost"], marks
    assert marks[1]["step"] == 3 and marks[1]["who"] == [1] and marks[1]["stall_s"] > 0
    assert 'id="lost-1"' in text and "<h2>Quorum events</h2>" in text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_traffic_is_drawn_per_mesh_axis(pages):
    """Every axis a rank records bytes on has its bar, with the bytes of all ranks."""
    for name, (text, records, _) in pages.items():
        summary = next(r for r in records if r["event"] == "summary")
        per_axis: dict[str, float] = {}
        for r in summary["ranks"]:
            for axis, ops in r.get("comm_bytes_per_step", {}).items():
                per_axis[axis] = per_axis.get(axis, 0) + sum(ops.values())
        bars = figures(text).get("traffic", {})
        assert {k.removeprefix("traffic-bar-"): v for k, v in bars.items()} == pytest.approx(
            {a: b / 2**20 for a, b in per_axis.items() if b > 0}), name
    assert {"traffic-bar-cp", "traffic-bar-tp"} <= set(figures(pages["tp2cp2"][0])["traffic"])
    assert {"traffic-bar-dp_shard", "traffic-bar-dp_replicate"} <= set(figures(pages["hsdp"][0])["traffic"])


def book(pages: dict[str, tuple[str, list[dict], Path]]) -> str:
    """Every page in one document (one browser start instead of one per page): each page's
    head and body, as written, inside ``<article id="page-NAME">``."""
    parts = []
    for name, (text, _, _) in pages.items():
        head = re.search(r"<head>(.*)</head>", text, re.DOTALL).group(1)
        body = re.search(r"<body>(.*)</body>", text, re.DOTALL).group(1)
        parts.append(f'<article id="page-{name}">{head}{body}</article>')
    return "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>pages</title>" \
           "</head><body>" + "".join(parts) + "</body></html>\n"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_pages_render_in_chromium(pages, tmp_path):
    """Every page in headless Chromium: no console message; each page's headings and pictures
    as the browser parsed them; a screenshot."""
    path, shot = tmp_path / "pages.html", tmp_path / "pages.png"
    path.write_text(book(pages))
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--enable-logging=stderr", "--v=0", "--hide-scrollbars",
                           "--window-size=1000,2400", f"--screenshot={shot}", "--dump-dom",
                           path.as_uri()], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not [line for line in proc.stderr.splitlines() if "CONSOLE" in line], proc.stderr
    dom = dict(re.findall(r'<article id="page-([\w-]+)">(.*?)</article>', proc.stdout, re.DOTALL))
    assert set(dom) == set(pages)
    for name, (text, records, _) in pages.items():
        assert headings(dom[name]) == expected_headings(records), name
        assert dom[name].count("<svg") == text.count("<svg") > 0, name
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_console_names_ep_cp_and_the_experts_of_an_moe_run(observed_run):
    out = (observed_run("moe") / "stdout.txt").read_text().splitlines()
    assert out[0].startswith("trainmesh: ") and \
        "dp 2 x cp 1 x pp 1 x tp 1, 4 experts (top 2) on ep 2, fp32" in out[0], out[0]
    header = next(line for line in out if "rank" in line and "peak memory" in line)
    assert re.search(r"rank\W+dp\W+cp\W+pp\W+tp\W+ep\W", header), header
    rows = [re.findall(r"\d+", line)[:6] for line in out if re.match(r"\W+[01] \W", line)]
    assert rows == [["0", "0", "0", "0", "0", "0"], ["1", "1", "0", "0", "0", "1"]], out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not OBSERVED["moe"].tensorboard, reason="the tensorboard package (extra [tensorboard])")
def test_tensorboard_has_the_moe_and_save_scalars_and_the_layout(observed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = observed_run("moe")
    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    records = _records(run / "run.jsonl")
    steps = [r for r in records if r["event"] == "step"]
    for tag, key in (("moe/aux_loss", "aux_loss"), ("moe/max_over_mean_load", "max_over_mean_load")):
        assert [(e.step, e.value) for e in acc.Scalars(tag)] == [
            (r["step"], pytest.approx(r["moe"][key], rel=1e-6)) for r in steps], tag
    saves = [r for r in records if r["event"] == "save"]
    for key in ("blocking_s", "total_s"):
        assert [(e.step, e.value) for e in acc.Scalars(f"save/{key}")] == [
            (r["step"], pytest.approx(r[key], rel=1e-6)) for r in saves], key
    assert not {"save/step", "eval/step", "step"} & set(acc.Tags()["scalars"])
    from tensorboard.util.tensor_util import make_ndarray
    (text,) = [make_ndarray(e.tensor_proto).item().decode() for e in acc.Tensors("layout/text_summary")]
    summary = next(r for r in records if r["event"] == "summary")
    assert text == layout_text(summary["layout"])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not OBSERVED["ft"].tensorboard, reason="the tensorboard package (extra [tensorboard])")
def test_tensorboard_of_a_fault_tolerant_run_has_its_steps_and_quorum_events(observed_run):
    """On one host the launcher writes the run's TensorBoard from the metrics file its
    coordinator writes: every committed step's loss once, the replicas per step, the discarded
    attempt and the quorum change."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = observed_run("ft")
    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    records = _records(run / "run.jsonl")
    steps = [r for r in records if r["event"] == "step"]
    for tag in ("loss", "replicas"):
        assert [(e.step, e.value) for e in acc.Scalars(tag)] == [
            (r["step"], pytest.approx(r[tag], rel=1e-6)) for r in steps], tag
    lost = [r for r in records if r["event"] == "quorum" and r["lost"]]
    assert lost and [(e.step, e.value) for e in acc.Scalars("quorum/lost")][0] == (lost[0]["step"], 1)
    discarded = [r for r in records if r["event"] == "discarded"]
    assert [e.step for e in acc.Scalars("discarded/attempt_s")] == [r["step"] for r in discarded]
    assert "layout/text_summary" in acc.Tags()["tensors"]


LOSSY = [{"event": "step", "step": 1, "loss": 4.0, "grad_norm": 1.0, "tokens_per_s": 10.0},
         {"event": "step", "step": 2},                                   # fields missing
         {"event": "step", "step": 3, "loss": "4.1", "grad_norm": None},   # wrong types
         {"event": "step", "step": 4, "loss": 3.0, "grad_norm": 1.0, "tokens_per_s": 10.0}]


def test_a_run_cut_short_draws_what_it_has_and_says_what_it_leaves_out(tmp_path):
    run = tmp_path / "run.jsonl"
    run.write_text("\n".join(json.dumps(r) for r in LOSSY) + '\n{"event": "step", "st')
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 0
    text = (tmp_path / "r.html").read_text()
    assert figures(text)["loss"]["loss-curve"] == {"x": [1, 4], "y": [4.0, 3.0]}
    notes = re.search(r'<ul class="note">(.*?)</ul>', text).group(1)
    for said in ("line 5 of the file could not be used (the last line, cut short",
                 "2 of 4 step records have no finite loss", "no summary record"):
        assert said in html.unescape(notes), notes
    assert headings(text) == ["Run", "Loss", "Gradient norm", "Throughput"]


def test_the_layout_text_shows_a_setting_it_does_not_know():
    """A layout key added later is shown as ``key value`` without a change to the renderer."""
    text = layout_text({"dp": 2, "pp": 1, "tp": 1, "cp": 1, "precision": "bf16", "etp": 2,
                        "new_flag": True, "unset_thing": 1})
    assert text == "dp 2 x cp 1 x pp 1 x tp 1, bf16, etp 2, new-flag", text
