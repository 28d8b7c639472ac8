"""What a new user meets first: torchrun without layout flags, a resumed run's summary, --help,
--version, a misspelt flag, a warm-up longer than the run, and readable output."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import steps, summary, trainmesh_process
from tolerances import LOSS_ABS

from trainmesh.cli import main

TINY = ["--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--vocab-size", "32",
        "--global-batch", "4", "--steps", "4", "--optimizer", "sgd"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "COLUMNS")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _train(cmd: list[str] | None, args: list[str], metrics: Path) -> tuple[subprocess.CompletedProcess, list]:
    """``trainmesh train ARGS`` under ``cmd`` (torchrun), or as its own launcher (``None``:
    forked from the test zygote, the interpreter's start-up shared)."""
    argv = ["train", *args, "--metrics-out", str(metrics)]
    if cmd is None:
        proc = trainmesh_process(argv, metrics.parent, env=_env(), timeout=150, name=metrics.stem)
    else:
        proc = subprocess.run([*cmd, "-m", "trainmesh", *argv], capture_output=True, text=True,
                              timeout=150, env=_env())
    records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    return proc, records


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (the reference); torchrun with 2 processes and no layout flag, stopping after
    step 2 with a checkpoint; a local --dp 2 run resuming it to step 4."""
    tmp = tmp_path_factory.mktemp("first-hour")
    ck = tmp / "ck"
    ref = _train(None, TINY, tmp / "ref.jsonl")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    first = _train(torchrun, [*TINY, "--exit-after", "2", "--save-dir", str(ck), "--eval-every", "1",
                              "--eval-batches", "1"], tmp / "first.jsonl")
    resumed = _train(None, [*TINY, "--dp", "2", "--save-dir", str(ck), "--resume"],
                     tmp / "resumed.jsonl")
    for proc, _ in (ref, first, resumed):
        assert proc.returncode == 0, proc.stderr[-3000:]
    return {"ref": ref, "first": first, "resumed": resumed, "ck": ck, "tmp": tmp}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_torchrun_without_layout_flags_trains_at_dp_2(runs):
    proc, records = runs["first"]
    done = summary(records)
    assert done["world_size"] == 2 and done["layout"]["dp"] == 2
    ref = steps(runs["ref"][1])
    for mine, want in zip(steps(records), ref[:2]):       # the same curve as one process
        assert abs(mine["loss"] - want["loss"]) <= LOSS_ABS, (mine, want)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resumed_run_continues_and_its_summary_has_no_nan(runs):
    proc, records = runs["resumed"]
    ref = steps(runs["ref"][1])
    assert [r["step"] for r in steps(records)] == [3, 4]
    for mine, want in zip(steps(records), ref[2:]):
        assert abs(mine["loss"] - want["loss"]) <= LOSS_ABS, (mine, want)
    assert "nan" not in proc.stdout.lower() and "(from step 3)" in proc.stdout, proc.stdout
    title = next(line for line in proc.stdout.splitlines() if "(from step 3)" in line)
    first = float(title.split("loss ")[1].split(" ")[0])
    assert math.isclose(first, ref[2]["loss"], abs_tol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_console_says_what_ran_and_what_was_written(runs):
    proc, _ = runs["first"]
    out, err = proc.stdout, proc.stderr
    assert "{'dp'" not in out and "on 2 processes (cpu): dp 2 x cp 1 x pp 1 x tp 1" in out
    assert "eval loss" in out and "done in" in out and " MiB" in out
    assert err.count("warning: --warmup-steps 20 >= --steps 4") == 1   # one line, rank 0 only
    wrote = err[err.index("trainmesh: wrote"):]
    assert str(runs["tmp"] / "first.jsonl") in wrote and str(runs["ck"]) in wrote


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.timeout(60)
def test_layout_mismatch_under_torchrun_exits_2_naming_flags_and_size(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for argv, flag in ((["--dp", "4"], "--dp"), (["--tp", "4"], "--tp"),
                       (["--pp", "2", "--dp", "2"], "--dp")):
        code, out, err = _run(capsys, ["train", *TINY, *argv])
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert flag in err and "world size 2" in err and "Traceback" not in err


@pytest.mark.timeout(60)
def test_layout_is_derived_from_the_world_size():
    from trainmesh.cli.train import derive_layout
    assert derive_layout({}, 8).get("dp") == 8
    assert derive_layout({"tp": 2, "pp": 2}, 8).get("dp") == 2
    assert derive_layout({"dp": 2, "min_dp": 1}, 1) == {"dp": 2, "min_dp": 1}   # elastic: its rules
    assert derive_layout({"pp": 2, "tp": 2, "min_dp": 1}, 2) == {"pp": 2, "tp": 2, "min_dp": 1}
    assert derive_layout({"strategy": "ps", "ps_servers": 1}, 3).get("dp") == 2


@pytest.mark.timeout(60)
def test_version_typo_and_help(capsys):
    from trainmesh import __version__
    for argv in (["--version"], ["train", "--version"]):
        code, out, _ = _run(capsys, argv)
        assert code == 0 and out.strip() == f"trainmesh {__version__}"
    code, out, err = _run(capsys, ["train", "--dpp", "2"])
    assert code == 2 and out == "" and err.strip().endswith("did you mean --dp?"), err
    code, _, err = _run(capsys, ["plan", "--gpu-per-node", "8"])
    assert code == 2 and "did you mean --gpus-per-node?" in err
    code, out, _ = _run(capsys, ["train", "--help"])
    assert code == 0
    flat = " ".join(out.split())
    for title in ("layout", "model:", "data:", "optimisation:", "precision & memory:",
                  "checkpoints:", "observability:", "launch:"):
        assert f"\n{title}" in out, title
    assert "(default 1f1b; one of naive, gpipe, 1f1b, interleaved, zb1p)" in flat
    assert "(default 1.0)" in flat[flat.index("--grad-clip"):][:200]
    assert "A bare `trainmesh train` runs the demo" in flat
    code, out, _ = _run(capsys, ["plan", "--help"])
    assert code == 0 and "--lr" not in out and "--metrics-out" not in out and "--gpu NAME" in out


@pytest.mark.timeout(60)
def test_a_field_without_group_gets_a_sensible_one():
    from dataclasses import dataclass

    from trainmesh.config.validation import flags_of, setting

    @dataclass
    class Extra:
        keep_last: int = setting(0, "checkpoints kept")
        loss_out: str | None = setting(None, "a file")
        widget: int = setting(1, "something new", group="model")
        other: int = setting(1, "something else")
    groups = {f.field: f.group for f in flags_of(Extra, group="layout").values()}
    assert groups == {"keep_last": "checkpoints", "loss_out": "observability", "widget": "model",
                      "other": "layout"}


@pytest.mark.timeout(60)
def test_warmup_longer_than_the_run_is_one_warning(capsys):
    from trainmesh.cli.train import warn_warmup
    from trainmesh.config.train import build_train_config
    warn_warmup(build_train_config({"steps": 20}))
    warn_warmup(build_train_config({"steps": 21}))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--warmup-steps 20 >= --steps 20" in err


@pytest.mark.timeout(60)
def test_gpu_names_give_mfu_its_peak():
    import torch

    from trainmesh.observe.flops import device_peak_tflops, peak_tflops
    cpu = torch.device("cpu")
    assert device_peak_tflops(cpu, "bf16") is None                      # CPU: no peak
    assert device_peak_tflops(cpu, "bf16", gpu="a100-80gb") == 312.0
    assert device_peak_tflops(cpu, "fp32", gpu="h100") == 67.0          # plain fp32, no TF32
    assert device_peak_tflops(cpu, "bf16", 100.0, gpu="h100") == 100.0  # --peak-tflops wins
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("NVIDIA L40S", "bf16") == 362.0 and peak_tflops("NVIDIA L4", "bf16") == 121.0
