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
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .tensor_parallel.state import full_tensor, shard_dim, shard_of

if TYPE_CHECKING:
    from .engine import Engine

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
def _tp_gather(engine: Engine, p: torch.nn.Parameter, t: torch.Tensor) -> torch.Tensor:
    """``t`` (``p`` or one of its optimizer states) whole along tp."""
    return full_tensor(t, engine.comm, like=p)


def _tp_slice(engine: Engine, p: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This rank's tp slice of ``full``, sharded as ``p`` is."""
    dim = shard_dim(p) if full.dim() else None
    return shard_of(full, dim, engine.mesh.index("tp"), engine.mesh.size("tp")).contiguous()


def _writer(key: str, engine: Engine) -> int:
    """Which of the dp x tp ranks sharing this rank's pipeline stage writes ``key``."""
    return zlib.crc32(key.encode()) % (engine.mesh.size("dp") * engine.mesh.size("tp"))


# ---------------------------------------------------------------- save
def save(engine: Engine, root: str | Path, trainer_state: dict[str, Any] | None = None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory."""
    root = Path(root)
    mesh, comm = engine.mesh, engine.comm
    final = step_dir(root, engine.step_count)
    tmp = root / f".{final.name}.tmp"
    params, optim = engine.sync.logical_state()
    by_name = dict(engine.sync.named_params)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        tensors[f"param/{name}"] = _tp_gather(engine, by_name[name], t)
        for key, v in optim.get(name, {}).items():
            tensors[f"optim/{name}/{key}"] = _tp_gather(engine, by_name[name], v)
    me = mesh.index("dp") * mesh.size("tp") + mesh.index("tp")
    mine = {k: t.detach().cpu().contiguous() for k, t in tensors.items() if _writer(k, engine) == me}
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
        manifest = {"format": FORMAT, "step": engine.step_count, "layout": engine.config.layout(),
                    "trainer": {**engine.checkpoint_state(), **(trainer_state or {})},
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


def load(engine: Engine, root: str | Path) -> dict[str, Any]:
    """Collective: restore the newest checkpoint under ``root`` into ``engine``, resharding to
    its layout. Returns the trainer state saved with it."""
    directory = latest(root)
    if directory is None:
        raise CheckpointError(f"no complete checkpoint under {root}")
    reader = _Reader(directory)
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in engine.sync.named_params:
        params[name] = _tp_slice(engine, p, reader.get(f"param/{name}"))
        prefix = f"optim/{name}/"
        optim[name] = {k[len(prefix):]: _tp_slice(engine, p, reader.get(k))
                       for k in reader.manifest["tensors"] if k.startswith(prefix)}
    engine.sync.load_logical_state(params, optim)
    state = reader.manifest["trainer"]
    engine.restore_checkpoint_state(state)
    return state


def consolidate(root: str | Path, out: str | Path) -> Path:
    """Write the full, unsharded model weights of the newest checkpoint as one safetensors file."""
    directory = latest(root)
    if directory is None:
        raise CheckpointError(f"no complete checkpoint under {root}")
    reader = _Reader(directory)
    weights = {k[len("param/"):]: reader.get(k) for k in sorted(reader.manifest["tensors"]) if k.startswith("param/")}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out), metadata={"step": str(reader.manifest["step"])})
    return out
