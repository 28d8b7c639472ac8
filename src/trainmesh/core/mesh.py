"""ParallelMesh: one process group per named group of a :class:`~trainmesh.core.layout.Layout`.

World ranks are laid out with tp varying fastest, then cp, then dp, pp outermost (the layout's
dense view)::

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

Which groups exist and which ranks each holds is the layout's (:data:`~trainmesh.core.layout.GROUPS`,
named by :class:`~trainmesh.core.layout.Group`): besides the four axes, ``dp_cp`` (the ranks
holding replicas of the dense parameters, each with other tokens), ``ep`` / ``edp`` (expert
parallelism), ``dp_shard`` / ``dp_replicate`` / ``dp_shard_cp`` (HSDP), and ``world``. A group
whose member lists equal an earlier one's is that group (``dp_cp`` is ``dp`` when cp = 1), one
of single ranks is none (its collectives are no-ops).

The mesh is an explicit object — no module-level group state — so two meshes can live in one
process. Every rank of the world must build the same meshes in the same order (``new_group`` is
a collective call). :meth:`ParallelMesh.on_paper` is any rank's mesh without process groups.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from trainmesh.core.axes import check_degrees
from trainmesh.core.errors import ConfigError
from trainmesh.core.layout import AXES, GROUPS, Group, Layout

DERIVED = tuple(g for g in GROUPS if g not in AXES)
"""Groups derived from the axes (:data:`trainmesh.core.layout.GROUPS`)."""


TIMEOUT_S = 300.0
"""Seconds every collective may take by default (``--timeout``)."""


class ParallelMesh:
    """A layout validated against the world size once; groups handed out by :class:`Group`.

    ``ParallelMesh(layout)``, or ``ParallelMesh(dp=2, tp=2)``: the keywords are a
    :class:`Layout`'s. ``local``: a mesh of this process alone (one process), usable beside the
    job's mesh (references)."""

    def __init__(self, layout: Layout | None = None, *, timeout_s: float = TIMEOUT_S,
                 local: bool = False, **degrees: int | None) -> None:
        if layout is not None and degrees:
            raise TypeError("ParallelMesh takes a Layout or its degrees, not both")
        self.layout: Layout = check_degrees(Layout.of(layout) if layout is not None
                                            else Layout(**degrees))
        self.timeout_s = timeout_s
        self.local = local
        initialized = dist.is_available() and dist.is_initialized() and not local
        self._distributed = initialized
        self.world_size = dist.get_world_size() if initialized else 1
        self._place(dist.get_rank() if initialized else 0)
        if self.layout.world != self.world_size:
            L = self.layout
            raise ConfigError(
                "dp*cp*pp*tp",
                f"{L.dp}*{L.cp}*{L.pp}*{L.tp} = {L.world} must equal the "
                f"world size {self.world_size}")
        self._groups: dict[Group, object] = {}
        timeout = timedelta(seconds=self.timeout_s)
        built: dict[tuple[tuple[int, ...], ...], Group] = {}
        # Every rank creates every group, in the table's order (new_group is a collective call).
        for name in GROUPS:
            lists = self.layout.members(name)
            key = tuple(map(tuple, lists))
            if key in built:                      # the same ranks as an earlier group: that one
                self._groups[name] = self._groups[built[key]]
                continue
            built[key] = name
            self._groups[name] = None
            if len(self._ranks[name]) == 1:       # groups of one rank: no-op collectives
                continue
            for m in lists:
                group = dist.new_group(m, timeout=timeout) if initialized else None
                if self.rank in m:
                    self._groups[name] = group
        self._groups[Group.world] = (dist.new_group(self._ranks[Group.world], timeout=timeout)
                                     if initialized else None)

    @classmethod
    def on_paper(cls, layout: Layout, rank: int) -> ParallelMesh:
        """The mesh ``rank`` of ``layout`` would build, without process groups (every group is
        None): its coordinates and the members of each of its groups."""
        mesh = cls.__new__(cls)
        mesh.layout, mesh.timeout_s, mesh.local = check_degrees(layout), TIMEOUT_S, True
        mesh._distributed, mesh.world_size = False, mesh.layout.world
        mesh._place(rank)
        mesh._groups = dict.fromkeys(mesh._ranks)
        return mesh

    def _place(self, rank: int) -> None:
        """This rank's coordinates and the members of each of its groups, from the layout."""
        self.rank = rank
        self.coords: dict[str, int] = self.layout.coords(rank)
        self._ranks: dict[Group, list[int]] = {g: self.layout.group_of(g, rank) for g in Group}

    # ---------------------------------------------------------------- coordinates
    @property
    def shape(self) -> dict[str, int]:
        return {axis.value: self.layout.degree(axis) for axis in AXES}

    def coords_of(self, rank: int) -> dict[str, int]:
        """Coordinates of a world rank (:meth:`Layout.coords`)."""
        return self.layout.coords(rank)

    def rank_of(self, *, dp: int = 0, pp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """World rank at the given coordinates (:meth:`Layout.rank_of`)."""
        return self.layout.rank_of(dp=dp, pp=pp, tp=tp, cp=cp)

    # ---------------------------------------------------------------- groups
    def group(self, axis: Group | str):
        """The process group of this rank along ``axis`` (a :class:`Group`; any other name is
        a KeyError naming the valid ones)."""
        return self._groups[Group.named(axis)]

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

    def ranks(self, axis: Group | str) -> list[int]:
        """World ranks of this rank's group along ``axis``, in axis order."""
        return self._ranks[Group.named(axis)]

    def size(self, axis: Group | str) -> int:
        return len(self.ranks(axis))

    def index(self, axis: Group | str) -> int:
        """This rank's position along ``axis`` ("world": the rank)."""
        return self.ranks(axis).index(self.rank)

