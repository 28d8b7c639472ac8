"""Checkpoints of the first format (``trainmesh-checkpoint-1``): read only.

Such a directory holds one safetensors file per writing rank and a ``manifest.json`` mapping
every logical tensor (``param/<name>``, ``optim/<name>/<state key>``, whole) to its file, with
each file's sha256 and the trainer state. They still load (each rank slices out what its
layout holds), consolidate and export; new checkpoints are written in the DCP format
(:mod:`.sharded`).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from trainmesh.comm import Comm
from trainmesh.core.layout import Group
from trainmesh.core.placement import Placement, Placements
from trainmesh.data_parallel.base import GradSync
from trainmesh.expert_parallel.shard import stacked_slice
from trainmesh.models.safetensors_file import SafetensorsFile
from trainmesh.tensor_parallel.state import shard_dim, shard_of, shard_parts

MANIFEST = "manifest.json"
FORMAT = "trainmesh-checkpoint-1"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, truncated or tampered with."""


def sha256(path: Path) -> str:
    from trainmesh.checkpoint.dcp_io import sha256 as digest
    return digest(path)


def _tp_slice(comm: Comm, placement: Placement | None, full: torch.Tensor) -> torch.Tensor:
    """This rank's tp slice of ``full``, sharded as ``placement`` says (None: whole), and its
    run of stacked experts where they are split over ep."""
    dim = shard_dim(placement) if full.dim() else None
    return stacked_slice(shard_of(full, dim, comm.mesh.index(Group.tp), comm.mesh.size(Group.tp),
                                  shard_parts(placement)), comm, placement).contiguous()


class Reader:
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
        self._files: dict[str, SafetensorsFile] = {}
        """piece -> its file, header read (each piece's header parsed once)."""

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
        if sha256(path) != self.manifest["files"][name]:
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
        try:                # by its header and its own bytes, never the whole file mapped
            if name not in self._files:
                self._files[name] = SafetensorsFile(path)
            return self._files[name].get_tensor(key)
        except (OSError, KeyError, ValueError) as exc:   # ValueError: SafetensorsError
            raise CheckpointError(f"{self.dir}: cannot read {key!r} from {name}: {exc}") from exc


def load(directory: Path, grad_sync: GradSync, comm: Comm,
         placements: Placements | None = None,
         untrained: Sequence[tuple[str, torch.Tensor]] = ()) -> dict[str, Any]:
    """Collective: restore the parameters and optimizer states of the newest intact checkpoint
    under ``root`` (:func:`choose`) into ``grad_sync``, resharded to ``comm``'s mesh
    (``placements``: the tensor-parallel shards). Returns the trainer state saved with it (the
    caller restores its step, LR schedule and loss scaler from it). The ``untrained`` tensors
    (as :func:`save`) get their saved values in place; one the checkpoint lacks is left as it is."""
    reader = Reader(directory)
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


def read_weights(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the full weights by parameter name, tied aliases included; the manifest) of one
    checkpoint directory."""
    reader = Reader(directory)
    weights = {k[len("param/"):]: reader.get(k) for k in sorted(reader.manifest["tensors"]) if k.startswith("param/")}
    for alias, name in sorted(reader.manifest["trainer"].get("tied", {}).items()):
        if name in weights:                    # a tied weight under each of its names
            weights.setdefault(alias, weights[name].clone())
    return weights, reader.manifest
