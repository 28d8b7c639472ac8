"""A run's layout in words, and each rank's place in it: the one rendering behind the console's
first line, the summary's rank table, the HTML report and TensorBoard's text.

A layout is the metrics summary's ``layout`` record (docs/METRICS.md). Every mesh axis is named
with its degree (``dp 2 x cp 1 x pp 1 x tp 1``; HSDP's ``dp 4 (shard 2 x replicate 2)``: the
layout's own text, :meth:`~trainmesh.core.layout.Layout.describe`), then
the experts and ``ep``, the strategy (``ps``, ``diloco``), fault tolerance, ZeRO, microbatches,
the pipeline schedule, precision, recompute and offload. A key this module does not know is
shown as ``key value`` wherever it is set (not false, 0, 1 or "none"), so a new setting is
visible without a change here; a rank's coordinate on an unknown axis gets its own column.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainmesh.core.layout import MESH_AXES, Layout

COORD_ORDER = ("dp", "dp_shard", "dp_replicate", "cp", "pp", "tp", "ep")
"""The rank table's coordinate columns, in this order; unknown coordinates follow."""
KNOWN = {"dp", "cp", "pp", "tp", "ep", "dp_shard", "experts", "top_k", "zero", "microbatches",
         "schedule", "virtual_stages", "zero3_reshard", "sequence_parallel", "precision",
         "recompute", "recompute_segment", "offload", "offload_params", "strategy", "ps_servers",
         "ps_mode", "ps_staleness", "inner_steps", "outer_lr", "outer_momentum", "fault_tolerant",
         "replicas", "cp_comm", "allreduce", "min_dp", "reduce_dtype"}
UNSET = (None, False, 0, 1, "none", "")


def layout_record(cfg: Any) -> dict[str, Any]:
    """The summary's ``layout`` of a ``trainmesh train`` run (``cfg``: its TrainConfig): the
    parallel config's record, the experts (and top-k), cp's exchange, fault tolerance's replicas
    and the parameter server's settings where they apply."""
    p = cfg.parallel
    out = {**p.layout_record(), "experts": cfg.gpt_config().n_experts}
    if out["experts"]:
        out["top_k"] = cfg.gpt_config().top_k
    if p.cp > 1:
        out["cp_comm"] = p.cp_comm
    if p.fault_tolerant:
        out.update(fault_tolerant=True, replicas=p.replicas)
    if p.strategy == "ps":
        out.update(ps_servers=p.ps_servers, ps_mode=p.ps_mode, ps_staleness=p.ps_staleness)
    if p.allreduce != "native":
        out["allreduce"] = p.allreduce
    return out


def _int(value: Any, default: int = 1) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _plural(n: Any, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _axes(layout: Mapping[str, Any]) -> str:
    """``dp 4 (shard 2 x replicate 2) x cp 1 x pp 1 x tp 1`` (:meth:`Layout.describe`), or
    nothing for a record without mesh axes."""
    if not any(axis in layout for axis in MESH_AXES):
        return ""
    return Layout.of(layout).describe()


def layout_phrases(layout: Mapping[str, Any]) -> list[str]:
    """The layout as short phrases, most telling first (module docstring)."""
    L = layout
    strategy = L.get("strategy", "mesh")
    out: list[str] = []
    if strategy == "ps":
        staleness = L.get("ps_staleness")
        out.append(f"{_plural(L.get('dp', 1), 'trainer')} + {_plural(L.get('ps_servers', 1), 'server')}"
                   f", {L.get('ps_mode', 'sync')}"
                   + (f" (staleness {staleness})" if staleness is not None else ""))
    else:
        out.append(_axes(L))
    if _int(L.get("experts"), 0):
        top = f" (top {L['top_k']})" if "top_k" in L else ""
        out.append(f"{L['experts']} experts{top} on ep {L.get('ep', 1)}")
    elif _int(L.get("ep")) > 1:
        out.append(f"ep {L['ep']}")
    if strategy == "diloco":
        out.append(f"{_plural(L.get('inner_steps', '?'), 'inner step')}, outer lr "
                   f"{L.get('outer_lr', '?')}, outer momentum {L.get('outer_momentum', '?')}")
    if L.get("fault_tolerant"):
        out.append("fault-tolerant" + (f" ({L['replicas']} replicas)" if "replicas" in L else ""))
    if L.get("zero"):
        out.append(f"zero {L['zero']}")
    if _int(L.get("microbatches")) > 1:
        out.append(f"{L['microbatches']} microbatches")
    if _int(L.get("pp")) > 1:
        out.append(f"schedule {L.get('schedule', '?')}")
        if _int(L.get("virtual_stages")) > 1:
            out.append(f"{L['virtual_stages']} virtual stages")
    if L.get("zero3_reshard") not in (None, "step"):
        out.append(f"zero3-reshard {L['zero3_reshard']}")
    if _int(L.get("cp")) > 1 and L.get("cp_comm"):
        out.append(f"cp-comm {L['cp_comm']}")
    if L.get("sequence_parallel"):
        out.append("sequence parallel")
    if L.get("precision"):
        out.append(str(L["precision"]))
    if L.get("reduce_dtype"):
        out.append(f"reduce in {L['reduce_dtype']}")
    if L.get("recompute", "none") != "none":
        seg = _int(L.get("recompute_segment"))
        out.append(f"recompute {L['recompute']}" + (f" every {seg} layers" if seg > 1 else ""))
    if L.get("offload", "none") != "none":
        out.append(f"offload {L['offload']}" + (" (params too)" if L.get("offload_params") else ""))
    if L.get("allreduce", "native") != "native":
        out.append(f"allreduce {L['allreduce']}")
    if L.get("min_dp") is not None:
        out.append(f"min-dp {L['min_dp']}")
    for key, value in L.items():   # what this module does not know yet
        if key not in KNOWN and not isinstance(value, (dict, list)) and \
                (value is True or value not in UNSET):
            out.append(key.replace("_", "-") if value is True else f"{key.replace('_', '-')} {value}")
    return [p for p in out if p]


def layout_text(layout: Mapping[str, Any]) -> str:
    """The layout in one line: ``dp 2 x cp 1 x pp 1 x tp 1, 4 experts, top 2 on ep 2, fp32``;
    ``ps: ...`` and ``diloco: ...`` name their strategy first."""
    strategy = layout.get("strategy", "mesh")
    lead = f"{strategy}: " if strategy not in ("mesh", None) else ""
    return lead + ", ".join(layout_phrases(layout))


def coord_columns(layout: Mapping[str, Any], ranks: list[Mapping[str, Any]]) -> list[str]:
    """The coordinate columns of a rank table: every mesh axis of the layout, HSDP's shard and
    replicate indices, ``ep`` where the model has experts (or any rank records it), and any
    other coordinate a rank records."""
    have = {k for r in ranks if isinstance(r.get("coords"), Mapping) for k in r["coords"]}
    if not have:
        return []
    cols = [a for a in MESH_AXES if a in layout or a in have]
    shard = layout.get("dp_shard")
    if isinstance(shard, int) and 0 < shard < _int(layout.get("dp")):
        cols[1:1] = ["dp_shard", "dp_replicate"]
    if _int(layout.get("experts"), 0) or "ep" in have:
        cols.append("ep")
    cols += sorted(have - set(cols))
    return sorted(cols, key=lambda c: COORD_ORDER.index(c) if c in COORD_ORDER else len(COORD_ORDER))


def coord_cells(coords: Any, columns: list[str], layout: Mapping[str, Any]) -> list[str]:
    """One rank's coordinates under ``columns`` (:func:`coord_columns`); HSDP's shard index is
    ``dp % dp_shard`` and its replicate index ``dp // dp_shard``; a coordinate left out on an
    axis of degree 1 is 0."""
    coords = coords if isinstance(coords, Mapping) else {}
    shard, dp = layout.get("dp_shard"), coords.get("dp")
    out = []
    for col in columns:
        value = coords.get(col)
        if value is None and isinstance(dp, int) and isinstance(shard, int) and shard > 0:
            value = {"dp_shard": dp % shard, "dp_replicate": dp // shard}.get(col)
        if value is None and isinstance(dp, int) and _int(layout.get(col)) == 1:
            value = 0   # an axis of degree 1 (a record that leaves it out: ps, ep 1)
        out.append("-" if value is None else str(value))
    return out


def column_title(column: str) -> str:
    """``dp_shard`` -> ``dp-shard`` (the flag's spelling)."""
    return column.replace("_", "-")
