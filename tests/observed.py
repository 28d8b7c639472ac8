"""Runs of a representative set of layouts and modes with every observation on, for the tests
of what a run shows (``trainmesh report``, the console, TensorBoard) and of what the other
commands make of a run's files (checkpoints of every layout, metrics files of every mode).

The ``observed_run(name)`` fixture (conftest.py) runs each at most once per test session
(shared by every module and pytest-xdist worker) and returns its directory: ``run.jsonl``,
``stdout.txt``, ``stderr.txt``, ``ckpt/`` where the mode saves, ``tb/`` where TensorBoard is
on. A new layout is one more line of :data:`OBSERVED`; the tests that walk the table take it up.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

from helpers import trainmesh_process

TINY = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "16", "--vocab-size",
        "64", "--global-batch", "8", "--steps", "4", "--warmup-steps", "1"]
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@dataclass(frozen=True)
class Observed:
    """One run: its flags (after :data:`TINY`), whether it saves checkpoints (every 2 steps)
    and writes TensorBoard, and its environment (fault injection)."""

    flags: tuple[str, ...]
    saves: bool = True
    tensorboard: bool = False
    env: dict[str, str] = field(default_factory=dict)


OBSERVED = {
    "dp2pp2": Observed(("--dp", "2", "--pp", "2", "--zero", "1", "--microbatches", "2",
                        "--eval-every", "2")),
    "tp2cp2": Observed(("--tp", "2", "--cp", "2")),
    "hsdp": Observed(("--dp", "4", "--dp-shard", "2", "--zero", "2")),
    "moe": Observed(("--dp", "2", "--ep", "2", "--experts", "4", "--eval-every", "2"),
                    tensorboard=HAS_TENSORBOARD),
    "ps": Observed(("--dp", "2", "--strategy", "ps"), saves=False),
    "diloco": Observed(("--dp", "2", "--strategy", "diloco", "--inner-steps", "2")),
    # replica 1 is killed inside step 3's all-reduce: the attempt is discarded, step 3 is
    # redone by replica 0 alone, replica 1 rejoins (restarted by its agent) at step 5, not earlier
    # (a forked restart is fast enough to join step 3's redo, which would leave no step degraded)
    "ft": Observed(("--dp", "2", "--fault-tolerant", "--timeout", "30", "--steps", "6"),
                   saves=False, tensorboard=HAS_TENSORBOARD, env={"TRAINMESH_FT_INJECT": "1@3,1.1@5:join"}),
}


def run_observed(name: str, out: Path, *, timeout: float = 240) -> Path:
    """Run ``OBSERVED[name]`` into directory ``out``; raises if it fails."""
    spec = OBSERVED[name]
    out.mkdir(parents=True, exist_ok=True)
    args = [*TINY, *spec.flags, "--metrics-out", str(out / "run.jsonl")]
    if spec.saves:
        args += ["--save-dir", str(out / "ckpt"), "--save-every", "2"]
    if spec.tensorboard:
        args += ["--tensorboard", str(out / "tb")]
    env = {k: v for k, v in os.environ.items()   # COLUMNS unset: the console's tables unfolded
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "COLUMNS", "LINES")}
    proc = trainmesh_process(["train", *args], out, env={**env, **spec.env}, timeout=timeout,
                             name="console")
    (out / "stdout.txt").write_text(proc.stdout)
    (out / "stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0:
        raise AssertionError(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return out
