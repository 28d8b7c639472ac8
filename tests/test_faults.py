"""Never hang, never save garbage: stalled ranks, divergence, signals, a busy --save-dir.

Each end-to-end check launches `trainmesh train` as a user would, forked from the test zygote
(tests/launcher_zygote.py), which skips the interpreter's start-up: where the test signals the
launcher or its workers, a launcher with a fork server of its own (its process tree a fresh
launcher's: tests/helpers.py ``Launched``); the two stalled runs, which wait in parallel, are
fresh processes.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import Launched, trainmesh_process

from trainmesh.config.parallel import ParallelConfig
from trainmesh.engine.precision import Precision
from trainmesh.testing import worker_pids

T = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "16", "--vocab-size", "64",
     "--global-batch", "8"]
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def start(args: list[str], metrics: Path) -> Launched:
    """`trainmesh train --dp 2 ARGS` as a launcher of its own in its own process group (so a
    Ctrl-C can be sent to its group)."""
    return Launched(["train", "--dp", "2", *T, *args, "--metrics-out", str(metrics)],
                    metrics.parent, env=ENV, name=metrics.stem)


def run_to_end(args: list[str], metrics: Path, name: str) -> subprocess.CompletedProcess:
    """`trainmesh train --dp 2 ARGS` to its end, forked from the test zygote (tests/helpers.py
    ``trainmesh_process``: no interpreter start-up of its own), for runs that end by themselves."""
    return trainmesh_process(["train", "--dp", "2", *T, *args, "--metrics-out", str(metrics)],
                             metrics.parent, env=ENV, timeout=120, name=name)


def kill_all(proc: Launched, pids: list[int]) -> None:
    """Clean-up after a failed check: the launcher's group and its workers, stopped or not."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.end()


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def wait_for_steps(proc: Launched, metrics: Path, n: int, deadline_s: float = 180) -> list[int]:
    """Block until the run logged ``n`` steps; returns its worker pids."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        if metrics.exists() and metrics.read_text().count("\n") >= n:
            pids = worker_pids(proc.pid)
            assert len(pids) == 2, pids
            return pids
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {deadline_s}s")


def finish(proc: Launched, within_s: float) -> str:
    """Wait for the run to end; its stderr. Not ending in time is a failed assertion."""
    try:
        return proc.communicate(timeout=within_s)[1]
    except subprocess.TimeoutExpired:
        proc.end()
        raise AssertionError(f"the run did not end within {within_s}s") from None


def headline(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("trainmesh train:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def in_threads(*jobs) -> None:
    """Run the zero-argument callables in parallel; re-raise the first failure."""
    errors: list[BaseException] = []

    def guard(job):
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=guard, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


# ---------------------------------------------------------------- a stalled rank
STALL_TIMEOUT_S = 10


def _stall(victim: int, tmp: Path) -> None:
    """SIGSTOP rank ``victim``: exit 1 within --timeout + 5 s naming it, no worker left."""
    proc = start(["--steps", "100000", "--timeout", str(STALL_TIMEOUT_S)], tmp / f"stall{victim}.jsonl")
    pids: list[int] = []
    try:
        pids = wait_for_steps(proc, tmp / f"stall{victim}.jsonl", 2)
        os.kill(pids[victim], signal.SIGSTOP)
        stopped = time.monotonic()
        err = finish(proc, 60)
        took = time.monotonic() - stopped
    finally:
        kill_all(proc, pids)
    assert proc.returncode == 1, err[-3000:]
    assert took < STALL_TIMEOUT_S + 5, \
        f"rank {victim} stalled: the job took {took:.1f}s to end, more than --timeout {STALL_TIMEOUT_S} + 5 s"
    line = headline(err)
    assert re.match(rf"trainmesh train: rank {victim} on \S+ stopped answering", line), line
    assert not any(alive(pid) for pid in pids), "a worker outlived the launcher"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stalled_rank_ends_the_job_naming_it(tmp_path):
    """Both in parallel (each waits out --timeout), forked from the zygote together."""
    in_threads(lambda: _stall(0, tmp_path), lambda: _stall(1, tmp_path))


# ---------------------------------------------------------------- signals, a killed launcher
PR_SET_CHILD_SUBREAPER = 36


def _launcher_killed(tmp: Path) -> None:
    """The workers are stopped (SIGSTOP) before the launcher is SIGKILLed, so only the kernel's
    parent-death signal can end them: running, they would also have ended on noticing that the
    launcher's store is gone, which hid a missing parent-death signal. Meanwhile this process is
    the subreaper of what it started: the orphaned workers become its children (in another
    process group of the session: theirs is not orphaned, so the kernel sends no SIGHUP), and
    how each ended is read, not guessed."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    proc = start(["--steps", "100000"], tmp / "kill.jsonl")
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        pids = wait_for_steps(proc, tmp / "kill.jsonl", 2)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(pid) for pid in pids):
            time.sleep(0.2)
        left = [pid for pid in pids if alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        ended = {pid: _reaped(pid) for pid in pids}
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        proc.end()
    assert not left, f"workers {left} outlived their SIGKILLed launcher"
    assert all(status == "SIGKILL" for status in ended.values()), f"the workers ended by {ended}"


def _reaped(pid: int) -> str:
    """How an orphaned worker (this process's child now) ended: the signal's name, or its exit."""
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return f"exit {os.waitstatus_to_exitcode(status)}"


def _signalled(sig: signal.Signals, tmp: Path, *flags: str) -> None:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM; ``flags``
    (--fault-tolerant: the replicas' agents are threads of the launcher, which stops the
    workers itself)."""
    name = f"{sig.name}{'-'.join(flags)}"
    proc = start(["--steps", "100000", *flags], tmp / f"{name}.jsonl")
    pids: list[int] = []
    try:
        pids = wait_for_steps(proc, tmp / f"{name}.jsonl", 2)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        err = finish(proc, 60)
    finally:
        kill_all(proc, pids)
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert headline(err) == f"trainmesh train: stopped by {sig.name}; workers stopped"
    assert not any(alive(pid) for pid in pids), "a worker outlived the launcher"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_workers_end_with_their_launcher(tmp_path):
    _launcher_killed(tmp_path)
    _signalled(signal.SIGINT, tmp_path)
    _signalled(signal.SIGTERM, tmp_path)
    _signalled(signal.SIGTERM, tmp_path, "--fault-tolerant")


# ---------------------------------------------------------------- divergence
def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _diverge_and_stop(tmp: Path) -> None:
    """--lr 1e6: exit 1 naming the step and value; the newest checkpoint is the last finite one."""
    from trainmesh.checkpoint.sharded import _Reader, latest
    ck = tmp / "ck"
    proc = run_to_end(["--steps", "40", "--lr", "1e6", "--save-dir", str(ck), "--save-every", "1"],
                      tmp / "nan.jsonl", "nan")
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    line = headline(err)
    match = re.search(r"step (\d+): non-finite (loss|grad_norm) (nan|inf|-inf)", line)
    assert match, line
    bad = int(match.group(1))
    steps = [r for r in _records(tmp / "nan.jsonl") if r["event"] == "step"]
    assert steps[-1]["step"] == bad and not math.isfinite(steps[-1][match.group(2)])
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps[:-1])
    newest = latest(ck)
    assert newest is not None and newest.name == f"step-{bad - 1:08d}", (newest, bad)
    reader = _Reader(newest)
    for key in reader.manifest["tensors"]:
        assert torch.isfinite(reader.get(key)).all(), f"{newest}: {key} is not finite"


def _fp16_skip_is_bounded(tmp: Path) -> None:
    """fp16 --on-nonfinite skip: skipped steps, then a stop after the bound, exit 1."""
    proc = run_to_end(["--steps", "200", "--lr", "1e4", "--precision", "fp16", "--on-nonfinite", "skip"],
                      tmp / "fp16.jsonl", "fp16")
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    from trainmesh.run.steps import MAX_NONFINITE_SKIPS
    line = headline(err)
    assert re.search(rf"step \d+: non-finite .*--on-nonfinite skip, {MAX_NONFINITE_SKIPS} in a row", line), line
    steps = [r for r in _records(tmp / "fp16.jsonl") if r["event"] == "step"]
    assert len(steps) < 200 and all(r["loss_scale"] >= 1.0 for r in steps)
    assert all("nonfinite" in r for r in steps[-MAX_NONFINITE_SKIPS:])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_divergence_stops_the_run_and_is_never_saved(tmp_path):
    _diverge_and_stop(tmp_path)
    _fp16_skip_is_bounded(tmp_path)


def test_fp16_overflow_at_the_minimum_scale_is_nonfinite():
    prec = Precision(ParallelConfig(precision="fp16"), torch.device("cpu"), init_scale=4.0)
    overflow = torch.tensor(0.0)
    seen = []
    for _ in range(5):
        assert prec.should_skip(overflow, lambda t: t)
        seen.append((prec.metrics()["loss_scale"], prec.nonfinite()))
    assert [s for s, _ in seen] == [4.0, 2.0, 1.0, 1.0, 1.0]
    assert [n is None for _, n in seen] == [True, True, False, False, False]
    assert "minimum loss scale 1" in seen[2][1]


# ---------------------------------------------------------------- a busy --save-dir
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_busy_save_dir_is_refused_and_the_first_run_is_unharmed(tmp_path, capsys):
    """A second run (one process, in this test's process: its launcher is the worker that would
    take the lock) is refused while the first one holds the lock; the first one ends unharmed."""
    from trainmesh.cli import main
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ".lock").write_text("999999999\n")                  # a dead run's lock: taken over
    (ck / ".step-00000003.tmp").mkdir()                        # an interrupted save's leftovers
    (ck / ".step-00000003.tmp" / "rank00000.safetensors").write_text("partial")
    first = start(["--steps", "40", "--save-dir", str(ck), "--save-every", "10"], tmp_path / "a.jsonl")
    try:
        pids = wait_for_steps(first, tmp_path / "a.jsonl", 1)
        stale_left = (ck / ".step-00000003.tmp").exists()
        for pid in pids:              # hold the first run mid-way, however fast this machine is
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        second = main(["train", *T, "--steps", "40", "--save-dir", str(ck)])
        took = time.monotonic() - t0
        said = capsys.readouterr().err
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        err = finish(first, 120)
    finally:
        first.end()
    assert second == 2, said[-2000:]
    assert took < 10, took
    assert said.strip().splitlines() == [
        f"trainmesh train: error: save-dir: {str(ck)!r} is in use by another run (pid {first.pid}); "
        "wait for it to end or choose another directory"], said
    assert first.returncode == 0, err[-3000:]
    assert not stale_left, "an interrupted save's temporary directory was left in place"
    assert sorted(p.name for p in ck.glob("step-*")) == [f"step-{s:08d}" for s in (10, 20, 30, 40)]
    assert [r["step"] for r in _records(tmp_path / "a.jsonl") if r["event"] == "step"] == list(range(1, 41))


def test_save_dir_lock_is_exclusive_and_released(tmp_path):
    from trainmesh.checkpoint.savedir import SaveDirLock
    from trainmesh.core.errors import ConfigError
    ck = tmp_path / "ck"
    with SaveDirLock(ck):
        assert (ck / ".lock").read_text().strip() == str(os.getpid())
        with pytest.raises(ConfigError, match=rf"save-dir: .*ck' is in use by another run \(pid {os.getpid()}\)"):
            SaveDirLock(ck).__enter__()
    with SaveDirLock(ck):      # released on exit: the next run takes it
        pass
