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

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from trainmesh.checkpoint.sharded import MANIFEST, newest_intact
from trainmesh.config.train import SHAPE, TrainConfig
from trainmesh.core.errors import ConfigError

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
                  lr=cfg.peak_lr, warmup_steps=cfg.warmup_steps, steps=cfg.steps,
                  data=data_fingerprint(cfg.data))
    return record


def data_fingerprint(data: str) -> str | dict[str, Any]:
    """What identifies ``--data``: ``synthetic`` itself; a file's size, mtime and the sha256 of
    its first MiB (cheap, and a changed or different file shows); a saved ``datasets``
    directory's fingerprint of its Arrow files."""
    if data == "synthetic":
        return data
    path = Path(data)
    if path.is_dir():
        from trainmesh.data.documents import source_fingerprint
        return {"dataset": source_fingerprint(data, "dataset")}
    st = path.stat()
    with path.open("rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "head_sha256": head}


def _newest_manifest(save_dir: str) -> tuple[str, dict[str, Any]] | None:
    """(checkpoint directory, its manifest) of the newest checkpoint whose pieces are all there
    (their checksums are verified when it is loaded), or None."""
    directory, _ = newest_intact(save_dir, verify=False)
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
    """The layout (``ParallelConfig.layout_record()``) the newest checkpoint was written under."""
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
    notes = [_check_data(saved, now, directory, force=cfg.force)]
    changed = [f"{flag} {saved[key]!r} -> {now[key]!r}" for key, flag in MAY_DIFFER.items()
               if key in saved and saved[key] != now[key]]
    if changed:
        notes.append(f"trainmesh: note: resuming {directory} with {', '.join(changed)} (checkpoint "
                     "-> this run); this run's values apply from the next step")
    return "\n".join(n for n in notes if n) or None


def _check_data(saved: dict[str, Any], now: dict[str, Any], directory: str, *, force: bool) -> str | None:
    """Another --data than the checkpoint's: ConfigError, or with --force a notice."""
    if "data" not in saved or saved["data"] == now["data"]:
        return None
    was = "synthetic" if saved["data"] == "synthetic" else "another file (or the file changed)"
    if not force:
        raise ConfigError("--data", f"differs from the data the checkpoint {directory} was trained "
                          f"on ({was}); resume with the same --data, or pass --force to continue "
                          "on this data")
    return f"trainmesh: note: resuming {directory} on another --data than it was trained on (--force)"


def drop_partial_line(path: str | Path) -> str | None:
    """A metrics file whose last line a crash cut short loses that line; returns a notice, or
    None when the file is whole (or absent)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    body, _, last = data.rstrip(b"\n").rpartition(b"\n")
    try:
        if last.strip():
            json.loads(last)
        return None
    except ValueError:
        path.write_bytes(body + b"\n" if body else b"")
        return f"trainmesh: note: dropped the partial last line of {path} (cut by a crash)"


def check_intact(save_dir: str, *, verify: bool) -> None:
    """Before resuming: checkpoints under ``save_dir`` but none intact (``verify``: checksums
    too) is ConfigError naming --resume; no checkpoint at all is fine (the run starts at 1)."""
    directory, skipped = newest_intact(save_dir, verify=verify)
    if directory is None and skipped:
        bad, why = skipped[0]
        raise ConfigError("--resume", f"no intact checkpoint in {save_dir} (newest {bad.name}: {why}); "
                          "valid: a --save-dir holding an intact checkpoint")


def schedule_changed(cfg: TrainConfig) -> bool:
    """Whether the LR schedule (--lr, --warmup-steps, --steps) differs from the checkpoint's."""
    found = saved_run(cfg.save_dir) if cfg.save_dir else None
    if found is None:
        return False
    now = run_record(cfg)
    return any(k in found[1] and found[1][k] != now[k] for k in ("lr", "warmup_steps", "steps"))


def check_resume_from(directory: str, model: Any) -> None:
    """Before any worker starts: every parameter of ``model`` (built on the meta device) is in
    the DCP checkpoint ``directory`` under ``model.<name>`` with its shape; ConfigError naming
    --resume-from, the first parameter that is missing or differs, and both shapes. Reads only
    the checkpoint's metadata (no tensor)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .dcp_io import read_metadata
    from .local_state import MODEL
    try:
        saved = read_metadata(Path(directory)).state_dict_metadata
    except Exception as exc:   # noqa: BLE001 - any unreadable metadata is the user's input
        raise ConfigError("--resume-from", f"cannot read {directory}/.metadata ({exc}); valid: a "
                          "directory dcp.save wrote") from None
    for name, param in model.named_parameters():
        entry = saved.get(MODEL + name)
        if not isinstance(entry, TensorStorageMetadata):
            raise ConfigError("--resume-from", f"{directory} holds no tensor {MODEL + name} for the "
                              "model this run builds (another model, or keys not named as "
                              "get_state_dict names them); valid: a checkpoint of the same model")
        if tuple(entry.size) != tuple(param.shape):
            raise ConfigError("--resume-from", f"{directory} holds {MODEL + name} of shape "
                              f"{tuple(entry.size)}, the model this run builds {tuple(param.shape)}; "
                              "valid: a checkpoint of the same model (--layers, --d-model, "
                              "--vocab-size, ... as it was saved)")
