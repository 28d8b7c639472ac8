"""One elastic-resize trial: two torchrun agents ("nodes" of 2 ranks each) share a c10d
rendezvous and train a dp 4 job with --min-dp 2; the second agent is killed (its whole process
tree, like a lost machine) once step ``kill_after`` is recorded at world 4, and joins again
once the job has recorded a few steps at world 2. While it joins, the dp 2 workers are held
(SIGSTOP) until their agent tells them to stop for the new rendezvous (a pending SIGTERM), so
the shrunk job cannot finish before the node is back however slow the rejoin is, and the run
needs no more steps than it checks. Used by tests/test_elastic.py and benchmarks/soak_elastic.py.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from helpers import one_process
from launcher_zygote import Child, zygote

from trainmesh.testing import worker_pids

ARGS = one_process("adamw")
"""The run: the small GPT, global batch 8 (dp 4 x 1 microbatch of 2, or dp 2 x 2), the
one-process reference's arguments (tests/conftest.py ``reference_run`` runs it once a session)."""
STEPS = 20
"""The steps of :data:`ARGS`: step ``KILL_AFTER`` at dp 4, a few at dp 2 (held there while the
node joins), the rest at dp 4 again."""
KILL_AFTER = 5
"""The step recorded at world 4 after which the second agent is killed."""
HELD_AT_MOST_S = 90
"""How long the dp 2 workers are held waiting for their agent to stop them for the rejoined
node (a few seconds); past it the trial ends with an error (the node was never let in)."""
RDZV_CONF = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"
"""A lone agent waits 3 s for more nodes before starting without them; a node that stops
heart-beating (every 1 s) is dropped after 3 missed beats; a node that never comes ends the
wait after 120 s."""


AT_WORLD_2 = 3
"""Steps the shrunk job records before the lost node is told to join again."""
AGENT = f"""
import multiprocessing, pathlib, sys, time
from multiprocessing import forkserver
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import torch.distributed.run as torchrun
from torch.distributed.launcher.api import elastic_launch
import elastic_run
from trainmesh.run.launch import WORKER_IMAGE
multiprocessing.set_forkserver_preload([WORKER_IMAGE, "elastic_run"])
forkserver.ensure_running()
go = pathlib.Path(sys.argv[1])
pathlib.Path(sys.argv[1] + ".ready").touch()
while not go.exists():
    time.sleep(0.02)
config, _, argv = torchrun.config_from_args(torchrun.parse_args(sys.argv[2:]))
config.start_method = "forkserver"
elastic_launch(config, elastic_run.worker)(*argv)
"""
"""A "node": torchrun's elastic agent, configured from torchrun's flags by torchrun itself, whose
workers are forked from a server that imported trainmesh once (as ``trainmesh train``'s own
launcher does) instead of each starting an interpreter: the same agent, rendezvous, restarts
and worker environment, without a fresh import of torch per worker and restart. Imported
ahead (then the file argv[1] + ".ready" exists), it joins the job once the file argv[1]
exists (a machine that boots while the job shrinks, and joins when the trial says)."""


def agent(argv: list[str]) -> int:
    """:data:`AGENT` in a process forked from the test zygote (``argv``: the go file, then
    torchrun's flags), its workers forked from a server of its own that the zygote's child forked
    after importing this module; 0 once the job ended (a failed one raises)."""
    import torch.distributed.run as torchrun
    from torch.distributed.launcher.api import elastic_launch
    go = Path(argv[0])
    Path(f"{go}.ready").touch()
    while not go.exists():
        time.sleep(0.02)
    config, _, args = torchrun.config_from_args(torchrun.parse_args(argv[1:]))
    config.start_method = "forkserver"
    elastic_launch(config, worker)(*args)
    return 0


def start_agent(torchrun: list[str], go: Path, name: Path, env: dict[str, str]) -> subprocess.Popen | Child:
    """An agent started with torchrun's flags ``torchrun`` that joins once the file ``go``
    exists, forked from the test zygote (:func:`agent`) or, where it is off, a fresh interpreter
    (:data:`AGENT`); its output in ``name``.out and ``name``.err."""
    out, err = name.with_suffix(".out"), name.with_suffix(".err")
    child = zygote().start([str(go), *torchrun], env, name.parent, out, err,
                           own_fork_server=True, call="elastic_run:agent")
    return child or subprocess.Popen([sys.executable, "-c", AGENT, str(go), *torchrun], env=env,
                                     text=True, stdout=out.open("w"), stderr=err.open("w"))


def worker(*argv: str) -> None:
    """A worker: ``python -u -m trainmesh ARGV`` as torchrun would exec it, run in the forked
    process (its environment already the agent's: RANK, WORLD_SIZE, the restart count ...)."""
    from trainmesh.cli import main
    code = main(list(argv[argv.index("trainmesh") + 1:]))
    if code:
        raise SystemExit(code)


@dataclass
class Trial:
    """What one trial saw: exit codes, every metrics record, each transition's duration."""

    codes: list[int | None]
    records: list[dict]
    errors: str
    seconds: dict[str, float] = field(default_factory=dict)
    """start (to step kill_after at world 4), shrink (kill to the first world-2 step), grow
    (agent started again to the first world-4 step after), total."""
    steps_at: dict[int, int] = field(default_factory=dict)
    """{world size: steps whose newest record ran at it}."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _tree(pid: int) -> list[int]:
    """``pid`` and every descendant (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL an agent and all its workers at once (workers run in sessions of their own)."""
    for pid in _tree(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _pending(pid: int) -> int:
    """The signals pending on process ``pid`` (a mask, bit ``n - 1`` for signal ``n``); -1 once
    it is gone (Linux /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return -1
    if "zombie" in status:
        return -1
    masks = [int(line.split()[1], 16) for line in status.splitlines()
             if line.startswith(("SigPnd:", "ShdPnd:"))]
    return masks[0] | masks[1]


def _told_to_stop(pids: list[int]) -> bool:
    """Some held process has a SIGTERM waiting (its agent is stopping it) or has ended."""
    return any(m == -1 or m & (1 << (signal.SIGTERM - 1)) for m in map(_pending, pids))


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]   # the last may be partial


def last_per_step(records: list[dict]) -> dict[int, dict]:
    """{step: its newest record}: steps recomputed after a restart appear again."""
    return {r["step"]: r for r in records if r["event"] == "step"}


class _Watch:
    """Polls the metrics file; remembers when each (step, world) record first appeared."""

    def __init__(self, path: Path, agents: list[subprocess.Popen], deadline: float) -> None:
        self.path, self.agents, self.deadline = path, agents, deadline
        self.seen: dict[tuple[int, int], float] = {}

    def poll(self) -> None:
        for r in read_records(self.path):
            if r["event"] == "step":
                self.seen.setdefault((r["step"], r["world_size"]), time.time())

    def last_step(self, world: int) -> int:
        return max((s for s, w in self.seen if w == world), default=0)

    def count(self, world: int) -> int:
        """Steps recorded at ``world`` so far."""
        return sum(1 for _, w in self.seen if w == world)

    def wait(self, what: str, until) -> float:
        """Seconds until ``until()`` holds; raises on the deadline or when every agent ended."""
        t0 = time.time()
        while True:
            self.poll()
            if until():
                return time.time() - t0
            if time.time() > self.deadline:
                raise TimeoutError(f"trial: no {what} before the deadline")
            if all(a.poll() is not None for a in self.agents):
                raise RuntimeError(f"trial: every agent ended while waiting for {what}")
            time.sleep(0.05)


def run_trial(tmp: Path, *, kill_after: int = KILL_AFTER, deadline_s: float = 240) -> Trial:
    """Start, shrink, grow; every process is killed on the way out, whatever happens."""
    port, job = _free_port(), uuid.uuid4().hex[:8]
    metrics = tmp / "elastic.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = ["--nnodes", "1:2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job,
           "--rdzv-conf", RDZV_CONF, "--max-restarts", "3", "--local-addr", "127.0.0.1",
           "-m", "trainmesh", "train", *ARGS, "--dp", "4", "--min-dp", "2", "--timeout", "30",
           "--save-dir", str(tmp / "ck"), "--save-every", "1", "--metrics-out", str(metrics)]

    def start(i: int, go: Path) -> subprocess.Popen | Child:
        return start_agent(cmd, go, tmp / f"agent{i}-{go.name}", env)

    go, rejoin = [tmp / "go0", tmp / "go1"], tmp / "rejoin"
    agents = [start(0, go[0]), start(1, go[1])]
    watch, seconds, t0 = _Watch(metrics, agents, time.time() + deadline_s), {}, time.time()
    try:
        # Both imported before either joins: the second then joins within the first's last
        # call, and the job starts at world 4 (not at 2, restarted at 4 once it joins).
        watch.wait("agents started", lambda: all(Path(f"{g}.ready").exists() for g in go))
        go[0].touch()   # the first agent hosts the rendezvous store: it is the one that stays
        watch.wait("rendezvous store", lambda: _listening(port))
        go[1].touch()
        seconds["start"] = watch.wait(f"step {kill_after} at world 4",
                                      lambda: watch.last_step(4) >= kill_after)
        kill_tree(agents[1])
        agents[1] = start(1, rejoin)   # booted while the job shrinks; joins once told
        seconds["shrink"] = watch.wait("a step at world 2", lambda: watch.count(2) > 0)
        watch.wait(f"{AT_WORLD_2} steps at world 2", lambda: watch.count(2) >= AT_WORLD_2)
        held = worker_pids(agents[0].pid)          # the dp 2 workers: no further step
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        rejoin.touch()
        t_join = time.time()
        watch.wait("the dp 2 workers stopped for the rejoined node",
                   lambda: _told_to_stop(held) or time.time() - t_join > HELD_AT_MOST_S)
        told = _told_to_stop(held)               # read while they are still held
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)     # they end on the SIGTERM that waits
        if not told:
            raise TimeoutError(f"trial: the rejoined node was not let in within {HELD_AT_MOST_S} s")
        watch.wait("a step at world 4 after the shrink",
                   lambda: watch.last_step(4) > watch.last_step(2))
        seconds["grow"] = time.time() - t_join
        codes = [a.wait(timeout=max(1.0, watch.deadline - time.time())) for a in agents]
        seconds["total"] = time.time() - t0
    except (TimeoutError, RuntimeError, subprocess.TimeoutExpired) as exc:
        codes, seconds["error"] = [a.poll() for a in agents], str(exc)
    finally:
        for a in agents:
            kill_tree(a)
    records = read_records(metrics)
    steps_at = {w: sum(1 for r in last_per_step(records).values() if r["world_size"] == w)
                for w in (2, 4)}
    return Trial(codes, records, _errors(tmp), seconds, steps_at)


def _errors(tmp: Path) -> str:
    return "\n".join(f"--- {err.stem}\n" + err.read_text()[-3000:] for err in sorted(tmp.glob("agent*.err")))
