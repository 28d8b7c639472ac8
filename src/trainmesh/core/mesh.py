"""ParallelMesh: the (pp, dp, cp, tp) grid of ranks and one process group per named group.

World ranks are laid out with tp varying fastest, then cp, then dp, pp outermost::

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

so a TP group is a run of consecutive ranks (inside one node), CP next (its ring passes K/V
blocks every layer), DP after, PP outermost. With cp = 1 this is the (pp, dp, tp) layout.

Which groups exist and which ranks each holds is the axis table's
(:mod:`trainmesh.core.axes`): besides the four axes, ``dp_cp`` (the ranks holding replicas of
the dense parameters, each with other tokens), ``ep`` / ``edp`` (expert parallelism: runs of
``ep`` ranks of the dp x cp line, and the ranks holding the same experts), ``dp_shard`` /
``dp_replicate`` / ``dp_shard_cp`` (HSDP: ZeRO's shard group, without and with cp, and the
replicas across). A group whose member lists equal an earlier one's is that group (``dp_cp``
is ``dp`` when cp = 1), one of single ranks is none (its collectives are no-ops).

The mesh is an explicit object — no module-level group state — so two meshes can live in one
process. Every rank of the world must build the same meshes in the same order (``new_group`` is
a collective call).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from trainmesh.core.axes import GROUPS, Degrees, check_degrees
from trainmesh.core.axes import members as group_members
from trainmesh.core.errors import ConfigError

AXES = ("pp", "dp", "cp", "tp")
"""The mesh's axes, outermost first."""
DERIVED = tuple(g for g in GROUPS if g not in AXES)
"""Groups derived from the axes (:data:`trainmesh.core.axes.GROUPS`)."""


TIMEOUT_S = 300.0
"""Seconds every collective may take by default (``--timeout``)."""

@dataclass
class ParallelMesh:
    """Degrees validated against the world size once; groups handed out by axis name."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    """Expert-parallel degree: divides dp * cp."""
    dp_shard: int | None = None
    """HSDP: ZeRO's shard group size, dividing dp (None: dp, plain ZeRO)."""
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
        if self.dp_shard is None:
            self.dp_shard = self.dp
        self.degrees: Degrees = check_degrees(self)
        initialized = dist.is_available() and dist.is_initialized() and not self.local
        self._distributed = initialized
        self.world_size = dist.get_world_size() if initialized else 1
        self.rank = dist.get_rank() if initialized else 0
        size = self.dp * self.cp * self.pp * self.tp
        if size != self.world_size:
            raise ConfigError(
                "dp*cp*pp*tp",
                f"{self.dp}*{self.cp}*{self.pp}*{self.tp} = {size} must equal the "
                f"world size {self.world_size}")
        self.coords = self.coords_of(self.rank)
        self._groups, self._ranks = {}, {}
        timeout = timedelta(seconds=self.timeout_s)
        built: dict[tuple[tuple[int, ...], ...], str] = {}
        # Every rank creates every group, in the table's order (new_group is a collective call).
        for name in (*AXES, *DERIVED):
            lists = group_members(self.degrees, name)
            key = tuple(map(tuple, lists))
            mine = next(m for m in lists if self.rank in m)
            self._ranks[name] = mine
            if key in built:                      # the same ranks as an earlier group: that one
                self._groups[name] = self._groups[built[key]]
                continue
            built[key] = name
            self._groups[name] = None
            if len(mine) == 1:                    # groups of one rank: no-op collectives
                continue
            for m in lists:
                group = dist.new_group(m, timeout=timeout) if initialized else None
                if self.rank in m:
                    self._groups[name] = group
        everyone = list(range(self.world_size))
        self._groups["world"] = (dist.new_group(everyone, timeout=timeout)
                                 if initialized else None)
        self._ranks["world"] = everyone

    # ---------------------------------------------------------------- coordinates
    @property
    def shape(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    def coords_of(self, rank: int) -> dict[str, int]:
        """Mesh coordinates {"dp", "pp", "cp", "tp"} of a world rank (and "ep", this rank's
        place in its expert-parallel group, where ep > 1)."""
        tp_i = rank % self.tp
        cp_i = (rank // self.tp) % self.cp
        dp_i = (rank // (self.tp * self.cp)) % self.dp
        pp_i = rank // (self.tp * self.cp * self.dp)
        coords = {"dp": dp_i, "pp": pp_i, "tp": tp_i, "cp": cp_i}
        if self.ep > 1:
            coords["ep"] = (dp_i * self.cp + cp_i) % self.ep
        return coords

    def rank_of(self, *, dp: int = 0, pp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """World rank at the given coordinates."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    # ---------------------------------------------------------------- groups
    def group(self, axis: str):
        """The process group of this rank along ``axis`` (an axis of :data:`AXES`, a derived
        group of :data:`DERIVED`, or "world")."""
        if axis not in self._groups:
            raise KeyError(f"unknown mesh axis {axis!r}; valid: {', '.join(AXES + DERIVED)}, world")
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
        """This rank's position along ``axis`` (an axis or a derived group; "world": the rank)."""
        return self._ranks[axis].index(self.rank)

