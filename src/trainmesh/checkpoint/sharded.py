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

import fcntl
import hashlib
import json
import logging
import os
import shutil
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trainmesh.comm import Comm
from trainmesh.core.axes import kind_groups
from trainmesh.core.placement import Placement, Placements
from trainmesh.data_parallel.base import GradSync
from trainmesh.expert_parallel.shard import gather_stacked, stacked_slice
from trainmesh.tensor_parallel.state import (
    full_tensor,
    shard_dim,
    shard_of,
    shard_parts,
)

log = logging.getLogger("trainmesh")
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


def newest_intact(root: str | Path, *, verify: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest intact checkpoint under ``root`` or None, [(newer one skipped, why)]).

    Intact: a readable manifest whose files lie inside its directory and exist, and (``verify``)
    match their sha256. ``root`` may be one checkpoint directory itself."""
    root = Path(root)
    candidates = [root] if (root / MANIFEST).exists() else (
        sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True) if root.is_dir() else [])
    skipped: list[tuple[Path, str]] = []
    for directory in candidates:
        try:
            reader = _Reader(directory)
            reader.check_files(verify=verify)
        except CheckpointError as exc:
            skipped.append((directory, str(exc).removeprefix(f"{directory}: ")))
            continue
        return directory, skipped
    return None, skipped


def prune(root: str | Path, keep: int, *, protect: Path | None = None) -> list[Path]:
    """Remove all but the newest ``keep`` checkpoints under ``root`` (``keep`` >= 1), never
    ``protect`` (the one just written) nor one being read (:func:`reading`: a load, a
    consolidation). Returns what was removed. Each goes out of sight atomically (renamed to a
    ``.step-*.tmp`` that a later run clears)."""
    done = sorted(p for p in Path(root).glob("step-*") if (p / MANIFEST).exists())
    removed = []
    for directory in done[:-keep] if keep > 0 else []:
        if protect is not None and directory.resolve() == Path(protect).resolve():
            continue
        fd = os.open(directory, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue   # someone is reading it: the next save's pruning retries
            hidden = directory.with_name(f".{directory.name}.tmp")
            os.replace(directory, hidden)
            shutil.rmtree(hidden, ignore_errors=True)
            removed.append(directory)
        finally:
            os.close(fd)
    return removed


@contextmanager
def reading(directory: Path) -> Iterator[None]:
    """A shared lock on a checkpoint directory while it is read: :func:`prune` skips it."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _umask() -> int:
    """This process's umask, read without changing it (Linux), else the usual 022."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def usual_mode(path: Path) -> None:
    """Give a written file the mode a new file gets under the umask (safetensors makes 0600)."""
    os.chmod(path, 0o666 & ~_umask())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- TP: whole <-> shard
def _tp_slice(comm: Comm, placement: Placement | None, full: torch.Tensor) -> torch.Tensor:
    """This rank's tp slice of ``full``, sharded as ``placement`` says (None: whole), and its
    run of stacked experts where they are split over ep."""
    dim = shard_dim(placement) if full.dim() else None
    return stacked_slice(shard_of(full, dim, comm.mesh.index("tp"), comm.mesh.size("tp"),
                                  shard_parts(placement)), comm, placement).contiguous()


def _writer(key: str, comm: Comm, axis: str = "dp_cp") -> int:
    """Which of the ``axis`` x tp ranks sharing this rank's pipeline stage (the holders of its
    kind of parameter, :mod:`trainmesh.core.axes`: dp x cp for a dense one; ``edp``, those
    holding the same experts, for an expert) writes ``key``."""
    return zlib.crc32(key.encode()) % (comm.mesh.size(axis) * comm.mesh.size("tp"))


def pieces(grad_sync: GradSync, comm: Comm, placements: Placements,
           stage: Callable[[str, torch.Tensor], torch.Tensor],
           untrained: Sequence[tuple[str, torch.Tensor]] = ()) -> dict[str, torch.Tensor]:
    """Collective over tp: the logical tensors of this pipeline stage that this rank writes,
    each whole and passed through ``stage(key, tensor)`` (a host copy). Tensors sharded over tp
    are gathered on every rank of the group, in the strategy's parameter order and sorted state
    keys, the same on every rank; replicated ones are touched only by their writer. An expert's
    parameters (expert parallelism) are written by one of the ranks holding them, by their
    global name; stacked experts split over ep are gathered over ep (every rank of the group,
    in the same order) and written by one of the dp ranks. The ``untrained`` tensors (frozen parameters, persistent buffers: no optimizer
    state) follow, as ``param/<name>``."""
    mesh = comm.mesh
    params, optim = grad_sync.logical_state()
    params = {**params, **{name: t.detach() for name, t in untrained}}
    mine: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        placement = placements.get(name)
        stacked = placements.ep_split(name)           # whole on every rank once gathered over ep
        kind = "dense" if stacked else placements.kind(name)
        axis = kind_groups(mesh.degrees, kind).holders   # who holds it
        me = mesh.index(axis) * mesh.size("tp") + mesh.index("tp")
        items = [(f"param/{name}", t), *((f"optim/{name}/{k}", v)
                                         for k, v in sorted(optim.get(name, {}).items()))]
        for key, value in items:
            writes = _writer(key, comm, axis) == me
            if shard_dim(placement) is not None and value.dim() > 0:
                value = full_tensor(value, comm, placement=placement)   # collective over tp
            if stacked and value.dim() > 0:
                value = gather_stacked(value, comm, placement)          # collective over ep
            if writes:
                mine[key] = stage(key, value.detach())
    return mine


def manifest_of(entries: list[dict[str, Any] | None], **header: Any) -> dict[str, Any]:
    """The manifest of a checkpoint from each writing rank's entry (file, sha256, keys)."""
    return {"format": FORMAT, **header,
            "files": {e["file"]: e["sha256"] for e in entries if e},
            "tensors": {k: e["file"] for e in entries if e for k in e["keys"]}}


def write_piece(tmp: Path, rank: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """This rank's file of the checkpoint being written in ``tmp``; its manifest entry."""
    if not tensors:
        return None
    path = tmp / f"rank{rank:05d}.safetensors"
    save_file(tensors, str(path))
    usual_mode(path)
    return {"file": path.name, "sha256": _sha256(path), "keys": sorted(tensors)}


def publish(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Rank 0: the manifest written and synced, then ``tmp`` renamed to ``final`` (atomic: the
    checkpoint appears whole or not at all)."""
    with (tmp / MANIFEST).open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


# ---------------------------------------------------------------- save
def save(root: str | Path, grad_sync: GradSync, comm: Comm, *, step: int,
         layout: dict[str, Any], trainer_state: dict[str, Any],
         placements: Placements | None = None,
         untrained: Sequence[tuple[str, torch.Tensor]] = ()) -> Path:
    """Collective: every rank calls it. Writes the parameters and optimizer states
    ``grad_sync`` holds on ``comm``'s mesh as checkpoint ``step`` under ``root``, with the
    ``layout`` record and the (JSON) ``trainer_state``; ``placements`` says which are
    tensor-parallel shards; ``untrained``: the frozen parameters and persistent buffers, outside
    the strategy (written as parameters, never sharded by DP). Returns the checkpoint directory."""
    root = Path(root)
    mesh = comm.mesh
    final = step_dir(root, step)
    tmp = root / f".{final.name}.tmp"
    mine = pieces(grad_sync, comm, placements or Placements(),
                  lambda _, t: t.cpu().contiguous(), untrained)
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier()
    entries = comm.all_gather_object(write_piece(tmp, mesh.rank, mine))
    if mesh.rank == 0:
        publish(tmp, final, manifest_of(entries, step=step, layout=layout, trainer=trainer_state))
    comm.barrier()
    return final


# ---------------------------------------------------------------- load
class _Reader:
    """Reads logical tensors from a checkpoint, verifying each file once before use."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        try:
            self.manifest = json.loads((directory / MANIFEST).read_text())
        except (OSError, ValueError) as exc:   # ValueError: not JSON, not UTF-8
            raise CheckpointError(f"{directory}: unreadable manifest: {exc}") from exc
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
            found = self.manifest.get("format") if isinstance(self.manifest, dict) else None
            raise CheckpointError(f"{directory}: not a trainmesh checkpoint (format {found!r})")
        files, tensors = self.manifest.get("files"), self.manifest.get("tensors")
        if not isinstance(files, dict) or not isinstance(tensors, dict):
            raise CheckpointError(f"{directory}: manifest without its files and tensors")
        for name in [*files, *tensors.values()]:
            self._inside(name)
        if not set(tensors.values()) <= set(files):
            raise CheckpointError(f"{directory}: manifest names a piece without its sha256")
        self._verified: set[str] = set()

    def _inside(self, name: object) -> Path:
        """The manifest's file ``name`` as a path inside this directory (never outside it)."""
        if not isinstance(name, str) or not name or PurePosixPath(name).is_absolute() \
                or ".." in PurePosixPath(name).parts or "\\" in name:
            raise CheckpointError(f"{self.dir}: manifest names {name!r}, not a file of the checkpoint "
                                  "(absolute or '..' paths are refused)")
        path = self.dir / name
        if not path.resolve().is_relative_to(self.dir.resolve()):
            raise CheckpointError(f"{self.dir}: piece {name} is a link leading out of the checkpoint; "
                                  "refusing it")
        return path

    def check_files(self, *, verify: bool) -> None:
        """Every piece exists and (``verify``) matches its sha256."""
        for name in sorted(self.manifest["files"]):
            if verify:
                self._verify(name)
            elif not (self.dir / name).is_file():
                raise CheckpointError(f"{self.dir}: piece {name} is missing")

    def _verify(self, name: str) -> None:
        if name in self._verified:
            return
        path = self._inside(name)
        if not path.is_file():
            raise CheckpointError(f"{self.dir}: piece {name} is missing")
        if _sha256(path) != self.manifest["files"][name]:
            raise CheckpointError(f"{self.dir}: piece {name} is corrupt (sha256 mismatch); refusing to load")
        self._verified.add(name)

    def has(self, key: str) -> bool:
        return key in self.manifest["tensors"]

    def get(self, key: str) -> torch.Tensor:
        name = self.manifest["tensors"].get(key)
        if name is None:
            raise CheckpointError(f"{self.dir}: no tensor {key!r} (was it saved from another model?)")
        path = self.dir / name
        self._verify(name)
        try:
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(key)
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types
            raise CheckpointError(f"{self.dir}: cannot read {key!r} from {name}: {exc}") from exc


def choose(root: str | Path, comm: Comm) -> Path:
    """Collective: the checkpoint every rank loads, the newest intact one under ``root`` as rank
    0 verifies it; each newer one skipped is named in one line with why."""
    name = None
    if comm.mesh.rank == 0:
        directory, skipped = newest_intact(root)
        for bad, why in skipped:
            log.warning("trainmesh: skipping checkpoint %s: %s", bad, why)
        name = str(directory) if directory is not None else _none_intact(root, skipped)
    name = comm.all_gather_object(name)[0]
    if name.startswith("!"):
        raise CheckpointError(name[1:])
    return Path(name)


def _none_intact(root: str | Path, skipped: list[tuple[Path, str]]) -> str:
    if not skipped:
        return f"!no complete checkpoint under {root}"
    return f"!no intact checkpoint under {root} ({skipped[0][0].name}: {skipped[0][1]})"


def load(root: str | Path, grad_sync: GradSync, comm: Comm,
         placements: Placements | None = None,
         untrained: Sequence[tuple[str, torch.Tensor]] = ()) -> dict[str, Any]:
    """Collective: restore the parameters and optimizer states of the newest intact checkpoint
    under ``root`` (:func:`choose`) into ``grad_sync``, resharded to ``comm``'s mesh
    (``placements``: the tensor-parallel shards). Returns the trainer state saved with it (the
    caller restores its step, LR schedule and loss scaler from it). The ``untrained`` tensors
    (as :func:`save`) get their saved values in place; one the checkpoint lacks is left as it is."""
    directory = choose(root, comm)
    with reading(directory):
        reader = _Reader(directory)
        params: dict[str, torch.Tensor] = {}
        optim: dict[str, dict[str, torch.Tensor]] = {}
        placements = placements or Placements()
        for name, _ in grad_sync.named_params:
            placement = placements.get(name)
            params[name] = _tp_slice(comm, placement, reader.get(f"param/{name}"))
            prefix = f"optim/{name}/"
            optim[name] = {k[len(prefix):]: _tp_slice(comm, placement, reader.get(k))
                           for k in sorted(reader.manifest["tensors"]) if k.startswith(prefix)}
        for name, t in untrained:
            if reader.has(f"param/{name}"):
                with torch.no_grad():
                    t.copy_(_tp_slice(comm, placements.get(name), reader.get(f"param/{name}")))
    grad_sync.load_logical_state(params, optim)
    return reader.manifest["trainer"]


def consolidate(root: str | Path, out: str | Path) -> Path:
    """Write the full, unsharded model weights of the newest intact checkpoint as one
    safetensors file (mode as the umask gives new files)."""
    directory, skipped = newest_intact(root)
    for bad, why in skipped:
        log.warning("trainmesh: skipping checkpoint %s: %s", bad, why)
    if directory is None:
        raise CheckpointError(_none_intact(root, skipped)[1:])
    with reading(directory):
        weights, manifest = read_weights(directory)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out), metadata={"step": str(manifest["step"])})
    usual_mode(out)
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
