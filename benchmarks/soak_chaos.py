"""Chaos soak of a fault-tolerant run across processes: N trials, each a coordinator and three
replicas on loopback (as across hosts: `trainmesh coordinator` and three `trainmesh train
--fault-tolerant --coordinator`), while the coordinator is SIGKILLed at random moments and
started again on the same address after a random pause, replica 1 or 2's process tree is
SIGKILLed and started again (replica 0 holds the step 10 after the kill until it asked back in),
and a thread writes garbage into the coordinator's store.

A trial passes when every process exits 0, each replica's metrics file holds every step it took
once, in order, equal to the uninterrupted one-process run (loss 1e-3 absolute, grad norm 1e-3
relative), the replicas never killed took every step but those they copied (a step is copied by
a replica that did not read its commit before the coordinator died: its file then says the
coordinator was restarted at the next step), and the last step was taken with three replicas.
Prints one line per trial (the chaos it saw, the problems) and a summary; exits 1 when any
trial failed. Not part of the test suite.

    PYTHONPATH=src python benchmarks/soak_chaos.py --trials 5 [--steps 80] [--seed 0] [--chaos crc]
"""
from __future__ import annotations

import argparse
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tolerances import LOSS_ABS, NORM_REL  # noqa: E402

from trainmesh.testing import (  # noqa: E402
    coordinator_argv,
    metrics_records,
    replica_argv,
    served_address,
)

MODEL = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "16", "--vocab-size", "64",
         "--global-batch", "8", "--warmup-steps", "5", "--optimizer", "adamw"]


def _steps(path: Path) -> list[dict]:
    return [r for r in metrics_records(path) if r.get("event") == "step"]


def _top(path: Path) -> int:
    return max((r["step"] for r in _steps(path)), default=0)


class Trial:
    """One run under chaos (``rng`` picks when and what)."""

    def __init__(self, root: Path, steps: int, rng: random.Random, *, hostile: bool = True,
                 chaos: str = "crc") -> None:
        self.root, self.steps, self.rng = root, steps, rng
        self.hostile, self.chaos = hostile, chaos
        """``chaos``: what is killed, in order (c: the coordinator, r: a replica)."""
        self.env = {**os.environ, "OMP_NUM_THREADS": "1",
                    "TRAINMESH_FT_SECRET": secrets.token_hex(32)}
        self.files = [root / f"r{i}.jsonl" for i in range(3)]
        root.mkdir(parents=True, exist_ok=True)
        self.log = open(root / "stderr.log", "w")   # noqa: SIM115 - closed in run()
        self.events: list[str] = []
        self.notes: list[str] = []
        self.killed: set[int] = set()

    def _coordinator(self, bind: str) -> subprocess.Popen:
        return subprocess.Popen(coordinator_argv(bind, 3), stdout=subprocess.PIPE, stderr=self.log,
                                text=True, env=self.env, start_new_session=True)

    def _replica(self, i: int, inject: str = "") -> subprocess.Popen:
        env = {**self.env, **({"TRAINMESH_FT_INJECT": inject} if inject else {})}
        return subprocess.Popen(replica_argv([*MODEL, "--steps", str(self.steps), "--timeout", "60"],
                                             self.address, i, 3, self.files[i]),
                                stdout=subprocess.DEVNULL, stderr=self.log, env=env,
                                start_new_session=True)

    def _hostile(self, stop: threading.Event) -> None:
        """Garbage into live keys, a few writes a second, across coordinator restarts."""
        from trainmesh.core.stores import client_store
        from trainmesh.fault_tolerance.replica import _listening
        store = None
        while not stop.wait(0.05):
            try:
                if store is None and not _listening(self.address):   # (a failed connect logs pages)
                    continue
                store = store or client_store(self.address, timeout_s=2)
                k = self.rng.choice(["done", "next", "commit/0", "dec/1", "req/1/0", "hb/1", "epoch"])
                store.set(k, os.urandom(self.rng.randrange(1, 64)))
            except (RuntimeError, OSError):
                store = None

    def run(self) -> list[str]:
        plan = sorted(self.rng.sample(range(4, self.steps // 2), len(self.chaos)))
        victim = self.rng.randrange(1, 3)
        # the replica killed rejoins by a step 10 after its kill, whatever the machine's load
        # (a fresh process tree may take longer to start than the rest of the run): replica 0
        # holds that step until every replica asked into it
        hold = [f"0@{at + 10}:hold" for at, what in zip(plan, self.chaos) if what == "r"]
        coordinator = self._coordinator("127.0.0.1:0")
        self.address = served_address(coordinator)
        procs = {i: self._replica(i, ",".join(hold) if i == 0 else "") for i in range(3)}
        stop = threading.Event()
        if self.hostile:
            threading.Thread(target=self._hostile, args=(stop,), daemon=True).start()
        try:
            for n, at in enumerate(plan):
                self._wait(lambda at=at: max(_top(f) for f in self.files) >= at, procs, at)
                time.sleep(self.rng.uniform(0.0, 0.5))   # anywhere inside a step
                if self.chaos[n] == "r":
                    os.killpg(procs[victim].pid, signal.SIGKILL)
                    procs[victim].wait()
                    self.killed.add(victim)
                    self.events.append(f"replica {victim} killed at ~{at}")
                    procs[victim] = self._replica(victim)
                    continue
                coordinator.kill()
                coordinator.wait()
                pause = self.rng.uniform(0.0, 2.0)
                self.events.append(f"coordinator killed at ~{at}, back after {pause:.1f} s")
                time.sleep(pause)
                coordinator = self._coordinator(self.address)
                served_address(coordinator)
            codes = {i: p.wait(timeout=900) for i, p in procs.items()}
            codes["coordinator"] = coordinator.wait(timeout=120)
        finally:
            stop.set()
            for p in (*procs.values(), coordinator):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            self.log.close()
        return [f"{who} exited {code}" for who, code in codes.items() if code != 0]

    def _wait(self, condition, procs: dict[int, subprocess.Popen], at: int,
              timeout: float = 900.0) -> None:
        """Until ``condition``; RuntimeError naming the exit codes if every replica has exited
        first (the run ended before step ``at``), TimeoutError if nothing moves for ``timeout``."""
        deadline = time.monotonic() + timeout
        while not condition():
            codes = {i: p.poll() for i, p in procs.items()}
            if all(c is not None for c in codes.values()) and not condition():
                raise RuntimeError(f"every replica exited before step {at} (exit codes {codes}; "
                                   f"their stderr: {self.root / 'stderr.log'})")
            if time.monotonic() > deadline:
                raise TimeoutError("the run stopped making progress")
            time.sleep(0.05)


def problems(trial: Trial, ref: dict[int, dict]) -> list[str]:
    """What is wrong with the replicas' files (beyond the exit codes)."""
    out = []
    for i, path in enumerate(trial.files):
        records = metrics_records(path)
        taken = [r["step"] for r in _steps(path)]
        if taken != sorted(set(taken)):
            out.append(f"replica {i}: a step twice or out of order")
        for r in _steps(path):
            w = ref[r["step"]]
            if abs(r["loss"] - w["loss"]) > LOSS_ABS or \
                    abs(r["grad_norm"] - w["grad_norm"]) > NORM_REL * w["grad_norm"]:
                out.append(f"replica {i}: step {r['step']} differs from one process")
        if i in trial.killed:
            continue
        restarts = {r["step"] for r in records if r.get("event") == "coordinator"}
        quorums = [r for r in records if r.get("event") == "quorum"]
        for s in sorted(set(range(1, trial.steps + 1)) - set(taken)):
            if s + 1 in restarts:   # it had not read step s's commit when the coordinator died:
                trial.notes.append(f"replica {i} copied step {s} (its commit unread when the "
                                   "coordinator died; no record of it in its file)")
            else:
                around = [q for q in quorums if abs(q["step"] - s) <= 1]
                out.append(f"replica {i} (never killed): no record of step {s}"
                           + (" (the coordinator was restarted at it)" if s in restarts else "")
                           + (f"; quorum lines near it: {around}" if around else ""))
    last = [_steps(p)[-1]["replicas"] if _steps(p) else 0 for p in trial.files]
    if max(last) != 3:
        out.append(f"the last steps ran with {last} replicas")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chaos", default="crc",
                        help="what is killed, in order: c the coordinator, r a replica (default crc)")
    parser.add_argument("--no-hostile", action="store_true", help="no garbage writes")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="soak-chaos-"))
    ref_out = root / "ref.jsonl"
    code = subprocess.run([sys.executable, "-m", "trainmesh", "train", *MODEL, "--steps",
                           str(args.steps), "--metrics-out", str(ref_out)],
                          capture_output=True, text=True, timeout=900).returncode
    if code != 0:
        print(f"the reference run failed ({code})")
        return 1
    ref = {r["step"]: r for r in _steps(ref_out)}
    failed = 0
    for n in range(args.trials):
        trial = Trial(root / f"trial{n}", args.steps, random.Random(args.seed * 1000 + n),
                      hostile=not args.no_hostile, chaos=args.chaos)
        began = time.monotonic()
        try:
            found = trial.run() + problems(trial, ref)
        except (TimeoutError, subprocess.TimeoutExpired, RuntimeError) as exc:
            found = [f"{type(exc).__name__}: {exc}"]
        failed += bool(found)
        print(f"trial {n}: {'FAIL' if found else 'ok'} in {time.monotonic() - began:.0f} s; "
              f"{'; '.join(trial.events)}" + "".join(f"\n  {p}" for p in found)
              + "".join(f"\n  note: {p}" for p in trial.notes), flush=True)
    print(f"{args.trials - failed} of {args.trials} trials passed (files under {root})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
