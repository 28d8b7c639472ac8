"""--async-save: the same run with synchronous and with background saves (a model of a few MB,
so that writing takes measurable time): the same losses, the same checkpoint contents, a save
event per save, each background save's stall shorter than its time to disk. A save returns while
its write is held back (the write is not on the training thread), and that write, done after the
next step, still writes the weights of the step saved. A worker killed (SIGKILL) while its
background write is under way leaves the previous checkpoint the newest and loadable. How much
less training stalls is a timing, measured by benchmarks/bench_async_save.py, not asserted here.

Planted and seen failing: the snapshot aliasing the live weights (no copy: the held-back write
holds step 2's weights); the write done on the saving thread (the held-back write had run before
save returned); the checkpoint published before the rank's file was written (the killed save's
directory became the newest).
(Resuming from --async-save checkpoints: tests/test_diloco.py, test_resume_between_...)"""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import run_train, steps
from tolerances import LOSS_ABS

from trainmesh.checkpoint.savedir import remove_stale_tmp
from trainmesh.checkpoint.sharded import _Reader, latest
from trainmesh.cli import main

pytestmark = pytest.mark.slow

# 6.3 M parameters, few tokens per step: each checkpoint holds 75 MB (weights and AdamW moments),
# saved every 2 steps.
BIG = ["--layers", "2", "--d-model", "512", "--heads", "4", "--seq-len", "8", "--vocab-size", "64",
       "--global-batch", "4", "--steps", "12", "--warmup-steps", "5", "--dp", "2", "--save-every", "2"]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    out = {}
    for name, extra in (("sync", []), ("async", ["--async-save"])):
        tmp = tmp_path_factory.mktemp(name)
        proc, records = run_train([*BIG, *extra, "--save-dir", str(tmp / "ck")], tmp, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = (records, tmp / "ck")
    return out


def _saves(records):
    return [r for r in records if r["event"] == "save"]


@pytest.mark.timeout(600)
def test_async_save_blocks_less_and_writes_the_same_checkpoints(both):
    (sync, sync_dir), (run, run_dir) = both["sync"], both["async"]
    for a, b in zip(steps(sync), steps(run), strict=True):
        assert abs(a["loss"] - b["loss"]) <= LOSS_ABS, (a["step"], a["loss"], b["loss"])
    s, a = _saves(sync), _saves(run)
    assert [e["step"] for e in s] == [e["step"] for e in a] == [2, 4, 6, 8, 10, 12]
    for e in s:
        assert e["blocking_s"] == e["total_s"] > 0, e
    for e in a:
        assert 0 < e["blocking_s"] < e["total_s"], e   # the write and hash came after the stall
        assert Path(e["path"]).name == f"step-{e['step']:08d}"
    for step in (2, 12):   # same format, same contents
        want, got = _Reader(sync_dir / f"step-{step:08d}"), _Reader(run_dir / f"step-{step:08d}")
        assert sorted(got.manifest["tensors"]) == sorted(want.manifest["tensors"])
        job = {"job": None, "rng": None}   # the elastic job id, the unseeded generators differ
        assert {**got.manifest["trainer"], **job} == {**want.manifest["trainer"], **job}
        assert got.manifest["layout"] == want.manifest["layout"]
        for key in want.manifest["tensors"]:
            assert torch.equal(got.get(key), want.get(key)), (step, key)
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".step")) == []


# One process, world 1. Save step 1 with a writer held back until step 2 has changed the weights
# (the snapshot must not see that); then start the save of step 2 with a writer that stalls
# half-way through its file; the test kills the process there.
KILLED_MID_WRITE = textwrap.dedent("""
    import sys, threading, time, torch
    from pathlib import Path
    from safetensors.torch import save_file
    from trainmesh.checkpoint import async_save
    from trainmesh.core.distributed import init_distributed
    from trainmesh.engine.engine import Engine
    init_distributed(timeout_s=60, device="cpu")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    engine = Engine(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                    loss_fn=lambda m, b: m(b).pow(2).mean())
    saver = async_save.AsyncSaver(engine.comm)
    def save():
        engine.save(sys.argv[1], saver=saver)
    real, go, written = async_save._write_entry, threading.Event(), threading.Event()
    def held_back(tmp, rank, tensors):
        go.wait(10)   # a save that waited for its write would return after these 10 s
        real(tmp, rank, tensors)
        written.set()
    async_save._write_entry = held_back
    engine.train_step(torch.randn(8, 64))
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save()
    assert not written.is_set(), "save() returned only once its write was done"
    engine.train_step(torch.randn(8, 64))   # changes the weights while the write waits
    go.set()
    saver.wait()
    save_file(saved, str(Path(sys.argv[1]).parent / "saved.safetensors"))
    def stalled(tmp, rank, tensors):
        (tmp / f"__{rank}_0.distcp").write_bytes(b"half a file")
        print("WRITING", flush=True)
        time.sleep(120)
    async_save._write_entry = stalled
    save()
    time.sleep(120)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_sigkill_during_a_background_write_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ck"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_WRITE, str(root)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        line = ""
        while "WRITING" not in line and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()
                if not line and proc.poll() is not None:
                    break
        assert "WRITING" in line, proc.stderr.read() if proc.poll() is not None else "no write seen"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    newest = latest(root)
    assert newest is not None and newest.name == "step-00000001", newest
    reader = _Reader(newest)
    reader.check_files(verify=True)   # every piece present and matching its sha256
    for key in reader.manifest["tensors"]:
        reader.get(key)
    from safetensors.torch import load_file
    for name, want in load_file(str(tmp_path / "saved.safetensors")).items():
        assert torch.equal(reader.get(f"model.{name}"), want), name   # the weights of step 1
    assert (root / ".step-00000002.tmp").is_dir()   # abandoned, never renamed into place
    assert remove_stale_tmp(root) == [root / ".step-00000002.tmp"]


@pytest.mark.timeout(60)
def test_async_save_needs_a_save_dir(capsys):
    assert main(["train", "--async-save"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--async-save" in err[0] and "--save-dir" in err[0], err
