"""Resume checks: does the newest checkpoint in ``--save-dir`` belong to this run?

Every checkpoint's manifest records the run that wrote it (:func:`run_record`, saved in the
trainer state as ``run``). Before resuming, :func:`check_resume` compares it with the run asked
for: a different model shape or optimizer cannot continue (the tensors or the optimizer states
would not match) and is refused naming the flag and both values; a different seed, global batch
or LR schedule is allowed (the weights fit) and reported as one notice each. The layout may
differ freely: checkpoints reshard. The trainer state also names the elastic job that wrote it
(``job``: torchrun's ``--rdzv-id``): workers the agent restarted within that job, after a failure
or when a node left or joined, continue from it without ``--resume`` (:func:`same_job`).

Pure reads of the manifest, cheap: the launcher calls it before any worker starts (exit 2), a
worker under torchrun before loading.
"""
from __future__ import annotations

import json
import os
from typing import Any

from .checkpoint import MANIFEST, latest
from .errors import ConfigError
from .train_config import SHAPE, TrainConfig

MUST_MATCH = {**{k: "--" + k.replace("_", "-") for k in SHAPE}, "optimizer": "--optimizer"}
"""Run-record keys a resumed run must share with its checkpoint -> the flag that sets each."""
MAY_DIFFER = {"seed": "--seed", "global_batch": "--global-batch", "lr": "--lr",
              "warmup_steps": "--warmup-steps", "steps": "--steps"}
"""Run-record keys that may change on resume (with a notice) -> their flag."""


def run_record(cfg: TrainConfig) -> dict[str, Any]:
    """What a checkpoint records about the run writing it: model shape, optimizer, seed, global
    batch and LR schedule (the resolved values, preset defaults filled in)."""
    gpt = cfg.gpt_config()
    record: dict[str, Any] = {mine: getattr(gpt, theirs) for mine, theirs in SHAPE.items()}
    record.update(optimizer=cfg.optimizer, seed=cfg.seed, global_batch=cfg.global_batch,
                  lr=cfg.peak_lr, warmup_steps=cfg.warmup_steps, steps=cfg.steps)
    return record


def _newest_manifest(save_dir: str) -> tuple[str, dict[str, Any]] | None:
    """(checkpoint directory, its manifest) of the newest checkpoint, or None."""
    directory = latest(save_dir)
    if directory is None:
        return None
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("--save-dir", f"{directory}: unreadable manifest: {exc}") from None
    return (str(directory), manifest) if isinstance(manifest, dict) else None


def saved_run(save_dir: str) -> tuple[str, dict[str, Any]] | None:
    """(checkpoint directory, its run record) of the newest checkpoint, or None when there is
    none or it predates run records."""
    found = _newest_manifest(save_dir)
    run = found[1].get("trainer", {}).get("run") if found else None
    return (found[0], run) if isinstance(run, dict) else None


def saved_layout(save_dir: str) -> dict[str, Any] | None:
    """The layout (``ParallelConfig.layout()``) the newest checkpoint was written under."""
    found = _newest_manifest(save_dir)
    layout = found[1].get("layout") if found else None
    return layout if isinstance(layout, dict) else None


def elastic_job() -> str | None:
    """The elastic job this worker belongs to (the agent's run id, ``--rdzv-id``), or None."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return job if job not in ("", "none") else None


def same_job(save_dir: str) -> bool:
    """Whether the newest checkpoint was written by this elastic job (the trainer state's
    ``job``, :func:`elastic_job` of the writer): its workers were restarted (a lost or returning
    node restarts them all), so they continue from it."""
    found = _newest_manifest(save_dir)
    job = found[1].get("trainer", {}).get("job") if found else None
    return job is not None and job == elastic_job()


def check_resume(cfg: TrainConfig) -> str | None:
    """A one-line notice for a resume of ``cfg`` from the newest checkpoint in ``--save-dir``
    when the seed, global batch or LR schedule changed; None when nothing changed or there is
    nothing to resume from.

    Raises ConfigError naming the flag and both values where the checkpoint cannot continue
    this run (model shape, optimizer).
    """
    found = saved_run(cfg.save_dir) if cfg.save_dir else None
    if found is None:
        return None
    directory, saved = found
    now = run_record(cfg)
    for key, flag in MUST_MATCH.items():
        if key in saved and saved[key] != now[key]:
            raise ConfigError(flag, f"is {now[key]!r} but the checkpoint {directory} was written "
                              f"with {saved[key]!r}; resume with {flag} {saved[key]} (or use "
                              "another --save-dir)")
    changed = [f"{flag} {saved[key]!r} -> {now[key]!r}" for key, flag in MAY_DIFFER.items()
               if key in saved and saved[key] != now[key]]
    if not changed:
        return None
    return (f"trainmesh: note: resuming {directory} with {', '.join(changed)} (checkpoint -> "
            "this run); this run's values apply from the next step")


def schedule_changed(cfg: TrainConfig) -> bool:
    """Whether the LR schedule (--lr, --warmup-steps, --steps) differs from the checkpoint's."""
    found = saved_run(cfg.save_dir) if cfg.save_dir else None
    if found is None:
        return False
    now = run_record(cfg)
    return any(k in found[1] and found[1][k] != now[k] for k in ("lr", "warmup_steps", "steps"))
