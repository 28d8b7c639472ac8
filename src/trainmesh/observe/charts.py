"""The report's charts: matplotlib figures as inline SVG, each data artist carrying an id.

Every function returns a :class:`Chart`: the SVG text (text kept as text, ids of matplotlib's
own elements prefixed by the chart's name so that several charts share one page without
clashing) and the plotted numbers by artist id, which the page embeds beside the picture
(``data-series``) so a reader or a test can check them against the metrics file.
"""
from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from typing import Any

SIZE = (6.4, 3.2)
"""Inches of one chart (a 60em column at the page's width)."""


@dataclass
class Chart:
    """One picture: ``svg`` (inline, no script) and ``data`` (artist id -> what it plots)."""

    name: str
    svg: str
    data: dict[str, Any] = field(default_factory=dict)


def _figure(rows: int = 1, height: float = SIZE[1]) -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(rows, 1, figsize=(SIZE[0], height), squeeze=False)


def _svg(fig: Any, name: str, keep: set[str]) -> str:
    """The figure as SVG text; every id not in ``keep`` (the data artists') becomes
    ``{name}-{id}`` along with the references to it."""
    import matplotlib.pyplot as plt
    buf = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": name}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    own = set(re.findall(r'\bid="([^"]+)"', text)) - keep
    if own:
        pattern = "|".join(re.escape(i) for i in sorted(own, key=len, reverse=True))
        text = re.sub(rf'(\bid="|#)({pattern})(?=["\)])', lambda m: f"{m.group(1)}{name}-{m.group(2)}",
                      text)
    return text


def curves(name: str, title: str, series: list[tuple[str, list[float], list[float], str]],
           ylabel: str, *, xlabel: str = "step") -> Chart:
    """Lines over steps: ``series`` of (label, xs, ys, artist id)."""
    fig, axes = _figure()
    ax = axes[0][0]
    data = {}
    for label, xs, ys, gid in series:
        (line,) = ax.plot(xs, ys, label=label, marker="." if len(xs) < 50 else None)
        line.set_gid(gid)
        data[gid] = {"x": list(xs), "y": list(ys)}
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.xaxis.get_major_locator().set_params(integer=True)
    steps = {x for _, xs, _, _ in series for x in xs}
    if len(steps) == 1:   # one step: a whole step either side, not fractions of one
        ax.set_xlim(min(steps) - 1, min(steps) + 1)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    return Chart(name, _svg(fig, name, set(data)), data)


def bars(name: str, title: str, labels: list[str], groups: dict[str, list[float]], gid: str,
         ylabel: str, *, xlabel: str | None = None, value_format: str = "{:,.3g}") -> Chart:
    """Grouped bars: one bar per label and group, its value written on it where there are
    few; each bar's id is ``{gid}-{group}-{label}`` (the first group's ``{gid}-{label}``)."""
    fig, axes = _figure()
    ax = axes[0][0]
    width = 0.8 / max(len(groups), 1)
    data = {}
    for g, (group, values) in enumerate(groups.items()):
        drawn = ax.bar([i + g * width for i in range(len(labels))], values, width, label=group)
        for label, bar, value in zip(labels, drawn, values):
            bar_id = f"{gid}-{label}" if g == 0 else f"{gid}-{group}-{label}"
            bar.set_gid(bar_id)
            data[bar_id] = value
        if len(labels) * len(groups) <= 16:
            ax.bar_label(drawn, fmt=value_format, fontsize=7)
    ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(labels))], labels)
    ax.set(title=title, ylabel=ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    if len(groups) > 1:
        ax.legend()
    return Chart(name, _svg(fig, name, set(data)), data)


def heatmap(name: str, title: str, values: list[list[float]], rows: list[str], cols: list[str],
            gid: str, *, xlabel: str, ylabel: str) -> Chart:
    """A table of numbers as colours, each cell written on it; ``data[gid]`` is the table."""
    height = max(1.6, 0.45 * len(rows) + 1.2)
    fig, axes = _figure(height=height)
    ax = axes[0][0]
    image = ax.imshow(values, aspect="auto", cmap="viridis")
    image.set_gid(gid)
    peak = max((v for row in values for v in row), default=0) or 1
    if len(rows) * len(cols) <= 400:
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:,.0f}", ha="center", va="center", fontsize=8,
                        color="black" if v > 0.6 * peak else "white")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    fig.colorbar(image, ax=ax, label="tokens")
    return Chart(name, _svg(fig, name, {gid}), {gid: values})


def replicas(name: str, xs: list[int], ys: list[int], events: list[dict[str, Any]]) -> Chart:
    """Replicas per committed step (a step line) with each quorum event marked where it
    happened: ``lost`` (red down triangle), ``joined`` (green up triangle), ``discarded``
    (black cross), each labelled with the stall it caused. ``events``: dicts with ``kind``,
    ``step``, ``replicas``, ``stall_s`` (or None) and ``who``."""
    fig, axes = _figure()
    ax = axes[0][0]
    data: dict[str, Any] = {}
    if xs:
        (line,) = ax.plot(xs, ys, drawstyle="steps-post", label="replicas", color="C0")
        line.set_gid("replicas-curve")
        data["replicas-curve"] = {"x": list(xs), "y": list(ys)}
    style = {"lost": ("v", "C3"), "joined": ("^", "C2"), "discarded": ("x", "black")}
    labelled = set()
    for i, e in enumerate(events):
        marker, color = style[e["kind"]]
        gid = f"{e['kind']}-{i}"
        (mark,) = ax.plot([e["step"]], [e["replicas"]], linestyle="none", marker=marker,
                          markersize=9, color=color,
                          label=e["kind"] if e["kind"] not in labelled else None)
        labelled.add(e["kind"])
        mark.set_gid(gid)
        data[gid] = {k: e[k] for k in ("kind", "step", "replicas", "stall_s", "who")}
        if e["stall_s"] is not None:
            ax.annotate(f"{e['stall_s']:.2f} s", (e["step"], e["replicas"]), fontsize=7,
                        textcoords="offset points", xytext=(4, -12 if e["kind"] == "lost" else 6))
    top = max([*ys, *(e["replicas"] for e in events), 1])
    ax.set_ylim(-0.1, top + 0.6)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set(title="replicas per step (stall of each event in seconds)", xlabel="step",
           ylabel="replicas")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return Chart(name, _svg(fig, name, set(data)), data)
