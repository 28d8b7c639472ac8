"""ParallelMesh: the (pp, dp, tp) grid of ranks and one process group per axis.

World ranks are laid out with tp varying fastest, then dp, then pp::

    rank = (pp_index * dp + dp_index) * tp + tp_index

so a TP group is a run of consecutive ranks (inside one node), DP next, PP outermost. The mesh
is an explicit object — no module-level group state — so two meshes can live in one process.
Every rank of the world must build the same meshes in the same order (``new_group`` is a
collective call).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from trainmesh.core.errors import ConfigError

AXES = ("pp", "dp", "tp")


TIMEOUT_S = 300.0
"""Seconds every collective may take by default (``--timeout``)."""

@dataclass
class ParallelMesh:
    """Degrees validated against the world size once; groups handed out by axis name."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    timeout_s: float = TIMEOUT_S
    local: bool = False
    """A mesh of this process alone (dp=pp=tp=1), usable beside the job's mesh (references)."""
    rank: int = field(init=False)
    world_size: int = field(init=False)
    coords: dict[str, int] = field(init=False)
    _groups: dict[str, object] = field(init=False, repr=False)
    _ranks: dict[str, list[int]] = field(init=False, repr=False)
    _distributed: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(axis, f"must be a positive integer; got {value!r}")
        initialized = dist.is_available() and dist.is_initialized() and not self.local
        self._distributed = initialized
        self.world_size = dist.get_world_size() if initialized else 1
        self.rank = dist.get_rank() if initialized else 0
        if self.dp * self.pp * self.tp != self.world_size:
            raise ConfigError(
                "dp*pp*tp",
                f"{self.dp}*{self.pp}*{self.tp} = {self.dp * self.pp * self.tp} must equal the "
                f"world size {self.world_size}")
        self.coords = self.coords_of(self.rank)
        self._groups, self._ranks = {}, {}
        timeout = timedelta(seconds=self.timeout_s)
        # Every rank creates every group of every axis, in the same order (a collective call).
        for axis in AXES:
            for members in self._all_groups(axis):
                group = dist.new_group(members, timeout=timeout) if initialized else None
                if self.rank in members:
                    self._groups[axis], self._ranks[axis] = group, members
        everyone = list(range(self.world_size))
        self._groups["world"] = (dist.new_group(everyone, timeout=timeout)
                                 if initialized else None)
        self._ranks["world"] = everyone

    # ---------------------------------------------------------------- coordinates
    @property
    def shape(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp}

    def coords_of(self, rank: int) -> dict[str, int]:
        """Mesh coordinates {"dp", "pp", "tp"} of a world rank."""
        tp_i = rank % self.tp
        dp_i = (rank // self.tp) % self.dp
        pp_i = rank // (self.tp * self.dp)
        return {"dp": dp_i, "pp": pp_i, "tp": tp_i}

    def rank_of(self, *, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        """World rank at the given coordinates."""
        return (pp * self.dp + dp) * self.tp + tp

    def _all_groups(self, axis: str) -> list[list[int]]:
        """Every group of one axis: the ranks that differ only in that coordinate."""
        others = [a for a in AXES if a != axis]
        groups = []
        for i in range(getattr(self, others[0])):
            for j in range(getattr(self, others[1])):
                fixed = {others[0]: i, others[1]: j}
                groups.append([self.rank_of(**{**fixed, axis: k}) for k in range(getattr(self, axis))])
        return groups

    # ---------------------------------------------------------------- groups
    def group(self, axis: str):
        """The process group of this rank along ``axis`` ("dp", "pp", "tp" or "world")."""
        if axis not in self._groups:
            raise KeyError(f"unknown mesh axis {axis!r}; valid: dp, pp, tp, world")
        return self._groups[axis]

    def subgroups(self, member_lists: list[list[int]]) -> dict[tuple[int, ...], object]:
        """Process groups over other sets of world ranks (e.g. the pipeline ranks that share a
        tied weight), with the mesh's timeout. Collective: every rank of the world calls it with
        the same lists in the same order. Returns the groups this rank is a member of, keyed by
        their member tuple."""
        timeout = timedelta(seconds=self.timeout_s)
        mine: dict[tuple[int, ...], object] = {}
        for members in member_lists:
            group = dist.new_group(members, timeout=timeout) if self._distributed else None
            if self.rank in members:
                mine[tuple(members)] = group
        return mine

    def ranks(self, axis: str) -> list[int]:
        """World ranks of this rank's group along ``axis``, in axis order."""
        return self._ranks[axis]

    def size(self, axis: str) -> int:
        return len(self._ranks[axis])

    def index(self, axis: str) -> int:
        """This rank's position along ``axis``."""
        return self.coords[axis] if axis in self.coords else self.rank
