"""Chaos soak of a fault-tolerant run across three simulated hosts (network namespaces,
tests/simhosts.py; root only): `trainmesh coordinator` on host0 and one `trainmesh train
--fault-tolerant --coordinator` replica per host, `--save-every` checkpoints into a shared
directory, while every EVERY steps a fault drawn at random (seeded) strikes:

- kill: a worker of a random replica is SIGKILLed (its agent starts it again; it copies the
  live state);
- partition: a random host's link goes down for 5 to 10 s, then up again;
- coordinator: the coordinator is SIGKILLed and started again on its address after 0 to 2 s;
- stall: a random replica's worker stops beating and sleeps past the heartbeat timeout just
  before its sums across replicas (``TRAINMESH_FT_INJECT``'s ``pause``, given at its start for
  every incarnation).

It passes when every process exits 0; each replica's metrics file holds every step it took
once, in order, equal to the uninterrupted one-process run of the same flags (loss 1e-3
absolute, grad norm 1e-3 relative); every step of the run is in some replica's file; the last
step ran with three replicas; no process outlives the run (none left in the hosts'
namespaces, none anywhere naming the run's directory) and the namespaces are gone; and the last
checkpoint loads: resumed for one more step in one process, that step equals the one-process
run resumed from its own last checkpoint. Prints one line per fault and a summary line; exits 1
on any problem. Not part of the test suite.

    PYTHONPATH=src python benchmarks/soak_hosts.py [--steps 1000] [--every 50] [--seed 0]
        [--reference DIR]   (an earlier soak's files of the same --steps: its one-process run)
"""
from __future__ import annotations

import argparse
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from simhosts import SimHosts, can_make_hosts  # noqa: E402
from tolerances import LOSS_ABS, NORM_REL  # noqa: E402

from trainmesh.testing import (  # noqa: E402
    coordinator_argv,
    metrics_records,
    replica_argv,
    served_address,
    worker_pids,
)

MODEL = ["--layers", "4", "--d-model", "128", "--heads", "4", "--seq-len", "128", "--vocab-size", "256",
         "--global-batch", "48", "--warmup-steps", "5", "--optimizer", "adamw"]
"""Steps slow enough (about 0.2 s on 2 shared CPU cores) that a fault's seconds (a partition's
5 to 10, a process's start) span fewer steps than lie between two faults."""
KINDS = ("kill", "partition", "coordinator", "stall")
MAX_RESTARTS = 40
"""Each replica's agent restarts (more than the kills a run of 1,000 steps can draw)."""
WAIT_S = 1800.0
"""How long the soak waits for the run to reach a step (a loaded machine: generous)."""


def _steps(path: Path) -> list[dict]:
    return [r for r in metrics_records(path) if r.get("event") == "step"]


def _top(path: Path) -> int:
    return max((r["step"] for r in _steps(path)), default=0)


def draw(steps: int, every: int, rng: random.Random) -> list[dict]:
    """The faults: one at each multiple of ``every`` before the last step."""
    out = []
    for at in range(every, steps, every):
        kind = rng.choice(KINDS)
        fault = {"at": at, "kind": kind, "delay": rng.uniform(0.0, 0.5)}
        if kind in ("kill", "stall"):
            fault["replica"] = rng.randrange(3)
        elif kind == "partition":
            fault["host"], fault["seconds"] = rng.randrange(3), rng.uniform(5.0, 10.0)
        else:
            fault["pause"] = rng.uniform(0.0, 2.0)
        out.append(fault)
    return out


def _start(args: list[str], out: Path) -> subprocess.Popen:
    """A one-process run of ``args`` writing ``out``."""
    return subprocess.Popen([sys.executable, "-m", "trainmesh", "train", *args, "--metrics-out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish(run: subprocess.Popen, out: Path) -> list[dict]:
    """The step records of a one-process run started by :func:`_start`."""
    _, err = run.communicate(timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"a one-process run exited {run.returncode}: {err[-800:]}")
    return _steps(out)


def _one_process(args: list[str], out: Path) -> list[dict]:
    return _finish(_start(args, out), out)


class Soak:
    def __init__(self, root: Path, steps: int, every: int, seed: int) -> None:
        self.root, self.steps = root, steps
        self.faults = draw(steps, every, random.Random(seed))
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TRAINMESH_FT_INJECT")}
        self.env.update(OMP_NUM_THREADS="1", TRAINMESH_FT_SECRET=secrets.token_hex(32))
        self.files = [root / f"h{i}.jsonl" for i in range(3)]
        self.ckpt = root / "ck"
        self.train = [*MODEL, "--steps", str(steps), "--timeout", "60", "--max-restarts",
                      str(MAX_RESTARTS), "--save-dir", str(self.ckpt), "--save-every", "100"]
        self.events: list[str] = []
        self.problems: list[str] = []
        self.ours: set[int] = {os.getpid()}
        """Processes of the soak itself (the one-process reference run meanwhile)."""

    def _inject(self, i: int) -> str:
        """Replica ``i``'s stalls, for each incarnation its agent may start; replica 0 holds the
        quorum of step STEPS - 5 until every replica asked into it (all back for the end)."""
        at = [f"{f['at']}:pause" for f in self.faults if f["kind"] == "stall" and f["replica"] == i]
        at += [f"{self.steps - 5}:hold"] if i == 0 and self.steps > 5 else []
        return ",".join(f"{i}.{n}@{a}" for a in at for n in range(MAX_RESTARTS + 1))

    def _wait(self, what: str, condition, procs: dict) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not reach {what} in {WAIT_S:.0f} s")
            if all(p.poll() is not None for p in procs.values()):
                raise RuntimeError(f"every replica exited before {what}: "
                                   f"{[p.returncode for p in procs.values()]}")
            time.sleep(0.1)

    def run(self) -> None:
        log = open(self.root / "stderr.log", "w")   # noqa: SIM115 - closed below
        hosts_made = SimHosts(3)
        with hosts_made as hosts, log:
            def coordinator_at(bind: str) -> subprocess.Popen:
                return hosts[0].popen(coordinator_argv(bind, 3), stdout=subprocess.PIPE,
                                      stderr=log, text=True, env=self.env)
            coordinator = coordinator_at(f"{hosts[0].addr}:0")
            address = served_address(coordinator)
            procs = {i: hosts[i].popen(replica_argv(self.train, address, i, 3, self.files[i]),
                                       env={**self.env, "TRAINMESH_FT_INJECT": self._inject(i)},
                                       stdout=subprocess.DEVNULL, stderr=log)
                     for i in range(3)}
            for n, f in enumerate(self.faults):
                self._wait(f"step {f['at']}", lambda f=f: max(map(_top, self.files)) >= f["at"], procs)
                time.sleep(f["delay"])   # anywhere inside a step
                top = max(map(_top, self.files))
                event = self._strike(f, hosts, procs, coordinator, coordinator_at, address)
                event += f" (the run at step {top})" if top > f["at"] else ""
                if top >= self.steps:
                    self.problems.append(f"the run had ended before the fault of step {f['at']}")
                if f["kind"] == "coordinator":
                    coordinator = self.restarted
                if n:
                    print(f"    {self._back(self.faults[n - 1], f['at'], struck)}", flush=True)
                struck = time.monotonic()
                print(f"  step {f['at']}: {event}", flush=True)
            if self.faults:
                self._wait("the last step", lambda: max(map(_top, self.files)) >= self.steps, procs)
                print(f"    {self._back(self.faults[-1], self.steps, struck)}", flush=True)
            codes = {f"replica {i}": p.wait(timeout=WAIT_S) for i, p in procs.items()}
            codes["coordinator"] = coordinator.wait(timeout=300)
            self.problems += [f"{who} exited {code}" for who, code in codes.items() if code != 0]
            self._check_processes(hosts)
        tag = hosts_made.tag
        left = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True
                                          ).stdout.split() if tag in n]
        left += [str(p) for p in Path("/etc/netns").glob(f"*{tag}*")]
        if left:
            self.problems.append(f"namespaces left after the run: {left}")

    def _back(self, f: dict, until: int, struck: float) -> str:
        """When the run had three replicas again after fault ``f`` (struck at ``struck``)
        before step ``until`` (the next fault's; after the last fault, to the last step)."""
        rows = sorted((r["step"], r["replicas"]) for p in self.files for r in _steps(p)
                      if f["at"] < r["step"] < until or r["step"] == until == self.steps)
        out = next((s for s, n in rows if n < 3), None)
        back = next((s for s, n in rows if out is not None and s > out and n == 3), None)
        took = f"{time.monotonic() - struck:.1f} s to the next fault"
        if out is None:
            return f"(never fewer than three replicas; {took})"
        return (f"(fewer than three replicas from step {out}, "
                + (f"three again from step {back}; " if back else "not three again; ") + took + ")")

    def _strike(self, f: dict, hosts, procs: dict, coordinator, coordinator_at, address: str) -> str:
        kind = f["kind"]
        if kind == "kill":
            i = f["replica"]
            deadline = time.monotonic() + 60
            while not (pids := worker_pids(procs[i].pid)) and time.monotonic() < deadline:
                time.sleep(0.1)   # (its worker being started again)
            if not pids:
                return f"kill: replica {i} had no worker to kill"
            os.kill(pids[0], signal.SIGKILL)
            return f"kill: replica {i}'s worker {pids[0]} SIGKILLed"
        if kind == "partition":
            h = hosts[f["host"]]
            h.link_down()
            time.sleep(f["seconds"])
            h.link_up()
            return f"partition: host{f['host']} cut off for {f['seconds']:.1f} s"
        if kind == "coordinator":
            coordinator.kill()
            coordinator.wait()
            time.sleep(f["pause"])
            self.restarted = coordinator_at(address)
            if served_address(self.restarted) != address:
                self.problems.append("the coordinator started again serves another address")
            return f"coordinator: SIGKILLed, started again after {f['pause']:.1f} s"
        return f"stall: replica {f['replica']} stalls past the heartbeat timeout at step {f['at']}"

    def _check_processes(self, hosts) -> None:
        """Nothing of the run left, in the hosts' namespaces or anywhere on this machine."""
        deadline = time.monotonic() + 30
        while (left := [p for h in hosts for p in h.pids()]) and time.monotonic() < deadline:
            time.sleep(0.5)
        mine = str(self.root).encode()
        for pid in Path("/proc").iterdir():
            if pid.name.isdigit() and int(pid.name) not in self.ours:
                try:
                    if mine in (pid / "cmdline").read_bytes():
                        left.append(int(pid.name))
                except OSError:
                    pass
        for pid in sorted(set(left)):
            try:
                cmd = (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:160].decode())
            except OSError:
                continue
            self.problems.append(f"process {pid} outlived the run: {cmd}")

    def check(self, ref: dict[int, dict]) -> None:
        seen: set[int] = set()
        for i, path in enumerate(self.files):
            rows = _steps(path)
            taken = [r["step"] for r in rows]
            seen |= set(taken)
            if taken != sorted(set(taken)):
                self.problems.append(f"replica {i}: a step twice or out of order")
            for r in rows:
                w = ref[r["step"]]
                if abs(r["loss"] - w["loss"]) > LOSS_ABS or \
                        abs(r["grad_norm"] - w["grad_norm"]) > NORM_REL * w["grad_norm"]:
                    self.problems.append(f"replica {i}: step {r['step']} differs from one process "
                                         f"(loss {r['loss']} vs {w['loss']})")
        missing = sorted(set(range(1, self.steps + 1)) - seen)
        if missing:
            self.problems.append(f"steps in no replica's file: {missing[:20]}")
        last = [_steps(p)[-1]["replicas"] if _steps(p) else 0 for p in self.files]
        if max(last) != 3:
            self.problems.append(f"the last steps ran with {last} replicas")

    def check_checkpoint(self, ref_ckpt: Path) -> str:
        """Each last checkpoint resumed for one more step in one process: equal."""
        rows = []
        for name, ckpt in (("soak", self.ckpt), ("ref", ref_ckpt)):
            copy = self.root / f"resume-{name}"
            shutil.copytree(ckpt, copy)
            rows.append(_one_process([*MODEL, "--steps", str(self.steps + 1), "--save-dir",
                                      str(copy), "--resume"], self.root / f"resume-{name}.jsonl"))
        (soak,), (ref,) = rows
        if soak["step"] != self.steps + 1 or ref["step"] != self.steps + 1:
            self.problems.append(f"resumed at steps {soak['step']}, {ref['step']}, not {self.steps + 1}")
        dl, dn = abs(soak["loss"] - ref["loss"]), abs(soak["grad_norm"] - ref["grad_norm"])
        if dl > LOSS_ABS or dn > NORM_REL * ref["grad_norm"]:
            self.problems.append(f"resumed from the last checkpoint, step {soak['step']} differs: "
                                 f"loss {soak['loss']} vs {ref['loss']}")
        return f"resumed step {soak['step']}: loss off by {dl:.1e}, grad norm by {dn:.1e}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=50, help="steps between faults (default 50)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", type=Path, help="the files directory of an earlier soak of "
                        "the same --steps: its one-process run (ref.jsonl, ref-ck) is used, not run again")
    args = parser.parse_args()
    why = can_make_hosts()
    if why:
        print(f"soak_hosts: {why}")
        return 2
    began = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="soak-hosts-"))
    soak = Soak(root, args.steps, args.every, args.seed)
    ref_ckpt, ref_out = root / "ref-ck", root / "ref.jsonl"
    if args.reference:
        shutil.copytree(args.reference / "ref-ck", ref_ckpt)
        shutil.copy(args.reference / "ref.jsonl", ref_out)
        reference = subprocess.Popen(["true"])
    else:
        reference = _start([*MODEL, "--steps", str(args.steps), "--save-dir", str(ref_ckpt)], ref_out)
    soak.ours.add(reference.pid)   # (it runs meanwhile)
    print(f"{len(soak.faults)} faults (seed {args.seed}):", flush=True)
    resumed = ""
    try:
        soak.run()
        ref = {r["step"]: r for r in _finish(reference, ref_out)}
        soak.check(ref)
        resumed = soak.check_checkpoint(ref_ckpt)
    except (TimeoutError, subprocess.TimeoutExpired, RuntimeError) as exc:
        soak.problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        if reference.poll() is None:
            reference.kill()
    kinds = {k: sum(f["kind"] == k for f in soak.faults) for k in KINDS}
    taken = [len(_steps(p)) for p in soak.files]
    print("".join(f"  problem: {p}\n" for p in soak.problems)
          + f"soak_hosts: {'FAIL' if soak.problems else 'PASS'}: {args.steps} steps on 3 hosts, "
          f"{len(soak.faults)} faults ({', '.join(f'{n} {k}' for k, n in kinds.items())}), "
          f"steps taken per replica {taken}, {resumed or 'checkpoint not checked'}; "
          f"{len(soak.problems)} problems in {time.monotonic() - began:.0f} s (files under {root})")
    return 1 if soak.problems else 0


if __name__ == "__main__":
    sys.exit(main())
