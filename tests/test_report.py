"""`trainmesh report`: one self-contained HTML page of a dp x pp run (4 ranks, traffic on two
axes), checked in a headless browser."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import run_train

from trainmesh.cli import main

RUN = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "16", "--vocab-size", "64",
       "--global-batch", "8", "--steps", "6", "--warmup-steps", "2", "--microbatches", "2",
       "--eval-every", "2", "--dp", "2", "--pp", "2"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    proc, _ = run_train(RUN, tmp, timeout=300, name="run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp / "report.html"
    assert main(["report", str(tmp / "run.jsonl"), "-o", str(out)]) == 0
    return out


def _points(svg_path_d: str) -> int:
    return len(re.findall(r"[ML]\s*[-\d.]+\s+[-\d.]+", svg_path_d))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_report_is_self_contained_with_every_chart(page):
    text = page.read_text()
    assert "<script" not in text and "<link" not in text
    assert not re.search(r'(src|href)="(https?:|//|file:)', text)      # nothing loaded from outside
    assert len(re.findall(r'id="memory-bar-rank\d"', text)) == 4      # one bar per rank
    for gid, n in (("loss-curve", 6), ("grad-norm-curve", 6), ("tokens-curve", 6), ("eval-curve", 3)):
        m = re.search(rf'<g id="{gid}">\s*<path d="([^"]+)"', text)
        assert m and _points(m.group(1)) == n, gid
    assert re.search(r'id="traffic-bar-dp"', text) and re.search(r'id="traffic-bar-pp"', text)
    assert "<pre" not in text and "{&quot;" not in text and '{"' not in text   # tables, not JSON
    assert "<td>dp 2 x pp 2 x tp 1, 2 microbatches, schedule 1f1b, fp32 on 4 processes</td>" in text
    assert re.search(r"<td>[\d.,]+ (KiB|MiB)</td>", text)                   # sizes, not bytes


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_report_loads_in_a_browser_without_errors(page):
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line]
    assert not console, console
    assert 'id="loss-curve"' in proc.stdout and len(re.findall(r'id="memory-bar-rank\d"', proc.stdout)) == 4


def test_report_of_a_missing_file_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "RUN.jsonl" in err[0], err
