"""ParallelMesh: the (pp, dp, cp, tp) grid of ranks and one process group per axis.

World ranks are laid out with tp varying fastest, then cp, then dp, pp outermost::

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

so a TP group is a run of consecutive ranks (inside one node), CP next (its ring passes K/V
blocks every layer), DP after, PP outermost. With cp = 1 this is the (pp, dp, tp) layout.

Besides the four axes the mesh hands out groups derived from them (created only where they
differ from an axis, so a plain layout builds no extra group):

- ``dp_cp``: the DP and CP ranks together (same pp and tp), in (dp, cp) order. Replicated
  parameters' gradients are reduced over it: every rank of it holds different tokens.
- ``ep`` / ``edp``: expert parallelism splits ``dp_cp`` into runs of ``ep`` consecutive ranks.
  ``ep`` is this rank's run (the ranks a layer's experts are spread over, tokens exchanged by
  all-to-all); ``edp`` the ranks holding the same experts (one per run), over which expert
  gradients are reduced.
- ``dp_shard`` / ``dp_replicate``: HSDP splits ``dp`` into runs of ``dp_shard`` consecutive
  ranks; ZeRO shards over ``dp_shard`` and the shards are all-reduced over ``dp_replicate``.

The mesh is an explicit object — no module-level group state — so two meshes can live in one
process. Every rank of the world must build the same meshes in the same order (``new_group`` is
a collective call).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from trainmesh.core.errors import ConfigError

AXES = ("pp", "dp", "cp", "tp")
"""The mesh's axes, outermost first."""
DERIVED = ("dp_cp", "ep", "edp", "dp_shard", "dp_replicate")
"""Groups derived from the axes (see the module docstring)."""


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
        for name, value, whole in (("ep", self.ep, self.dp * self.cp), ("dp_shard", self.dp_shard, self.dp)):
            if not isinstance(value, int) or value < 1 or whole % value:
                raise ConfigError(name, f"must be a positive integer dividing {whole}; got {value!r}")
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
        # Every rank creates every group of every axis, in the same order (a collective call).
        for axis in AXES:
            if axis == "cp" and self.cp == 1:   # no group of one rank per rank for an unused axis
                self._groups[axis], self._ranks[axis] = None, [self.rank]
                continue
            for members in self._all_groups(axis):
                group = dist.new_group(members, timeout=timeout) if initialized else None
                if self.rank in members:
                    self._groups[axis], self._ranks[axis] = group, members
        for name in DERIVED:
            lists = self._derived_groups(name)
            if lists is None:          # the same ranks as an axis: that axis's group
                alias = {"dp_cp": "dp", "edp": "dp_cp", "dp_shard": "dp"}.get(name)
                self._groups[name] = self._groups.get(alias)
                self._ranks[name] = self._ranks[alias] if alias else [self.rank]
                continue
            for members in lists:
                group = dist.new_group(members, timeout=timeout) if initialized else None
                if self.rank in members:
                    self._groups[name], self._ranks[name] = group, members
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

    def _derived_groups(self, name: str) -> list[list[int]] | None:
        """Every group of a derived kind (module docstring), or None where it is an axis's."""
        if (name == "dp_cp" and self.cp == 1) or (name in ("ep", "edp") and self.ep == 1) \
                or (name in ("dp_shard", "dp_replicate") and self.dp_shard == self.dp):
            return None
        groups = []
        for pp_i in range(self.pp):
            for tp_i in range(self.tp):
                if name in ("dp_shard", "dp_replicate"):
                    for cp_i in range(self.cp):
                        line = [self.rank_of(pp=pp_i, tp=tp_i, cp=cp_i, dp=d) for d in range(self.dp)]
                        groups += _split(line, self.dp_shard, across=name == "dp_replicate")
                    continue
                line = [self.rank_of(pp=pp_i, tp=tp_i, dp=d, cp=c)
                        for d in range(self.dp) for c in range(self.cp)]
                groups += ([line] if name == "dp_cp" else _split(line, self.ep, across=name == "edp"))
        return groups

    def _all_groups(self, axis: str) -> list[list[int]]:
        """Every group of one axis: the ranks that differ only in that coordinate."""
        others = [a for a in AXES if a != axis]
        groups = []
        for fixed in itertools.product(*(range(getattr(self, a)) for a in others)):
            at = dict(zip(others, fixed))
            groups.append([self.rank_of(**{**at, axis: k}) for k in range(getattr(self, axis))])
        return groups

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


def _split(line: list[int], size: int, *, across: bool) -> list[list[int]]:
    """``line`` cut into runs of ``size`` consecutive ranks, or (``across``) the groups of ranks
    at the same place in every run."""
    runs = [line[i:i + size] for i in range(0, len(line), size)]
    return [list(col) for col in zip(*runs)] if across else runs
