"""Bad input is refused before any worker starts: exit 2, one line naming the flag, no traceback.

Nearly everything runs in process through ``trainmesh.cli.main`` with the launcher replaced by a
stub (a run that gets past validation returns :data:`LAUNCHED` instead of starting workers).
Two real runs (one writes a checkpoint, one resumes it) check the resume path end to end.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import LAUNCHED, run_train, steps
from helpers import assert_refused as refused
from safetensors.torch import save_file

from trainmesh.cli import build_parser, main
from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.errors import ConfigError

T = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "16", "--vocab-size", "64",
     "--global-batch", "8"]
GiB = 2**30


@pytest.fixture(autouse=True)
def validation_only(no_launch):
    """Every test here: no worker ever starts; the process is a launcher, not a worker."""


# ---------------------------------------------------------------- A. one place for layout rules
def test_build_up_scaffolding_is_gone():
    import trainmesh.cli.train as train
    import trainmesh.data_parallel as dp
    assert not hasattr(dp, "SUPPORTED_ZERO")
    assert not hasattr(train, "_has_module")


def test_zero3_reshard_is_checked_naming_the_flag(capsys):
    line = refused(capsys, ["train", *T, "--pp", "2", "--dp", "2", "--zero", "3",
                            "--zero3-reshard", "layer"], "--zero3-reshard")
    assert "step, microbatch" in line
    refused(capsys, ["train", *T, "--zero", "3", "--zero3-reshard", "microbatch"], "--zero3-reshard")
    assert ParallelConfig(pp=2, dp=2, zero=3, zero3_reshard="microbatch").zero3_reshard == "microbatch"
    assert ParallelConfig(pp=2, schedule="zb1p").schedule == "zb1p"
    with pytest.raises(ConfigError, match="--schedule"):
        ParallelConfig(pp=2, schedule="zb2p")


def test_plan_takes_the_train_flags_it_uses_from_the_one_table(capsys):
    """plan's prediction uses the layout, model, precision and memory flags of the one table
    (and shows only those: no --lr, --save-dir or --metrics-out in `plan --help`)."""
    from trainmesh.config.train import FLAGS

    def options(command: str) -> set[str]:
        sub = build_parser()._subparsers._group_actions[0].choices[command]
        return {o for a in sub._actions for o in a.option_strings}
    used = {f for f, flag in FLAGS.items()
            if flag.group in ("layout", "model", "precision & memory")} - {"--model-dir"}
    assert used | {"--global-batch", "--optimizer"} <= options("plan")
    assert not {"--lr", "--save-dir", "--metrics-out", "--steps"} & options("plan")
    refused(capsys, ["plan", "--model", "tiny", "--seq-len", "0"], "--seq-len")
    refused(capsys, ["plan", "--model", "tiny", "--precision", "fp8"], "--precision")


# ---------------------------------------------------------------- B. every field's type and range
@pytest.mark.parametrize("args, flag", [
    (["--seq-len", "0"], "--seq-len"),
    (["--d-model", "0"], "--d-model"),
    (["--vocab-size", "0"], "--vocab-size"),
    (["--layers", "0"], "--layers"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--grad-clip", "nan"], "--grad-clip"),
    (["--timeout", "nan"], "--timeout"),
    (["--timeout", "inf"], "--timeout"),
    (["--bucket-mb", "nan"], "--bucket-mb"),
    (["--bucket-mb", "inf"], "--bucket-mb"),
    (["--seed", "99999999999999999999"], "--seed"),
    (["--seed", "-1"], "--seed"),
    (["--steps", "99999999999999999999"], "--steps"),
])
def test_bad_flag_values(capsys, args, flag):
    refused(capsys, ["train", *T, *args], flag)


@pytest.mark.parametrize("toml, flag", [
    ('seed = "x"', "--seed"),
    ("data = 5", "--data"),
    ("save_dir = 5", "--save-dir"),
    ('lr = "abc"', "--lr"),
    ("steps = true", "--steps"),
    ("dp = 1.5", "--dp"),
    ("resume = 1", "--resume"),
    ("timeout = -1", "--timeout"),
    ("[train]\ntimeout_s = 30", "--config"),
])
def test_bad_toml_values(capsys, tmp_path, toml, flag):
    path = tmp_path / "run.toml"
    path.write_text(toml + "\n")
    refused(capsys, ["train", *T, "--config", str(path)], flag)


def test_toml_keys_are_the_flag_names(tmp_path):
    from trainmesh.config.train import build_train_config, read_toml
    path = tmp_path / "run.toml"
    path.write_text("timeout = 30\nlr = 1\n[parallel]\nbucket-mb = 2\n")
    cfg = build_train_config(read_toml(str(path)))
    assert cfg.parallel.timeout_s == 30.0 and cfg.lr == 1.0 and cfg.parallel.bucket_mb == 2.0
    assert isinstance(cfg.lr, float)


def test_save_dir_must_be_a_writable_directory(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    refused(capsys, ["train", *T, "--save-dir", str(afile)], "--save-dir")
    refused(capsys, ["train", *T, "--save-dir", str(afile / "ck")], "--save-dir")
    refused(capsys, ["train", *T, "--metrics-out", str(tmp_path)], "--metrics-out")
    assert main(["train", *T, "--save-dir", str(tmp_path / "new" / "ck")]) == LAUNCHED


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_save_dir_unwritable(capsys, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    refused(capsys, ["train", *T, "--save-dir", str(locked / "ck")], "--save-dir")


# ---------------------------------------------------------------- C. token files
@pytest.mark.parametrize("name, array, flag", [
    ("float", np.random.default_rng(0).random(1000), "--data"),
    ("bool", np.ones(1000, dtype=bool), "--data"),
    ("negative", np.full(1000, -1, dtype=np.int64), "--data"),
    ("2d", np.zeros((100, 20), dtype=np.int32), "--data"),
    ("too-large", np.full(1000, 64, dtype=np.int64), "--data"),
])
def test_bad_token_files(capsys, tmp_path, name, array, flag):
    path = tmp_path / f"{name}.npy"
    np.save(path, array)
    refused(capsys, ["train", *T, "--data", str(path)], flag)


def test_good_token_file_passes(tmp_path):
    path = tmp_path / "ok.npy"
    np.save(path, np.arange(1000, dtype=np.uint16) % 64)
    assert main(["train", *T, "--data", str(path)]) == LAUNCHED


# ---------------------------------------------------------------- D. resources
@pytest.fixture
def machine(monkeypatch):
    """A 2-core machine with 32 GiB of memory; the GPT must never be built by the check."""
    import trainmesh.models.gpt
    import trainmesh.planner.fit as fit
    monkeypatch.setattr(fit, "cpu_cores", lambda: 2)
    monkeypatch.setattr(fit, "host_memory_bytes", lambda: 32 * GiB)

    def no_model(*a, **k):
        raise AssertionError("the fit check built the model")
    monkeypatch.setattr(trainmesh.models.gpt.GPT, "__init__", no_model)


def test_too_many_processes_for_the_cores(capsys, machine):
    line = refused(capsys, ["train", *T, "--dp", "100000", "--global-batch", "100000"], "--dp")
    assert "100000" in line and "2 CPU cores" in line
    refused(capsys, ["train", *T, "--dp", "17", "--global-batch", "17"], "--dp")
    assert main(["train", *T, "--dp", "16", "--global-batch", "16"]) == LAUNCHED
    assert main(["train", *T, "--dp", "17", "--global-batch", "17", "--force"]) == LAUNCHED


def test_model_too_large_for_the_memory(capsys, machine):
    line = refused(capsys, ["train", *T, "--layers", "100000"], "memory")
    assert "GB" in line and "--force" in line
    assert main(["train", *T, "--layers", "100000", "--force"]) == LAUNCHED


def test_model_too_large_for_any_machine(capsys):
    refused(capsys, ["train", *T, "--d-model", "65536", "--heads", "4", "--layers", "64"], "memory")


def test_memory_counts_every_local_rank(capsys, machine, monkeypatch):
    """The local ranks' predicted peaks together must fit: one byte short is refused."""
    import trainmesh.planner.fit as fit
    from trainmesh.config.train import build_train_config
    from trainmesh.planner.predict import predict_run
    args = [*T, "--dp", "16", "--global-batch", "16"]
    cfg = build_train_config(given(args))
    base = 300 * 2**20   # the worker's footprint before the model, pinned for the check
    monkeypatch.setattr(fit, "measured_base_bytes", lambda: base)
    need = sum(r.peak_mem_bytes for r in predict_run(cfg, base_bytes=base).ranks) \
        + 16 * fit.data_bytes(cfg)                  # each rank's data path
    monkeypatch.setattr(fit, "host_memory_bytes", lambda: need - 1)
    refused(capsys, ["train", *args], "memory")
    monkeypatch.setattr(fit, "host_memory_bytes", lambda: need)
    assert main(["train", *args]) == LAUNCHED


def given(args: list[str]) -> dict:
    from trainmesh.cli.train import given_flags
    return given_flags(build_parser().parse_args(["train", *args]))


def test_cuda_needs_a_gpu_per_local_rank(capsys, machine, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    line = refused(capsys, ["train", *T, "--device", "cuda", "--dp", "2"], "--device")
    assert "2 local ranks" in line and "1 GPU" in line


# ---------------------------------------------------------------- E. consolidate output paths
def fake_checkpoint(root: Path, run: dict | None = None, step: int = 4) -> Path:
    """A minimal complete checkpoint directory (one tensor) whose trainer state holds ``run``."""
    from trainmesh.checkpoint.legacy import FORMAT, MANIFEST   # the first format: still read
    directory = root / f"step-{step:08d}"
    directory.mkdir(parents=True)
    save_file({"param/w": torch.zeros(2)}, str(directory / "rank00000.safetensors"))
    sha = hashlib.sha256((directory / "rank00000.safetensors").read_bytes()).hexdigest()
    trainer = {"step": step, "group_lrs": [0.1], **({"run": run} if run else {})}
    manifest = {"format": FORMAT, "step": step, "layout": {}, "trainer": trainer,
                "files": {"rank00000.safetensors": sha},
                "tensors": {"param/w": "rank00000.safetensors"}}
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return directory


def test_consolidate_bad_output_paths(capsys, tmp_path):
    fake_checkpoint(tmp_path / "ck")
    afile = tmp_path / "x.txt"
    afile.write_text("")
    refused(capsys, ["checkpoint", "consolidate", str(tmp_path / "ck"), str(afile / "m.safetensors")], "OUT")
    (tmp_path / "d.safetensors").mkdir()
    refused(capsys, ["checkpoint", "consolidate", str(tmp_path / "ck"), str(tmp_path / "d.safetensors")], "OUT")
    assert main(["checkpoint", "consolidate", str(tmp_path / "ck"), str(tmp_path / "m.safetensors")]) == 0


# ---------------------------------------------------------------- F. resume checks the checkpoint
RUN = {"layers": 2, "d_model": 32, "heads": 4, "seq_len": 16, "vocab_size": 64, "optimizer": "sgd",
       "seed": 0, "global_batch": 8, "lr": 0.3, "warmup_steps": 20, "steps": 4, "data": "synthetic",
       "experts": 0, "top_k": 2, "moe_every": 1, "moe_hidden": 0, "moe_aux_loss": 0.01}


@pytest.mark.parametrize("args, flag", [
    (["--layers", "1"], "--layers"),
    (["--optimizer", "adamw"], "--optimizer"),
    (["--d-model", "64"], "--d-model"),
    (["--heads", "8"], "--heads"),
    (["--seq-len", "32"], "--seq-len"),
    (["--vocab-size", "128"], "--vocab-size"),
])
def test_resume_refuses_another_model_or_optimizer(capsys, tmp_path, args, flag):
    fake_checkpoint(tmp_path / "ck", RUN)
    optimizer = [] if "--optimizer" in args else ["--optimizer", "sgd"]
    argv = ["train", *T, *optimizer, "--steps", "8", "--save-dir", str(tmp_path / "ck"), "--resume", *args]
    line = refused(capsys, argv, flag)
    value = args[1]
    assert value in line and str(RUN[flag[2:].replace("-", "_")]) in line   # both values


def test_resume_refusal_also_in_a_torchrun_worker(capsys, tmp_path, monkeypatch):
    fake_checkpoint(tmp_path / "ck", RUN)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    refused(capsys, ["train", *T, "--optimizer", "sgd", "--layers", "1", "--save-dir",
                     str(tmp_path / "ck"), "--resume"], "--layers")


def test_resume_notice_for_seed_batch_and_schedule(tmp_path):
    from trainmesh.checkpoint.resume import check_resume
    from trainmesh.config.train import build_train_config
    fake_checkpoint(tmp_path / "ck", RUN)
    same = dict(layers=2, d_model=32, heads=4, seq_len=16, vocab_size=64, optimizer="sgd",
                steps=4, save_dir=str(tmp_path / "ck"), resume=True, global_batch=8)
    assert check_resume(build_train_config(same)) is None
    notice = check_resume(build_train_config({**same, "seed": 1, "global_batch": 16, "lr": 0.1}))
    assert notice is not None and len(notice.splitlines()) == 1
    assert "--seed 0 -> 1" in notice and "--global-batch 8 -> 16" in notice and "--lr 0.3 -> 0.1" in notice


@pytest.fixture(scope="module")
def sgd_checkpoint(tmp_path_factory):
    """A real 4-step SGD run of the 2-layer model, saved at its end."""
    tmp = tmp_path_factory.mktemp("ck")
    proc, _ = run_train([*T, "--optimizer", "sgd", "--steps", "4", "--save-dir", str(tmp / "ck")], tmp)
    assert proc.returncode == 0, proc.stderr
    return tmp / "ck"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resume_end_to_end(capsys, sgd_checkpoint, tmp_path):
    from trainmesh.checkpoint.sharded import MANIFEST, latest
    from trainmesh.run.schedule_lr import warmup_cosine
    manifest = json.loads((latest(sgd_checkpoint) / MANIFEST).read_text())
    assert manifest["trainer"]["run"] == RUN
    base = ["train", *T, "--optimizer", "sgd", "--steps", "8", "--save-dir", str(sgd_checkpoint), "--resume"]
    refused(capsys, [*base, "--layers", "1"], "--layers")
    refused(capsys, ["train", *T, "--steps", "8", "--save-dir", str(sgd_checkpoint), "--resume"], "--optimizer")
    refused(capsys, [*base, "--d-model", "64"], "--d-model")
    # A new seed and LR resume, with one notice, and the new schedule's LR from the first step.
    proc, records = run_train([*base[1:], "--seed", "1", "--lr", "0.1", "--steps", "6"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    notices = [line for line in proc.stdout.splitlines() if "note: resuming" in line]
    assert len(notices) == 1 and "--seed 0 -> 1" in notices[0] and "--lr 0.3 -> 0.1" in notices[0]
    first = steps(records)[0]
    param = torch.nn.Parameter(torch.zeros(1))
    sched = warmup_cosine(torch.optim.SGD([param], lr=0.1), warmup_steps=20, total_steps=6)
    assert first["step"] == 5
    assert first["lr"] == pytest.approx(0.1 * sched.lr_lambdas[0](4), rel=1e-9)
    assert all(math.isfinite(r["loss"]) for r in steps(records))


@pytest.mark.slow
def test_cli_exit_codes_without_traceback_as_a_process(tmp_path):
    """The same refusal from a real `trainmesh train` process: exit 2, one line."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "trainmesh", "train", *T, "--lr", "nan"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--lr" in proc.stderr


@pytest.mark.parametrize("command", ["train", "plan"])
def test_generated_help_renders(capsys, command):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0 and "--seq-len" in capsys.readouterr().out
