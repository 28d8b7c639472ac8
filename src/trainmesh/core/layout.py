"""The layout: its dimensions, the views that number the world's ranks, the named groups, and
:class:`Layout`, the one value that holds a layout's degrees.

**Dimensions** (:data:`DIMS`). ``tp``, ``cp``, ``dp``, ``pp`` are the world's four axes (world =
their product); ``ep`` and ``dp_shard`` are set by flags too and factor other dimensions;
``dp_replicate = dp / dp_shard`` and ``edp = dp·cp / ep`` are derived.

**Views** (:data:`VIEWS`): factorisations of the same world, fastest dimension first; a rank's
coordinates in a view are its mixed-radix digits. ``dense`` is the rank layout itself::

    rank = ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i                       dense  (tp, cp, dp, pp)
    dp_i = dp_replicate_i·dp_shard + dp_shard_i                          hsdp   (tp, cp, dp_shard, dp_replicate, pp)
    dp_i·cp + cp_i = edp_i·ep + ep_i   (the dp × cp line cut in runs)    expert (tp, ep, edp, pp)

so the dimensions views share (tp, pp, and the dp × cp line) number the ranks alike: a TP group
is a run of consecutive ranks (inside one node), CP next, DP after, PP outermost.

**Groups** (:data:`GROUPS`, named by :class:`Group`): the ranks that differ only in some
dimensions of one view. The mesh (:class:`~trainmesh.core.mesh.ParallelMesh`), the config, the
planner and the observers read ranks, coordinates, groups and the world size from a
:class:`Layout`, and print its degrees with :meth:`Layout.describe`.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

try:
    from enum import StrEnum
except ImportError:   # Python 3.10
    class StrEnum(str, Enum):  # type: ignore[no-redef]
        """A str that is an enum member (Python 3.11's ``enum.StrEnum``)."""

        def __str__(self) -> str:
            return str(self.value)


class Group(StrEnum):
    """The name of a mesh axis or a group derived from the axes: a typo is an AttributeError
    where it is written, not a KeyError deep in a run. Members are strs (``Group.dp == "dp"``),
    so metrics keyed by them read as before."""

    pp = "pp"
    dp = "dp"
    cp = "cp"
    tp = "tp"
    dp_cp = "dp_cp"
    """The ranks holding replicas of the dense parameters, each with other tokens (dp x cp)."""
    ep = "ep"
    """Expert parallelism: runs of ep ranks of the dp x cp line."""
    edp = "edp"
    """The ranks holding the same experts (dp x cp / ep)."""
    dp_shard = "dp_shard"
    """HSDP: ZeRO's shard group."""
    dp_replicate = "dp_replicate"
    """HSDP: the replicas of a shard."""
    dp_shard_cp = "dp_shard_cp"
    """HSDP under cp: ZeRO's shard group over dp_shard x cp."""
    world = "world"

    @classmethod
    def named(cls, name: str) -> Group:
        """The group called ``name``; KeyError naming the valid ones for any other."""
        try:
            return cls(name)
        except ValueError:
            raise KeyError(f"unknown mesh group {name!r}; valid: "
                           f"{', '.join(g.value for g in cls)}") from None


AXES = (Group.pp, Group.dp, Group.cp, Group.tp)
"""The world's axes, outermost first."""
COORDS = ("dp", "pp", "tp", "cp")
"""A rank's coordinates on the four axes, in the order the metrics summary records them."""


# ---------------------------------------------------------------- dimensions


@dataclass(frozen=True)
class Dim:
    """One dimension: its flag (None: derived), what it splits, its degree in a layout, and the
    degrees a planner may try (``choices(n)``, ``n`` the size it must divide, ``divides``: the
    world for the four axes, dp·cp for ep, dp for dp_shard; None: derived from the others)."""

    name: str
    flag: str | None
    help: str
    value: Callable[[Layout], int]
    choices: Callable[[int], list[int]] | None = None
    divides: str | None = None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


DIMS: tuple[Dim, ...] = (
    Dim("tp", "--tp", "each layer's matrices split over tp ranks", lambda d: d.tp, _divisors,
        "world"),
    Dim("cp", "--cp", "each sequence split over cp ranks (attention over the ring)",
        lambda d: d.cp, _divisors, "world"),
    Dim("dp", "--dp", "replicas, each with a slice of the global batch", lambda d: d.dp,
        _divisors, "world"),
    Dim("pp", "--pp", "pipeline stages the layers are split into", lambda d: d.pp, _divisors,
        "world"),
    Dim("ep", "--ep", "each MoE layer's experts spread over ep ranks of the dp x cp line",
        lambda d: d.ep, _divisors, "dp*cp"),
    Dim("dp_shard", "--dp-shard", "HSDP: ZeRO shards over runs of dp_shard dp ranks",
        lambda d: d.dp_shard, _divisors, "dp"),
    Dim("dp_replicate", None, "HSDP: the replicas of a shard, dp / dp_shard",
        lambda d: d.dp // d.dp_shard),
    Dim("edp", None, "the ranks holding the same experts, dp x cp / ep",
        lambda d: d.dp * d.cp // d.ep),
)
DIM = {d.name: d for d in DIMS}

VIEWS: dict[str, tuple[str, ...]] = {
    "dense": ("tp", "cp", "dp", "pp"),
    "hsdp": ("tp", "cp", "dp_shard", "dp_replicate", "pp"),
    "expert": ("tp", "ep", "edp", "pp"),
}
"""Factorisations of the world, fastest dimension first (module docstring)."""

GROUPS: dict[Group, tuple[str, tuple[str, ...]]] = {
    Group.pp: ("dense", ("pp",)),
    Group.dp: ("dense", ("dp",)),
    Group.cp: ("dense", ("cp",)),
    Group.tp: ("dense", ("tp",)),
    Group.dp_cp: ("dense", ("cp", "dp")),
    Group.ep: ("expert", ("ep",)),
    Group.edp: ("expert", ("edp",)),
    Group.dp_shard: ("hsdp", ("dp_shard",)),
    Group.dp_replicate: ("hsdp", ("dp_replicate",)),
    Group.dp_shard_cp: ("hsdp", ("cp", "dp_shard")),
}
"""Named groups but ``world``: (view, dimensions in view order); the ranks differing only in
those. The mesh creates them in this order."""

MESH_AXES = ("dp", "cp", "pp", "tp")
"""The axes as a layout is read and printed (:meth:`Layout.describe`)."""


# ---------------------------------------------------------------- the value


@dataclass(frozen=True)
class Layout:
    """The degrees of one layout, and everything derived from them: the world size, each rank's
    coordinates, the named groups. Not validated here: the axis table's ``check_degrees`` does
    that (naming the flag) before a layout is used."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    """Expert-parallel degree: divides dp * cp."""
    dp_shard: int = None  # type: ignore[assignment]
    """HSDP: ZeRO's shard group size, dividing dp. Left unset (None) it is dp, plain ZeRO:
    decided here and nowhere else."""

    def __post_init__(self) -> None:
        if self.dp_shard is None:
            object.__setattr__(self, "dp_shard", self.dp)

    @classmethod
    def of(cls, obj: Any) -> Layout:
        """The layout of any object with the fields ``dp, pp, tp, cp, ep, dp_shard`` (a
        ``ParallelConfig``), or of a mapping such as the metrics summary's ``layout`` record
        (a degree it lacks is 1)."""
        if isinstance(obj, Layout):
            return obj
        names = [f.name for f in fields(cls)]
        if isinstance(obj, Mapping):
            return cls(**{k: obj.get(k, None if k == "dp_shard" else 1) for k in names})
        return cls(**{k: getattr(obj, k) for k in names})

    # -------------------------------------------------------------- degrees
    def degree(self, name: str) -> int:
        """The degree of dimension ``name`` (:data:`DIMS`)."""
        return DIM[name].value(self)

    @property
    def world(self) -> int:
        """Processes of the mesh: dp·cp·pp·tp."""
        return math.prod(self.degree(d) for d in VIEWS["dense"])

    @property
    def hsdp(self) -> bool:
        """ZeRO shards inside groups of dp_shard ranks, replicated across them."""
        return self.dp_shard < self.dp

    def as_dict(self) -> dict[str, int]:
        """``{"dp", "pp", "tp", "cp", "ep", "dp_shard"}`` (dp_shard resolved)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # -------------------------------------------------------------- ranks and coordinates
    def view_coords(self, view: str, rank: int) -> dict[str, int]:
        """``rank``'s mixed-radix digits in ``view`` (:data:`VIEWS`)."""
        out = {}
        for dim in VIEWS[view]:
            n = self.degree(dim)
            out[dim] = rank % n
            rank //= n
        return out

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates ``{"dp", "pp", "tp", "cp"}`` of a world rank in the dense view (and
        ``"ep"``, its place in its expert-parallel group, where ep > 1)."""
        dense = self.view_coords("dense", rank)
        out = {axis: dense[axis] for axis in COORDS}
        if self.ep > 1:
            out["ep"] = self.view_coords("expert", rank)["ep"]
        return out

    def rank_of(self, *, dp: int = 0, pp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """The world rank at these coordinates (the inverse of :meth:`coords`)."""
        at = {"dp": dp, "pp": pp, "tp": tp, "cp": cp}
        rank = 0
        for dim in reversed(VIEWS["dense"]):
            rank = rank * self.degree(dim) + at[dim]
        return rank

    # -------------------------------------------------------------- groups
    def members(self, group: Group | str) -> list[list[int]]:
        """Every group named ``group``: lists of world ranks, ascending (the mixed radix of the
        group's dimensions), ordered by their first rank."""
        group = Group.named(group)
        if group is Group.world:
            return [list(range(self.world))]
        view, dims = GROUPS[group]
        lines: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world):
            at = self.view_coords(view, rank)
            lines.setdefault(tuple(v for k, v in at.items() if k not in dims), []).append(rank)
        return sorted(lines.values())

    def group_of(self, group: Group | str, rank: int) -> list[int]:
        """The members of ``rank``'s group named ``group``."""
        return next(m for m in self.members(group) if rank in m)

    def size(self, group: Group | str) -> int:
        """Ranks in each group named ``group``."""
        group = Group.named(group)
        if group is Group.world:
            return self.world
        return math.prod(self.degree(d) for d in GROUPS[group][1])

    # -------------------------------------------------------------- text
    def describe(self, style: str = "words") -> str:
        """The degrees as one line, the one text form of a layout's degrees:

        * ``words``: ``dp 4 (shard 2 x replicate 2) x cp 1 x pp 1 x tp 1`` — the mesh axes,
          whose product is the world (the console, the report, the batch script);
        * ``flags``: ``dp=4 dp-shard=2 cp=1 pp=1 tp=1 ep=2`` — as flags would set them
          (dp-shard where it shards, ep where > 1; the planner's recommendation).
        """
        # a record read back from a file may hold anything: only a real shard is shown as one
        hsdp = isinstance(self.dp, int) and isinstance(self.dp_shard, int) and 0 < self.dp_shard < self.dp
        if style == "flags":
            parts = [f"dp={self.dp}", *([f"dp-shard={self.dp_shard}"] if hsdp else []),
                     *(f"{a}={getattr(self, a)}" for a in MESH_AXES[1:]),
                     *([f"ep={self.ep}"] if self.ep != 1 else [])]
            return " ".join(parts)
        if style != "words":
            raise ValueError(f"style must be words or flags; got {style!r}")
        parts = [f"{a} {getattr(self, a)}" for a in MESH_AXES]
        if hsdp:
            parts[0] += f" (shard {self.dp_shard} x replicate {self.dp // self.dp_shard})"
        return " x ".join(parts)
