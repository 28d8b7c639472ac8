"""Distributed checkpoints that resume under another layout.

A checkpoint is a directory ``step-00000010/`` holding one safetensors file per writing rank
and a ``manifest.json``. The manifest maps every *logical* tensor — ``param/<name>`` and
``optim/<name>/<state key>``, whole (unsharded) tensors named as in the single-process model —
to its file, records each file's sha256, the layout it was written under and the trainer state
(step, LR schedule, loss scaler). Saving: each DP strategy hands over its state whole along DP,
TP shards are gathered along their shard dimension, and every logical tensor is written once, by
one of the ranks holding it (spread by name), all ranks writing in parallel. The files go to a
hidden temporary directory that rank 0 renames into place only after the manifest is written,
so a crash mid-save leaves the previous checkpoint the newest complete one. Loading reads the
manifest, verifies the checksum of every file it opens, and each rank slices out what its own
layout holds — any dp, pp, tp, zero stage or precision.

It takes what it needs — the data-parallel strategy (which holds the tensors), the
communication layer (and its mesh) and the trainer state — and knows nothing of the engine.

The saving ranks hold whole tensors transiently (one stage's worth); fine for the models this
runs on a CPU, and the place to stream when models grow.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .comm import Comm
from .data_parallel.base import GradSync
from .tensor_parallel.state import full_tensor, shard_dim, shard_of, shard_parts

MANIFEST = "manifest.json"
FORMAT = "trainmesh-checkpoint-1"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, truncated or tampered with."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint (one with a manifest) under ``root``, or None."""
    root = Path(root)
    if (root / MANIFEST).exists():
        return root
    done = sorted(p for p in root.glob("step-*") if (p / MANIFEST).exists()) if root.is_dir() else []
    return done[-1] if done else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- TP: whole <-> shard
def _tp_slice(comm: Comm, p: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This rank's tp slice of ``full``, sharded as ``p`` is."""
    dim = shard_dim(p) if full.dim() else None
    return shard_of(full, dim, comm.mesh.index("tp"), comm.mesh.size("tp"), shard_parts(p)).contiguous()


def _writer(key: str, comm: Comm) -> int:
    """Which of the dp x tp ranks sharing this rank's pipeline stage writes ``key``."""
    return zlib.crc32(key.encode()) % (comm.mesh.size("dp") * comm.mesh.size("tp"))


def _logical_tensors(grad_sync: GradSync, comm: Comm) -> dict[str, torch.Tensor]:
    """Collective over dp and tp: every logical tensor of this pipeline stage, whole."""
    params, optim = grad_sync.logical_state()
    by_name = dict(grad_sync.named_params)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        tensors[f"param/{name}"] = full_tensor(t, comm, like=by_name[name])
        for key, v in optim.get(name, {}).items():
            tensors[f"optim/{name}/{key}"] = full_tensor(v, comm, like=by_name[name])
    return tensors


# ---------------------------------------------------------------- save
def save(root: str | Path, grad_sync: GradSync, comm: Comm, *, step: int,
         layout: dict[str, Any], trainer_state: dict[str, Any]) -> Path:
    """Collective: every rank calls it. Writes the parameters and optimizer states
    ``grad_sync`` holds on ``comm``'s mesh as checkpoint ``step`` under ``root``, with the
    ``layout`` record and the (JSON) ``trainer_state``. Returns the checkpoint directory."""
    root = Path(root)
    mesh = comm.mesh
    final = step_dir(root, step)
    tmp = root / f".{final.name}.tmp"
    tensors = _logical_tensors(grad_sync, comm)
    me = mesh.index("dp") * mesh.size("tp") + mesh.index("tp")
    mine = {k: t.detach().cpu().contiguous() for k, t in tensors.items() if _writer(k, comm) == me}
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier()
    entry = None
    if mine:
        path = tmp / f"rank{mesh.rank:05d}.safetensors"
        save_file(mine, str(path))
        entry = {"file": path.name, "sha256": _sha256(path), "keys": sorted(mine)}
    entries = comm.all_gather_object(entry)
    if mesh.rank == 0:
        manifest = {"format": FORMAT, "step": step, "layout": layout, "trainer": trainer_state,
                    "files": {e["file"]: e["sha256"] for e in entries if e},
                    "tensors": {k: e["file"] for e in entries if e for k in e["keys"]}}
        with (tmp / MANIFEST).open("w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)          # atomic: the checkpoint appears whole or not at all
    comm.barrier()
    return final


# ---------------------------------------------------------------- load
class _Reader:
    """Reads logical tensors from a checkpoint, verifying each file once before use."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        try:
            self.manifest = json.loads((directory / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{directory}: unreadable manifest: {exc}") from exc
        if self.manifest.get("format") != FORMAT:
            raise CheckpointError(f"{directory}: not a trainmesh checkpoint (format {self.manifest.get('format')!r})")
        self._verified: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.manifest["tensors"]

    def get(self, key: str) -> torch.Tensor:
        name = self.manifest["tensors"].get(key)
        if name is None:
            raise CheckpointError(f"{self.dir}: no tensor {key!r} (was it saved from another model?)")
        path = self.dir / name
        if name not in self._verified:
            if not path.exists():
                raise CheckpointError(f"{self.dir}: piece {name} is missing")
            if _sha256(path) != self.manifest["files"][name]:
                raise CheckpointError(f"{self.dir}: piece {name} is corrupt (sha256 mismatch); refusing to load")
            self._verified.add(name)
        try:
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(key)
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types
            raise CheckpointError(f"{self.dir}: cannot read {key!r} from {name}: {exc}") from exc


def load(root: str | Path, grad_sync: GradSync, comm: Comm) -> dict[str, Any]:
    """Collective: restore the parameters and optimizer states of the newest checkpoint under
    ``root`` into ``grad_sync``, resharded to ``comm``'s mesh. Returns the trainer state saved
    with it (the caller restores its step, LR schedule and loss scaler from it)."""
    directory = latest(root)
    if directory is None:
        raise CheckpointError(f"no complete checkpoint under {root}")
    reader = _Reader(directory)
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in grad_sync.named_params:
        params[name] = _tp_slice(comm, p, reader.get(f"param/{name}"))
        prefix = f"optim/{name}/"
        optim[name] = {k[len(prefix):]: _tp_slice(comm, p, reader.get(k))
                       for k in reader.manifest["tensors"] if k.startswith(prefix)}
    grad_sync.load_logical_state(params, optim)
    return reader.manifest["trainer"]


def consolidate(root: str | Path, out: str | Path) -> Path:
    """Write the full, unsharded model weights of the newest checkpoint as one safetensors file."""
    directory = latest(root)
    if directory is None:
        raise CheckpointError(f"no complete checkpoint under {root}")
    weights, manifest = read_weights(directory)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out), metadata={"step": str(manifest["step"])})
    return out


def read_weights(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the full weights by parameter name, tied aliases included; the manifest) of one
    checkpoint directory."""
    reader = _Reader(directory)
    weights = {k[len("param/"):]: reader.get(k) for k in sorted(reader.manifest["tensors"]) if k.startswith("param/")}
    for alias, name in sorted(reader.manifest["trainer"].get("tied", {}).items()):
        if name in weights:                    # a tied weight under each of its names
            weights.setdefault(alias, weights[name].clone())
    return weights, reader.manifest
