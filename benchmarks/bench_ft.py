"""Time lost per failure: ``--fault-tolerant`` against restart-from-checkpoint, same run.

Four runs of ``trainmesh train`` (the SMALL test GPT, dp 3, CPU): each mode once without a
failure and once with one worker SIGKILLed from outside as soon as step ``--kill-at`` appears
in its metrics file. The time lost to the failure is the *stall*: seconds from the kill to the
first record of the next step (against ``step s``, the clean run's median step time); wall
times of both runs are printed too, but on a shared machine they carry more noise than the
difference. The losses of the faulted runs are checked against the clean ones.

- restart: ``--max-restarts 1 --save-dir D --save-every 1`` (each failure restarts every
  worker, which resumes from the newest checkpoint, saved after every step);
- fault-tolerant: ``--fault-tolerant`` (the survivors redo the failed step without the lost
  replica, which its agent restarts and which rejoins from a peer's live state);
- fault-tolerant-2rank: ``--fault-tolerant --dp 4 --dp-shard 2 --zero 2`` (two replicas of two
  ranks each, an HSDP shard group: the killed rank takes its replica down, its agent restarts
  both ranks, which rejoin with their shards copied from the same ranks of the other replica);
- coordinator-restart: a run across processes as across hosts (``trainmesh coordinator`` and
  three ``trainmesh train --fault-tolerant --coordinator``, on loopback): the coordinator is
  SIGKILLed as soon as step ``--kill-at`` appears and started again at once on the same
  address. Its stall is counted from the moment the new coordinator serves (its own start-up,
  an interpreter importing torch, is not the replicas'), to the next step's record; the time
  from the kill is printed beside it.

Run from the repository root:

    python benchmarks/bench_ft.py --steps 60 --kill-at 20 --trials 2
    python benchmarks/bench_ft.py --modes fault-tolerant-2rank   # one mode only
    python benchmarks/bench_ft.py --modes coordinator-restart --trials 3
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainmesh.testing import (
    coordinator_argv,
    metrics_records,
    replica_argv,
    served_address,
    worker_pids,
)

MODEL = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "16",
         "--vocab-size", "64", "--global-batch", "12", "--warmup-steps", "5"]
MODES = ("restart", "fault-tolerant", "fault-tolerant-2rank", "coordinator-restart")




def steps_logged(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass    # a line being written
    return rows


def run(args: list[str], out: Path, kill_at: int | None) -> tuple[float, list[dict], float]:
    """(wall seconds, metrics records, stall) of one ``trainmesh train`` run; stall: seconds
    from the kill to the first record of step ``kill_at + 1`` (0 without a kill)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "trainmesh", "train", *args,
                             "--metrics-out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed_at = None
    stall = 0.0
    while proc.poll() is None:
        logged = {r.get("step") for r in steps_logged(out) if r.get("event") == "step"}
        if kill_at is not None and killed_at is None and kill_at in logged:
            victims = worker_pids(proc.pid)
            if victims:
                os.kill(victims[-1], signal.SIGKILL)
                killed_at = time.perf_counter()
        if killed_at is not None and not stall and kill_at + 1 in logged:
            stall = time.perf_counter() - killed_at
        time.sleep(0.02)
    wall = time.perf_counter() - began
    if proc.returncode:
        sys.exit(f"run failed ({proc.returncode}): {' '.join(args)}\n{proc.stderr.read()[-2000:]}")
    return wall, steps_logged(out), stall


def run_across(args: list[str], out: Path, kill_at: int | None) -> tuple[float, list[dict], float, float]:
    """(wall seconds, replica 0's records, stall from the new coordinator serving, seconds from
    the kill) of a run across processes (coordinator + 3 replicas on loopback)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
           "TRAINMESH_FT_SECRET": secrets.token_hex(32)}   # the job's, for all four processes
    began = time.perf_counter()
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.DEVNULL, "text": True, "env": env}
    coordinator = subprocess.Popen(coordinator_argv("127.0.0.1:0", 3), **pipe)
    address = served_address(coordinator)
    files = [out.with_suffix(f".r{i}.jsonl") for i in range(3)]
    logs = [open(out.with_suffix(f".r{i}.log"), "w") for i in range(3)]   # noqa: SIM115
    replicas = [subprocess.Popen(replica_argv(args, address, i, 3, files[i]), env=env,
                                 stdout=subprocess.DEVNULL, stderr=logs[i], text=True)
                for i in range(3)]
    stall = since_kill = 0.0
    try:
        seen = lambda: {r["step"] for r in metrics_records(files[0]) if r.get("event") == "step"}  # noqa: E731
        while kill_at is not None and kill_at not in seen():
            time.sleep(0.01)
        if kill_at is not None:
            coordinator.kill()
            killed = time.perf_counter()
            coordinator.wait()
            top = max(seen())
            coordinator = subprocess.Popen(coordinator_argv(address, 3), **pipe)
            served_address(coordinator)
            serving = time.perf_counter()
            while max(seen()) <= top:
                time.sleep(0.01)
            stall, since_kill = time.perf_counter() - serving, time.perf_counter() - killed
        for i, p in enumerate(replicas):
            p.wait()
            if p.returncode:
                sys.exit(f"replica failed ({p.returncode}): "
                         f"{out.with_suffix(f'.r{i}.log').read_text()[-2000:]}")
        coordinator.wait()
    finally:
        for p in [coordinator, *replicas]:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
    return time.perf_counter() - began, metrics_records(files[0]), stall, since_kill


def final_steps(records: list[dict]) -> dict[int, float]:
    """step -> loss, the newest record of each step (a restarted run logs some twice)."""
    return {r["step"]: r["loss"] for r in records if r.get("event") == "step"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=20)
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    a = ap.parse_args()
    chosen = [m for m in a.modes.split(",") if m]
    if not chosen or any(m not in MODES for m in chosen):
        ap.error(f"--modes: a comma-separated list of {', '.join(MODES)}; got {a.modes!r}")
    base = [*MODEL, "--steps", str(a.steps)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        flags_of = {"restart": lambda d: [*base, "--dp", "3", "--max-restarts", "1",
                                          "--save-dir", str(t / d), "--save-every", "1"],
                    "fault-tolerant": lambda d: [*base, "--dp", "3", "--fault-tolerant"],
                    "fault-tolerant-2rank": lambda d: [*base, "--dp", "4", "--dp-shard", "2",
                                                       "--zero", "2", "--fault-tolerant"],
                    "coordinator-restart": lambda d: base}
        modes = {m: flags_of[m] for m in chosen}
        for trial in range(a.trials):
            for mode, flags in modes.items():   # alternated: machine noise hits both alike
                name = f"{mode}-{trial}"
                extra = ""
                if mode == "coordinator-restart":
                    clean, clean_rec, _, _ = run_across(flags(""), t / f"{name}-clean.jsonl", None)
                    hit, hit_rec, stall, since_kill = run_across(flags(""), t / f"{name}-hit.jsonl",
                                                                 a.kill_at)
                    extra = f"{since_kill:.2f} s from the kill"
                else:
                    clean, clean_rec, _ = run(flags(f"{name}-clean"), t / f"{name}-clean.jsonl", None)
                    hit, hit_rec, stall = run(flags(f"{name}-hit"), t / f"{name}-hit.jsonl", a.kill_at)
                step_s = statistics.median(r["step_time_s"] for r in clean_rec
                                           if r.get("event") == "step")
                ref, got = final_steps(clean_rec), final_steps(hit_rec)
                worst = max(abs(got[k] - ref[k]) for k in ref)
                summary = next((r for r in hit_rec if r.get("event") == "summary"), {})
                if "recovery_s" in summary.get("fault_tolerance", {}):
                    ft = summary["fault_tolerance"]
                    extra = (f"recovery {ft['recovery_s']:.2f} s, {ft['degraded_steps']} degraded "
                             f"steps, state transfer {ft['state_transfer_s']:.3f} s")
                rows.append((mode, clean, hit, stall, step_s, worst, extra))
    print(f"{'mode':<21} {'clean s':>8} {'faulted s':>10} {'stall s':>8} {'step s':>7} "
          f"{'max |dloss|':>12}  notes")
    for mode, clean, hit, stall, step_s, worst, extra in rows:
        print(f"{mode:<21} {clean:8.1f} {hit:10.1f} {stall:8.2f} {step_s:7.3f} {worst:12.2e}  {extra}")
    for mode in chosen:
        stalls = [row[3] for row in rows if row[0] == mode]
        print(f"{mode}: median stall {statistics.median(stalls):.2f} s over {len(stalls)} trial(s)")


if __name__ == "__main__":
    main()
