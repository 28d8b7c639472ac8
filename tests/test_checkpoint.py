"""Checkpoints: resume under another layout, consolidate, refuse damaged pieces, survive a
save that dies midway, and elastic restarts that resume where they left off."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    SMALL,
    Launched,
    assert_equivalent,
    check_prediction,
    one_process,
    run_train,
    steps,
    summary,
)
from safetensors.torch import load_file
from tolerances import LOSS_ABS, NORM_REL, TRAINED_WEIGHTS_LOSS_ABS

from trainmesh.checkpoint.sharded import MANIFEST, CheckpointError, _Reader, latest
from trainmesh.cli import main


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run(one_process("adamw"))


# One chain of planned preemptions: each layout resumes the one before from a copy of its
# checkpoint, runs 5 steps, saves and exits; the transitions cover DP + ZeRO-2 -> pp x tp,
# pp x tp -> ZeRO-3 at dp 4, ZeRO-3 -> one process.
CHAIN = {"dp2-zero2": ["--dp", "2", "--zero", "2"],
         "pp2-tp2": ["--pp", "2", "--tp", "2", "--microbatches", "2"],
         "dp4-zero3": ["--dp", "4", "--zero", "3"],
         "one-process": []}
PER_STAGE = 5


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict[str, tuple[list[dict], Path]]:
    """{layout: (its metrics records, its checkpoint directory)}, in chain order."""
    tmp, out, previous = tmp_path_factory.mktemp("chain"), {}, None
    for i, (name, layout) in enumerate(CHAIN.items()):
        ck = tmp / f"ck-{name}"
        if previous is not None:
            shutil.copytree(previous, ck)
        args = [*SMALL, *layout, "--save-dir", str(ck), "--save-every", str(PER_STAGE),
                "--exit-after", str((i + 1) * PER_STAGE), *(["--resume"] if previous else [])]
        proc, records = run_train(args, tmp, name=name)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        if previous is None:
            check_prediction([*SMALL, *layout], summary(records))   # the planner predicted this run
        out[name], previous = (records, ck), ck
    return out


@pytest.fixture(scope="module")
def saved(chain) -> Path:
    """The first layout's checkpoint of step 5 (dp 2, ZeRO-2)."""
    return chain["dp2-zero2"][1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_under_another_layout(reference, chain):
    ref = steps(reference)
    for i, (name, (records, _)) in enumerate(chain.items()):
        got = steps(records)
        assert [r["step"] for r in got] == list(range(i * PER_STAGE + 1, (i + 1) * PER_STAGE + 1)), name
        assert summary(records)["steps"] == PER_STAGE * (i + 1), name
        for a, b in zip(ref[i * PER_STAGE:], got):
            assert abs(a["loss"] - b["loss"]) <= LOSS_ABS, (name, a, b)
            assert abs(a["grad_norm"] - b["grad_norm"]) <= NORM_REL * a["grad_norm"], (name, a, b)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_consolidated_weights_give_the_sharded_loss(reference, saved, tmp_path):
    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.models.gpt import GPT, GPTConfig
    out = tmp_path / "full.safetensors"
    assert main(["checkpoint", "consolidate", str(saved), str(out)]) == 0
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4), device="meta")
    model.load_state_dict(load_file(str(out)), assign=True)
    step = PER_STAGE + 1                                # the first step after the save
    batch = SyntheticCorpus(64, 16).batch(0, step, 8)
    loss_sum, count = model(**batch)
    assert abs(loss_sum.item() / count.item() - steps(reference)[step - 1]["loss"]) <= TRAINED_WEIGHTS_LOSS_ABS


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_piece_is_refused(saved, tmp_path, damage):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    piece = sorted(latest(ck).glob("*.distcp"))[0]
    data = bytearray(piece.read_bytes())
    if damage == "flip":
        data[-10] ^= 0xFF
        piece.write_bytes(bytes(data))
    elif damage == "truncate":
        piece.write_bytes(bytes(data[: len(data) // 2]))
    else:
        piece.unlink()
    with pytest.raises(CheckpointError, match=piece.name):
        _Reader(latest(ck)).check_files(verify=True)
    assert main(["checkpoint", "consolidate", str(ck), str(tmp_path / "x.safetensors")]) == 2


def _save_dies_midway(root: str) -> None:
    """Rank 0 dies after every piece of step 2 is written, before the checkpoint is published."""
    import torch.distributed as dist

    from trainmesh import Engine, ParallelConfig
    from trainmesh.data.corpus import SyntheticCorpus, dp_slice
    from trainmesh.models.gpt import GPT, GPTConfig
    engine = Engine(GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)),
                    lambda ps: torch.optim.AdamW(ps, lr=1e-3), lambda m, b: m(**b), ParallelConfig(dp=2))
    data = SyntheticCorpus(64, 16)
    engine.train_step(dp_slice(data.batch(0, 1, 8), dist.get_rank(), 2))
    engine.save(root)
    engine.train_step(dp_slice(data.batch(0, 2, 8), dist.get_rank(), 2))
    if dist.get_rank() == 0:
        os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)   # the process dies at publish
    engine.save(root)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_save_killed_midway_leaves_previous_checkpoint(tmp_path):
    from trainmesh.testing import run_distributed
    with pytest.raises(Exception):
        run_distributed(_save_dies_midway, 2, str(tmp_path), timeout_s=20)
    assert (tmp_path / ".step-00000002.tmp").exists()          # the half-written save
    assert latest(tmp_path).name == "step-00000001"             # ... is not what resumes
    reader = _Reader(latest(tmp_path))
    reader.check_files(verify=True)                              # every piece verifies
    for key in reader.manifest["tensors"]:
        reader.get(key)


def elastic_trial(tmp: Path, *, kill_at: int = 12) -> tuple[int, list[dict], str, float]:
    """The reference's 20 steps at dp=2; SIGKILL one worker once step `kill_at` is logged;
    --max-restarts 1. Returns the exit code, the records, stderr and the time of the kill.
    (The launcher forks from the test zygote, its workers from the zygote's fork server: no
    interpreter started for it.)"""
    metrics = tmp / "e.jsonl"
    args = ["train", *SMALL, "--optimizer", "adamw", "--dp", "2", "--save-dir", str(tmp / "ck"),
            "--save-every", "5", "--max-restarts", "1", "--timeout", "30", "--metrics-out", str(metrics)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = Launched(args, tmp, env=env, name="e", own_fork_server=False)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and run.poll() is None:
            if metrics.exists() and f'"step": {kill_at},' in metrics.read_text():
                break
            time.sleep(0.02)
        pids = run.workers()     # the workers, not their fork server (which a
        assert len(pids) == 2, pids  # restart would have to start again)
        os.kill(pids[-1], signal.SIGKILL)
        killed_at = time.time()
        _, err = run.communicate(timeout=180)
    finally:   # a failed test ends the run
        run.end()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return run.returncode, records, err, killed_at


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_elastic_restart_resumes_exactly(reference, tmp_path):
    ref = reference
    # The soak: TRAINMESH_ELASTIC_TRIALS=10 python -m pytest tests/test_checkpoint.py -k elastic
    for trial in range(int(os.environ.get("TRAINMESH_ELASTIC_TRIALS", "1"))):
        tmp = tmp_path / f"t{trial}"
        tmp.mkdir()
        code, records, err, killed_at = elastic_trial(tmp)
        assert code == 0, err[-3000:]
        for step in (5, 10):   # resumed from a checkpoint, not from the start: none rewritten
            saved = tmp / "ck" / f"step-{step:08d}" / MANIFEST
            assert saved.stat().st_mtime < killed_at, f"step {step} was saved again after the kill"
        assert abs(summary(records)["final_loss"] - summary(ref)["final_loss"]) <= LOSS_ABS
        assert_equivalent(ref, records)
