"""Writing and reading a ``torch.distributed.checkpoint`` directory over trainmesh's comm layer.

DCP's own ``save`` runs four steps — local plan, global plan (coordinator), write, finish
(coordinator writes ``.metadata``) — over a process group, in one call. They are run here step
by step through the public planner and storage interfaces (``SavePlanner``, ``StorageWriter``),
so that the only collectives are two small object gathers, done on the main thread (a
synchronous save: the pieces each rank holds, to agree who writes each, then the plans; an
asynchronous one: the plans, then the coordinator's global plan): the write needs none (an
asynchronous save writes in the background), and the coordinator learns the other ranks'
results either by a gather (:func:`write_sync`) or from files they drop (:mod:`.async_save`).
A synchronous save copies its chunks through one staging buffer (:class:`ChunkWriter`). Loading needs no collective at all: each rank plans and reads its own
chunks, from the saved chunks that overlap them.

``.metadata`` is a pickle; it is read with an unpickler that builds only DCP's metadata classes,
``torch.Size`` and dtypes (:class:`SafeReader`), and tensors are read with ``torch.load``'s
weights-only unpickler, so reading a checkpoint runs no code from it.
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import queue
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat, _StoragePrefix, _write_item
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from trainmesh.checkpoint.chunks import ChunkLoadPlanner, ChunkSavePlanner, holdings, own_pieces, writers
from trainmesh.comm import Comm

METADATA = ".metadata"


def sha256(path: Path) -> str:
    """The file's sha256, read through one 64 KiB buffer."""
    h = hashlib.sha256()
    buf = bytearray(1 << 16)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


class ChunkWriter(FileSystemWriter):
    """DCP's filesystem writer (same files, same records), each chunk that is a view into a
    larger tensor (a piece of a ZeRO flat shard, a run of rows) copied into one staging buffer,
    reused, and written from there. DCP's own loop copies each such chunk afresh and keeps every
    tensor it wrote until its file ends (for its safetensors output): the rank's whole share held
    a second time. ``staging_bytes``: the buffer's size, set by the caller (at least the
    largest chunk copied); ``staged_bytes``: what was allocated (0: nothing needed a copy)."""

    staging_bytes = 0
    staged_bytes = 0

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue) -> Future[list[WriteResult]]:
        assert self.serialization_format == SerializationFormat.TORCH_SAVE, self.serialization_format
        results: list[WriteResult] = []
        staging: memoryview | None = None
        while not file_queue.empty():
            path, key, items = file_queue.get_nowait()
            with self.fs.create_stream(path, "wb") as stream:
                for item in sorted(items, key=lambda wi: wi.type != WriteItemType.BYTE_IO):
                    data = planner.resolve_data(item)
                    if isinstance(data, torch.Tensor):
                        data = data.detach()
                        if data.untyped_storage().nbytes() != data.nbytes or not data.is_cpu:
                            if staging is None:
                                self.staged_bytes = max(self.staging_bytes, *map(_item_bytes, items))
                                staging = memoryview(bytearray(self.staged_bytes))
                            data = _staged(data, staging)
                    results.append(_write_item(self.transforms, stream, data, item, key,
                                               self.serialization_format))
                    del data
                if self.sync_files:
                    os.fsync(stream.fileno())
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future


def _item_bytes(item: WriteItem) -> int:
    """The bytes of the chunk ``item`` writes (0: not a tensor)."""
    data = item.tensor_data
    return 0 if data is None else data.chunk.sizes.numel() * data.properties.dtype.itemsize


def _staged(t: torch.Tensor, staging: memoryview) -> torch.Tensor:
    """``t`` copied into the front of ``staging``: a tensor whose storage is exactly its bytes."""
    if t.numel() == 0:
        return t.clone().cpu()
    out = torch.frombuffer(staging[:t.nbytes], dtype=t.dtype).view(t.shape)
    out.copy_(t)
    return out


STAGING_PARTS = 2
"""A synchronous save stages at most 1/STAGING_PARTS of what a rank writes at a time."""


class PlannedSave:
    """One rank's part of a save, planned: what it writes, where, and (coordinator) the metadata."""

    def __init__(self, state_dict: dict[str, Any], directory: Path, comm: Comm, *,
                 staging_parts: int | None = STAGING_PARTS) -> None:
        """``staging_parts``: first agree which rank writes each piece several hold (DCP's
        choice, one more object gather) and keep only those, cut so that the one chunk staged
        at a time is at most 1/``staging_parts`` of this rank's writes; None: plan
        ``state_dict`` as it is (an asynchronous save's host copies, written from in place)."""
        rank = comm.mesh.rank
        self.directory = directory
        self.writer = ChunkWriter(directory, single_file_per_rank=True, thread_count=1)
        self.writer.set_up_storage_writer(rank == 0, rank=rank)
        if staging_parts is not None:
            chosen = writers(comm.all_gather_object(holdings(state_dict)))   # collective: small
            mine = {key for key, r in chosen.items() if r == rank}
            del chosen
            state_dict, self.writer.staging_bytes = own_pieces(state_dict, mine, staging_parts)
        self.planner = ChunkSavePlanner()
        self.planner.set_up_planner(state_dict, storage_meta=self.writer.storage_meta(),
                                    is_coordinator=rank == 0)
        local = self.writer.prepare_local_plan(self.planner.create_local_plan())
        plans = comm.all_gather_object(local)                    # collective: small objects
        self.metadata: Metadata | None = None
        if staging_parts is not None:      # each piece in one plan: the plans stay as they are
            if rank == 0:
                _, self.metadata = self.planner.create_global_plan(plans)
            del plans
            self.plan = self.planner.finish_plan(replace(local, storage_data=_StoragePrefix(f"__{rank}_")))
            return
        shared = None
        if rank == 0:
            plans, self.metadata = self.planner.create_global_plan(plans)
            shared = self.writer.prepare_global_plan(plans)
        shared = comm.all_gather_object(shared)[0]               # collective
        self.plan = self.planner.finish_plan(shared[rank])

    def write(self) -> tuple[list[WriteResult], dict[str, str]]:
        """No collective: write this rank's chunks; (their write results, {file: sha256})."""
        future = self.writer.write_data(self.plan, self.planner)
        future.wait()
        results = future.value()
        files = sorted({r.storage_data.relative_path for r in results})
        return results, {name: sha256(self.directory / name) for name in files}

    def finish(self, results: list[list[WriteResult]]) -> str:
        """Coordinator: write ``.metadata`` from every rank's results; returns its sha256."""
        assert self.metadata is not None, "the coordinator finishes"
        self.writer.finish(self.metadata, results)
        return sha256(self.directory / METADATA)


def write_sync(state_dict: dict[str, Any], directory: Path, comm: Comm) -> dict[str, str] | None:
    """Collective: write ``state_dict`` (values: tensors, :class:`~.chunks.Chunks`, small
    objects) as a DCP checkpoint in ``directory``; rank 0 gets {file: sha256} of every file."""
    planned = PlannedSave(state_dict, directory, comm)
    results, files = planned.write()
    everyone = comm.all_gather_object((results, files))
    if comm.mesh.rank != 0:
        return None
    merged = {name: digest for _, f in everyone for name, digest in f.items()}
    merged[METADATA] = planned.finish([r for r, _ in everyone])
    return merged


def results_to_json(results: list[WriteResult]) -> list[dict[str, Any]]:
    return [{"fqn": r.index.fqn, "offset": None if r.index.offset is None else list(r.index.offset),
             "index": r.index.index, "size": r.size_in_bytes, "path": r.storage_data.relative_path,
             "at": r.storage_data.offset, "length": r.storage_data.length,
             "transforms": r.storage_data.transform_descriptors} for r in results]


def results_from_json(entries: list[dict[str, Any]]) -> list[WriteResult]:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    return [WriteResult(index=MetadataIndex(e["fqn"], None if e["offset"] is None else torch.Size(e["offset"]),
                                            e["index"]), size_in_bytes=e["size"],
                        storage_data=_StorageInfo(e["path"], e["at"], e["length"], e["transforms"]))
            for e in entries]


# ---------------------------------------------------------------- reading
_TORCH_NAMES = {"Size", "strided", "contiguous_format", "preserve_format", "channels_last",
                *(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))}
_BUILTINS = {"set", "frozenset", "dict", "list", "tuple", "slice", "bytes"}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP metadata holds: its own classes, torch.Size, dtypes, layouts."""

    def find_class(self, module: str, name: str) -> Any:
        if (module.startswith("torch.distributed.checkpoint.")
                or (module == "torch" and name in _TORCH_NAMES)
                or (module == "builtins" and name in _BUILTINS)
                or (module == "collections" and name in ("OrderedDict", "defaultdict"))
                or (module, name) in (("torch.serialization", "_get_layout"),   # layout by name
                                      ("pathlib", "PosixPath"))):                # checkpoint_id
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name} in checkpoint metadata")


class SafeReader(FileSystemReader):
    """DCP's filesystem reader, its ``.metadata`` unpickled with an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        data = (Path(self.path) / METADATA).read_bytes()
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{METADATA} holds a {type(metadata).__name__}, not DCP metadata")
        return metadata


def read_metadata(directory: Path) -> Metadata:
    return SafeReader(directory).read_metadata()


def read_into(state_dict: dict[str, Any], directory: Path, metadata: Metadata | None = None) -> None:
    """No collective: fill ``state_dict`` (tensors, :class:`~.chunks.Chunks`) from the DCP
    checkpoint in ``directory``, each chunk from the saved chunks that overlap it."""
    reader = SafeReader(directory)
    metadata = metadata or reader.read_metadata()
    planner = ChunkLoadPlanner()
    planner.set_up_planner(state_dict, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = planner.finish_plan(planner.create_global_plan([reader.prepare_local_plan(planner.create_local_plan())])[0])
    reader.read_data(plan, planner).wait()
