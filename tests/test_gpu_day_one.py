"""benchmarks/gpu_day_one.py's parts a CPU can check: its flags, and its refusal without CUDA."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_day_one.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the script would run")
def test_without_cuda_one_line_and_exit_2():
    proc = _run("--only", "cp")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "no CUDA device" in lines[0] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args", [["--only", "cp,warp"], ["--only", ","], ["--steps", "0"],
                                  ["--offload-gpu-gib", "-1"], ["--steps", "x"]])
def test_bad_flags_exit_2_naming_them(args):
    proc = _run(*args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) <= 2 and "Traceback" not in proc.stderr, proc.stderr
    assert args[0] in lines[-1]


def test_flags_parse_into_rows():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_day_one
    finally:
        sys.path.remove(str(SCRIPT.parent))
    a = gpu_day_one.parse_args(["--only", "planner, cp", "--steps", "3"])
    assert a.rows == ["planner", "cp"] and a.steps == 3
    assert gpu_day_one.parse_args([]).rows == list(gpu_day_one.ROWS)
    assert set(gpu_day_one.RUNNERS) == set(gpu_day_one.ROWS)
