"""Distributed checkpoints in the ``torch.distributed.checkpoint`` (DCP) format, written shard
by shard, that resume under another layout.

A checkpoint is a directory ``step-00000010/`` holding DCP's ``.metadata`` and one
``__<rank>_0.distcp`` file per writing rank, plus trainmesh's ``manifest.json`` (format, step,
layout, trainer state, the sha256 of every file). The state dict is laid out as torchtitan's
and named as ``get_state_dict`` names it (:mod:`.local_state`): ``model.<name>`` with the full
global shape, ``optimizer.state.<name>.<key>``, ``optimizer.param_groups.<i>.*``.

Saving: every rank hands DCP the pieces it holds — ZeRO's flat shards cut into rectangular
chunks of the logical tensors, tp / ep slices, its pipeline stage — at their global offsets
(:mod:`.chunks`); a piece held by several ranks is written once. Nothing is gathered. The files
go to a hidden temporary directory that rank 0 renames into place after ``.metadata`` and the
manifest are written, so a crash mid-save leaves the previous checkpoint the newest complete
one. Loading: rank 0 picks the newest intact checkpoint (files inside it, present, matching
their sha256), and each rank reads, from the saved chunks that overlap, only the tensors its
own layout holds (:mod:`.load_state`: ZeRO's shards read in place) — any dp, pp, tp, ep,
zero stage or precision. A checkpoint of
the first format (:mod:`.legacy`) still loads; a DCP directory written by plain PyTorch (no
manifest: no checksums, no trainer state) loads through :func:`load` too (``--resume-from``).

It takes what it needs — the data-parallel strategy (which holds the tensors), the
communication layer (and its mesh) and the trainer state — and knows nothing of the engine.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from trainmesh.checkpoint import legacy
from trainmesh.checkpoint.chunks import tensor_meta
from trainmesh.checkpoint.dcp_io import METADATA, PlannedSave, read_into, read_metadata, sha256
from trainmesh.checkpoint.legacy import CheckpointError
from trainmesh.checkpoint.load_state import load_plan, whole_chunks
from trainmesh.checkpoint.local_state import MODEL, save_state
from trainmesh.checkpoint.save_memory import SavePeak, held_bytes, memory_record
from trainmesh.comm import Comm
from trainmesh.core.placement import Placements
from trainmesh.data_parallel.base import GradSync

log = logging.getLogger("trainmesh")
MANIFEST = "manifest.json"
FORMAT = "trainmesh-dcp-1"
PHASES = ("planned", "written", "metadata", "manifest")
"""Points of a save after which a crash is tested to leave the previous checkpoint newest."""


def _phase(name: str) -> None:
    """A save reached ``name`` (:data:`PHASES`); tests plant failures here."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint (one with a manifest) under ``root``, or None."""
    root = Path(root)
    if (root / MANIFEST).exists():
        return root
    done = sorted(p for p in root.glob("step-*") if (p / MANIFEST).exists()) if root.is_dir() else []
    return done[-1] if done else None


def inside(directory: Path, name: object) -> Path:
    """The manifest's file ``name`` as a path inside ``directory`` (never outside it)."""
    if not isinstance(name, str) or not name or PurePosixPath(name).is_absolute() \
            or ".." in PurePosixPath(name).parts or "\\" in name or "/" in name:
        raise CheckpointError(f"{directory}: manifest names {name!r}, not a file of the checkpoint "
                              "(absolute or '..' paths are refused)")
    path = directory / name
    if not path.resolve().is_relative_to(directory.resolve()):
        raise CheckpointError(f"{directory}: piece {name} is a link leading out of the checkpoint; "
                              "refusing it")
    return path


class Reader:
    """A DCP checkpoint directory: trainmesh's (``manifest.json``: checksums, trainer state) or
    plain PyTorch's (``.metadata`` only). Reads whole tensors (tools) or chunks (:func:`load`)."""

    def __init__(self, directory: Path, manifest: dict[str, Any] | None) -> None:
        self.dir = directory
        self.plain = manifest is None
        self.manifest: dict[str, Any] = manifest or {"format": "torch.distributed.checkpoint", "files": {}}
        files = self.manifest.get("files")
        if not isinstance(files, dict) or (not self.plain and METADATA not in files):
            raise CheckpointError(f"{directory}: manifest without its files")
        for name in files:
            inside(directory, name)
        self._metadata: Any = None

    @property
    def metadata(self) -> Any:
        if self._metadata is None:
            path = inside(self.dir, METADATA)
            if not path.is_file():
                raise CheckpointError(f"{self.dir}: piece {METADATA} is missing")
            try:
                self._metadata = read_metadata(self.dir)
            except Exception as exc:  # noqa: BLE001 - pickle raises many types
                raise CheckpointError(f"{self.dir}: unreadable {METADATA}: {exc}") from exc
            for info in self._metadata.storage_data.values():   # where DCP will read from
                if inside(self.dir, info.relative_path).name not in self.manifest["files"] and not self.plain:
                    raise CheckpointError(f"{self.dir}: {METADATA} names {info.relative_path!r}, a file "
                                          "without a checksum in the manifest; refusing it")
            self.manifest["tensors"] = {k: METADATA for k, md in self._metadata.state_dict_metadata.items()
                                        if tensor_meta(md) is not None}
        return self._metadata

    def check_files(self, *, verify: bool) -> None:
        """Every file exists and (``verify``) matches its sha256; the metadata reads."""
        for name, digest in sorted(self.manifest["files"].items()):
            path = inside(self.dir, name)
            if not path.is_file():
                raise CheckpointError(f"{self.dir}: piece {name} is missing")
            if verify and sha256(path) != digest:
                raise CheckpointError(f"{self.dir}: piece {name} is corrupt (sha256 mismatch); refusing to load")
        _ = self.metadata

    def meta(self, key: str) -> Any:
        md = tensor_meta(self.metadata.state_dict_metadata.get(key))
        if md is None:
            raise CheckpointError(f"{self.dir}: no tensor {key!r} (was it saved from another model?)")
        return md

    def get(self, key: str) -> torch.Tensor:
        """One whole tensor (``model.<name>``, ...), read chunk by chunk."""
        md = self.meta(key)
        out = torch.empty(md.size, dtype=md.properties.dtype)
        read_into({key: out}, self.dir, self.metadata)
        return out


def open_reader(directory: Path) -> Reader | legacy.Reader:
    """The reader of a checkpoint directory of either format; CheckpointError naming the format
    of anything else."""
    path = directory / MANIFEST
    if not path.exists():
        if (directory / METADATA).exists():
            return Reader(directory, None)
        raise CheckpointError(f"{directory}: no {MANIFEST} and no {METADATA}: not a checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:   # ValueError: not JSON, not UTF-8
        raise CheckpointError(f"{directory}: unreadable manifest: {exc}") from exc
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found == legacy.FORMAT:
        return legacy.Reader(directory)
    if found != FORMAT:
        raise CheckpointError(f"{directory}: not a trainmesh checkpoint (format {found!r}; this "
                              f"version reads {FORMAT!r} and {legacy.FORMAT!r})")
    return Reader(directory, manifest)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a checkpoint of either format (no checks of its files)."""
    return open_reader(directory).manifest


def newest_intact(root: str | Path, *, verify: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest intact checkpoint under ``root`` or None, [(newer one skipped, why)]).

    Intact: a readable manifest whose files lie inside its directory and exist, and (``verify``)
    match their sha256. ``root`` may be one checkpoint directory itself (also a plain DCP one)."""
    root = Path(root)
    candidates = [root] if (root / MANIFEST).exists() or (root / METADATA).exists() else (
        sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True) if root.is_dir() else [])
    skipped: list[tuple[Path, str]] = []
    for directory in candidates:
        try:
            open_reader(directory).check_files(verify=verify)
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


# ---------------------------------------------------------------- save
def save(root: str | Path, grad_sync: GradSync, comm: Comm, *, step: int,
         layout: dict[str, Any], trainer_state: dict[str, Any],
         placements: Placements | None = None,
         untrained: Sequence[tuple[str, torch.Tensor]] = (),
         measure: dict[str, Any] | None = None) -> Path:
    """Collective: every rank calls it. Writes the parameters and optimizer states
    ``grad_sync`` holds on ``comm``'s mesh as checkpoint ``step`` under ``root``, with the
    ``layout`` record and the (JSON) ``trainer_state``; ``placements`` says which are
    tensor- or expert-parallel slices; ``untrained``: the frozen parameters and persistent
    buffers, outside the strategy. ``measure``: filled on rank 0 with what the save cost in
    memory (:func:`memory_record`). Returns the checkpoint directory."""
    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".{final.name}.tmp"
    if comm.mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier()
    with SavePeak(grad_sync.device) as peak:
        with save_state(grad_sync, comm, placements or Placements(), untrained,
                            trainer_state.get("tied")) as state:
            planned = PlannedSave(state, tmp, comm)
            _phase("planned")
            results, files = planned.write()
            _phase("written")
            staging = planned.writer.staged_bytes
        everyone = comm.all_gather_object((results, files))
        if comm.mesh.rank == 0:
            merged = {name: digest for _, f in everyone for name, digest in f.items()}
            merged[METADATA] = planned.finish([r for r, _ in everyone])
            _phase("metadata")
    mine = {"rank": comm.mesh.rank, "peak_added_bytes": peak.added,
            "held_bytes": held_bytes(grad_sync, untrained), "staging_bytes": staging}
    memory = comm.all_gather_object(mine) if measure is not None else []
    if comm.mesh.rank == 0:
        publish(tmp, final, {"format": FORMAT, "step": step, "layout": layout,
                             "trainer": trainer_state, "files": merged})
        if measure is not None:
            measure.update(memory_record(memory))
    comm.barrier()
    return final


def publish(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Rank 0: the manifest written and synced, then ``tmp`` renamed to ``final`` (atomic: the
    checkpoint appears whole or not at all)."""
    for name in manifest["files"]:
        usual_mode(tmp / name)
    with (tmp / MANIFEST).open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _phase("manifest")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


# ---------------------------------------------------------------- load
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
         untrained: Sequence[tuple[str, torch.Tensor]] = ()) -> dict[str, Any] | None:
    """Collective: restore the parameters and optimizer states of the newest intact checkpoint
    under ``root`` (:func:`choose`) into ``grad_sync``, resharded to ``comm``'s mesh. Returns
    the trainer state saved with it, None for a plain PyTorch checkpoint (the caller restores
    its step, LR schedule and loss scaler from it). The ``untrained`` tensors (as :func:`save`)
    get their saved values in place; one the checkpoint lacks is left as it is."""
    directory = choose(root, comm)
    placements = placements or Placements()
    with reading(directory):
        reader = open_reader(directory)
        if isinstance(reader, legacy.Reader):
            return legacy.load(directory, grad_sync, comm, placements, untrained)
        md = reader.metadata.state_dict_metadata

        def missing(key: str) -> CheckpointError:
            return CheckpointError(f"{directory}: no tensor {key!r} (was it saved from another model?)")
        with load_plan(md, grad_sync, comm, placements, missing) as (targets, install), torch.no_grad():
            for name, t in untrained:
                if MODEL + name in md:
                    targets[MODEL + name] = whole_chunks(name, t, comm, placements)
            read_into(targets, directory, reader.metadata)
            install()
    return None if reader.plain else reader.manifest.get("trainer")


def consolidate(root: str | Path, out: str | Path) -> Path:
    """Write the full, unsharded model weights of the newest intact checkpoint as one
    safetensors file (mode as the umask gives new files), tensor by tensor: memory for one
    tensor at a time."""
    from trainmesh.checkpoint.stream import write_safetensors
    directory, skipped = newest_intact(root)
    for bad, why in skipped:
        log.warning("trainmesh: skipping checkpoint %s: %s", bad, why)
    if directory is None:
        raise CheckpointError(_none_intact(root, skipped)[1:])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with reading(directory):
        weights, manifest = read_weights(directory)
        step = manifest.get("step", (manifest.get("trainer") or {}).get("step"))
        write_safetensors(out, weights, metadata={"step": str(step)})
    usual_mode(out)
    return out


def read_weights(directory: Path) -> tuple[Any, dict[str, Any]]:
    """(the full weights by parameter name, tied aliases included, read lazily: a mapping that
    reads a tensor when asked for it; the manifest) of one checkpoint directory."""
    from trainmesh.checkpoint.stream import LazyWeights
    reader = open_reader(directory)
    if isinstance(reader, legacy.Reader):
        weights, manifest = legacy.read_weights(directory)
        return LazyWeights.of(weights), manifest
    names = {k[len(MODEL):]: k for k, md in reader.metadata.state_dict_metadata.items()
             if k.startswith(MODEL) and tensor_meta(md) is not None}
    for alias, name in sorted(((reader.manifest.get("trainer") or {}).get("tied") or {}).items()):
        if name in names:                      # a tied weight under each of its names
            names.setdefault(alias, names[name])
    return LazyWeights(reader, names), reader.manifest


def _Reader(directory: Path) -> Reader | legacy.Reader:   # noqa: N802 - the name tests know
    """:func:`open_reader`, its tensors listed in ``manifest["tensors"]``."""
    reader = open_reader(directory)
    if isinstance(reader, Reader):
        _ = reader.metadata
    return reader
