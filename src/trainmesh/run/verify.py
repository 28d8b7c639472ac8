"""``trainmesh verify``'s two runs: the layout asked for and one process, on the same model, data,
seed and global batch, each an ordinary ``trainmesh train`` run through the launcher its
strategy declares (the path users run), then compared step by step
(:mod:`trainmesh.run.verify_bound`).

Each run's console output goes to a log file beside its metrics (the last lines are shown when a
run fails); what this module says goes to stderr, the table and the verdict to stdout.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainmesh.run.verify_bound import Bound, compare, table, verdict

if TYPE_CHECKING:
    from trainmesh.config.train import TrainConfig

SHOWN_LINES = 20
"""Lines of a failed run's log shown."""


@dataclass(frozen=True)
class Run:
    """One of the two runs: its config, its name in what is printed, its log."""

    cfg: TrainConfig
    name: str
    log: Path

    def records(self) -> list[dict]:
        path = Path(self.cfg.metrics_out)
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.strip()]


def say(line: str) -> None:
    sys.stderr.write(f"trainmesh verify: {line}\n")
    sys.stderr.flush()


@contextlib.contextmanager
def output_to(log: Path) -> Iterator[None]:
    """This process's stdout and stderr (and so its workers') into ``log`` for the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(log, "ab") as out:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)


def launch(run: Run, worker_setup: Callable[[], None] | None) -> int:
    """``run`` through the launcher of its strategy, as ``trainmesh train`` starts it; its
    exit code (a failure returns instead of ending this process)."""
    from trainmesh.run.launch import launch_local
    from trainmesh.strategies import strategy_of
    launcher = strategy_of(run.cfg.parallel).load("launcher") or launch_local
    with output_to(run.log):
        return launcher(run.cfg, max_restarts=run.cfg.restart_limit, worker_setup=worker_setup,
                        end_process_on_failure=False)


def show_log(run: Run) -> None:
    lines = run.log.read_text(errors="replace").splitlines() if run.log.exists() else []
    sys.stderr.write("".join(f"  | {line}\n" for line in lines[-SHOWN_LINES:]))


def verify(layout: Run, one: Run, bound: Bound, *, what: str,
           worker_setup: Callable[[], None] | None = None) -> int:
    """Run both, print the table and the verdict; 0 when every step is within the bound, 1
    when one is not (or a run failed), 128 + the signal when stopped."""
    steps = layout.cfg.exit_after or layout.cfg.steps
    if bound.note():
        say(bound.note())
    for run in (layout, one):
        world = run.cfg.parallel.world_size
        say(f"running {run.name}{f' on {world} processes' if world > 1 else ''}, {steps} steps ...")
        code = launch(run, worker_setup)
        if code >= 128:   # Ctrl-C or SIGTERM
            say(f"{run.name} stopped (exit {code})")
            return code
        if code:
            say(f"{run.name} failed (exit {code}); the end of its output:")
            show_log(run)
            return 1
    rows, unmatched = compare(one.records(), layout.records(), bound)
    sys.stdout.write(table(rows) + "\n")
    passed, line = verdict(rows, unmatched, what)
    sys.stdout.write(f"trainmesh verify: {line}\n")
    sys.stdout.flush()
    return 0 if passed else 1
