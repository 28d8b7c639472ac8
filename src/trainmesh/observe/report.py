"""One self-contained HTML page of a run from its metrics file (``trainmesh report``).

The page holds the run in a table (the layout in full, as the console names it:
:func:`~trainmesh.observe.layout.layout_text`), every rank's place, state, memory and traffic
(:func:`~trainmesh.observe.progress.rank_table`), and the charts the records allow, each only
where the run has its signal:

- loss per step with the eval loss on it; gradient norm; tokens/s;
- mixture of experts: the aux loss and the busiest expert's load over the mean per step, and
  the tokens each expert received per MoE layer (a heatmap);
- fault tolerance: replicas per step with the quorum events marked (replicas lost, joined,
  step attempts discarded) and the stall each caused, and the events as a table;
- saves: blocking and total seconds per save;
- peak memory per rank (beside the planner's prediction where recorded); bytes per step per
  mesh axis (dp, dp_shard, dp_replicate, cp, tp, pp, ep, ...: whatever axes the ranks record).

Charts are matplotlib SVG inlined in the page (no script, no external resource); each data
artist carries an id (``loss-curve``, ``memory-bar-rank3``, ``expert-heatmap``, ...) and each
figure the numbers it plots (``data-series``, JSON). A record the page cannot use (a line cut
short, a field missing or not a finite number, no summary) is left out with a note on the page;
a file with no step or summary record at all is refused (ConfigError naming RUN.jsonl).
"""
from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainmesh.core.errors import ConfigError
from trainmesh.observe import charts
from trainmesh.observe.charts import Chart
from trainmesh.observe.layout import layout_text

AXIS_ORDER = ("dp", "dp_cp", "dp_shard", "dp_replicate", "cp", "tp", "pp", "ep", "edp", "other", "ps")
"""Traffic bars in this order; axes not listed follow, sorted."""
FAULT_WORDS = {"failed_attempts": "step attempts discarded: {}",
               "degraded_steps": "steps with fewer replicas: {}",
               "recovery_s": "recovering: {:.3f} s", "state_transfer_s": "copying state: {:.3f} s"}
"""The summary's fault-tolerance figures in words; others as ``name: value``."""
STYLE = ("body{font-family:sans-serif;max-width:60em;margin:auto;padding:0 1em}"
         "svg{max-width:100%;height:auto}figure{margin:0}"
         "table{border-collapse:collapse;margin:1em 0}"
         "th,td{border:1px solid #ccc;padding:.2em .6em;text-align:right}"
         "th:first-child,td:first-child,table.run td,table.events :is(td,th){text-align:left}"
         ".note{color:#7a4b00}")


@dataclass
class Run:
    """The records of a metrics file by kind; ``steps``: one per step number (the newest record
    of a step written twice, as an elastic restart does), in step order."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    saves: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    """``quorum`` and ``discarded`` records, in the file's order."""
    summary: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """What the page leaves out, and why."""


def _num(value: Any) -> float | None:
    """A finite real number, else None (booleans are not numbers here)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return value
    return None


def _step(record: dict[str, Any]) -> int | None:
    s = record.get("step")
    return s if isinstance(s, int) and not isinstance(s, bool) else None


def _at(record: dict[str, Any], path: str) -> Any:
    """``record["moe"]["aux_loss"]`` for ``"moe.aux_loss"``; None where absent."""
    for key in path.split("."):
        if not isinstance(record, dict):
            return None
        record = record.get(key)
    return record


def _layout(run: Run) -> dict[str, Any]:
    layout = run.summary.get("layout")
    return layout if isinstance(layout, dict) else {}


def _ranks(summary: dict[str, Any]) -> list[dict[str, Any]]:
    ranks = summary.get("ranks")
    return [r for r in ranks if isinstance(r, dict)] if isinstance(ranks, list) else []


def series(records: list[dict[str, Any]], path: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records whose ``path`` is a finite number."""
    points = [(_step(r), _num(_at(r, path))) for r in records]
    kept = [(s, v) for s, v in points if s is not None and v is not None]
    return [s for s, _ in kept], [v for _, v in kept]


def read_run(path: str) -> Run:
    """The records of metrics file ``path``; ConfigError naming RUN.jsonl if it cannot be read
    or holds no step and no summary record."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("RUN.jsonl", f"cannot read metrics file {path!r}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    run, bad, by_step = Run(), [], {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            rec = None
        if not isinstance(rec, dict):
            bad.append(n)
            continue
        event = rec.get("event")
        if event == "summary":
            run.summary = rec
        elif _step(rec) is None:
            if event in ("step", "eval", "save", "quorum", "discarded"):
                bad.append(n)
        elif event == "step":
            by_step[_step(rec)] = rec
        else:
            {"eval": run.evals, "save": run.saves, "quorum": run.faults,
             "discarded": run.faults}.get(event, []).append(rec)
    run.steps = [by_step[s] for s in sorted(by_step)]
    if not run.steps and not run.summary:
        what = ("no JSON line" if bad and len(bad) == len([x for x in lines if x.strip()])
                else "no step or summary record" if bad or any(x.strip() for x in lines)
                else "nothing in it")
        raise ConfigError("RUN.jsonl", f"{path!r} has {what}; give the --metrics-out file of a run")
    if bad:
        where = f"line {bad[0]}" if len(bad) == 1 else f"{len(bad)} lines (first: line {bad[0]})"
        cut = " (the last line, cut short as a run stopped mid-write)" if bad == [len(lines)] else ""
        run.notes.append(f"{where} of the file could not be used{cut}: not a JSON object with an "
                         "integer step; left out")
    if not run.summary:
        run.notes.append("no summary record (the run stopped before its end?): the layout, the "
                         "rank table, memory and traffic are left out")
    elif not (isinstance(run.summary.get("layout"), dict)
              and isinstance(run.summary.get("ranks"), list)):
        run.notes.append("the summary record has no layout or no list of ranks: what it lacks is "
                         "left out")
    return run


def _missing(run: Run, path: str, what: str, chart: str) -> None:
    """A note where some step records lack ``path`` as a finite number."""
    xs, _ = series(run.steps, path)
    if 0 < len(xs) < len(run.steps):
        run.notes.append(f"{len(run.steps) - len(xs)} of {len(run.steps)} step records have no "
                         f"finite {what}; left out of the {chart} chart")


def training_charts(run: Run) -> list[tuple[str, Chart]]:
    """Loss (with eval), gradient norm, tokens/s."""
    out = []
    xs, ys = series(run.steps, "loss")
    loss = [("train", xs, ys, "loss-curve")] if xs else []
    ex, ey = series(run.evals, "loss")
    if ex:
        loss.append(("eval", ex, ey, "eval-curve"))
    _missing(run, "loss", "loss", "loss")
    if loss:
        out.append(("Loss", charts.curves("loss", "loss", loss, "nats/token")))
    elif run.steps:
        run.notes.append("no step record has a finite loss: the loss chart is left out")
    for key, heading, label, gid, unit in (("grad_norm", "Gradient norm", "gradient norm",
                                            "grad-norm-curve", "L2"),
                                           ("tokens_per_s", "Throughput", "tokens/s",
                                            "tokens-curve", "tokens/s")):
        xs, ys = series(run.steps, key)
        if xs:
            _missing(run, key, label, label)
            out.append((heading, charts.curves(gid.split("-curve")[0], label,
                                               [(label, xs, ys, gid)], unit)))
        elif run.steps and not (key == "grad_norm" and _layout(run).get("strategy") == "diloco"):
            run.notes.append(f"no step record has a finite {label}: its chart is left out")
    return out


def moe_charts(run: Run) -> list[tuple[str, Chart]]:
    """The aux loss and max/mean load per step; the tokens per expert per MoE layer."""
    out = []
    ax, ay = series(run.steps, "moe.aux_loss")
    lx, ly = series(run.steps, "moe.max_over_mean_load")
    experts = _num(_layout(run).get("experts")) or 0
    if ax or lx:
        out.append(("Expert load balance", charts.curves(
            "moe", "load balance (1 = balanced)",
            [s for s in (("aux loss", ax, ay, "moe-aux-curve"),
                         ("max / mean load", lx, ly, "moe-load-curve")) if s[1]], "ratio")))
    elif experts:
        run.notes.append("the layout has experts but no step records their load (moe): the "
                         "load-balance chart is left out")
    table = _at(run.summary, "moe.expert_tokens")
    if (isinstance(table, list) and table and all(isinstance(r, list) and r for r in table)
            and len({len(r) for r in table}) == 1
            and all(_num(v) is not None for r in table for v in r)):
        layers = [f"MoE layer {i}" for i in range(len(table))]
        out.append(("Tokens per expert", charts.heatmap(
            "experts", "tokens each expert received over the run", table, layers,
            [str(e) for e in range(len(table[0]))], "expert-heatmap", xlabel="expert",
            ylabel="")))
    elif experts and run.summary:
        run.notes.append("the summary has no expert token counts (moe.expert_tokens): the "
                         "expert heatmap is left out")
    return out


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 1] + "\u2026"


def fault_events(run: Run) -> list[dict[str, Any]]:
    """The quorum changes and discarded attempts as marks, in the order they happened: kind,
    step, replicas (of the new quorum; of the attempt discarded), stall, who, why."""
    events = []
    for rec in run.faults:
        common = {"step": _step(rec), "replicas": _num(rec.get("replicas")) or 0}
        if rec.get("event") == "discarded":
            events.append({"kind": "discarded", **common, "stall_s": _num(rec.get("attempt_s")),
                           "who": [], "why": _clip(str(rec.get("why", "")), 160)})
            continue
        for kind in ("lost", "joined"):
            who = rec.get(kind)
            if isinstance(who, list) and who:
                events.append({"kind": kind, **common, "who": who, "why": "",
                               "stall_s": _num(rec.get("recovering_s")) if kind == "lost" else None})
    return events


def fault_charts(run: Run) -> list[tuple[str, Any]]:
    """Replicas per step with the events marked, and the events as a table."""
    xs, ys = series(run.steps, "replicas")
    events = fault_events(run)
    ft = bool(_layout(run).get("fault_tolerant"))
    if not (xs or events):
        if ft:
            run.notes.append("fault-tolerant run without replica counts: the replicas chart is "
                             "left out")
        return []
    rows = [[e["step"], e["kind"], e["replicas"], ", ".join(map(str, e["who"])),
             "" if e["stall_s"] is None else f"{e['stall_s']:.3f}", e["why"]] for e in events]
    table = _table(["step", "event", "replicas", "replicas lost/joined", "stall (s)", "why"], rows,
                   cls="events")
    return [("Replicas", charts.replicas("replicas", xs, [int(y) for y in ys], events)),
            ("Quorum events", table if events else "<p>No replica was lost or joined.</p>")]


def save_charts(run: Run) -> list[tuple[str, Chart]]:
    """Blocking and total seconds per save."""
    saves = [s for s in run.saves if _num(s.get("total_s")) is not None]
    if not saves:
        return []
    labels = [str(_step(s)) for s in saves]
    groups = {"blocking": [_num(s.get("blocking_s")) or 0.0 for s in saves],
              "total": [_num(s["total_s"]) for s in saves]}
    return [("Saves", charts.bars("saves", "seconds per save (blocking: training waits)",
                                  labels, groups, "save-bar", "s", xlabel="step"))]


def rank_charts(run: Run) -> list[tuple[str, Chart]]:
    """Peak memory per rank and bytes per step per mesh axis, from the summary."""
    ranks = _ranks(run.summary)
    if not ranks:
        return []
    out = []
    measured = [r for r in ranks if _num(r.get("peak_mem_bytes")) is not None]
    if measured:
        labels = [f"rank{r.get('rank')}" for r in measured]
        mem = {"peak measured": [r["peak_mem_bytes"] / 2**20 for r in measured]}
        if all(_num(r.get("predicted_mem_bytes")) is not None for r in measured):
            mem["planner prediction"] = [r["predicted_mem_bytes"] / 2**20 for r in measured]
        out.append(("Memory per rank", charts.bars("memory", "peak memory per rank", labels, mem,
                                                   "memory-bar", "MiB")))
    else:
        run.notes.append("no rank records its peak memory (peak_mem_bytes): the memory chart is "
                         "left out")
    per_axis: dict[str, float] = {}
    for r in ranks:
        comm = r.get("comm_bytes_per_step")
        for axis, ops in (comm.items() if isinstance(comm, dict) else ()):
            per_axis[axis] = per_axis.get(axis, 0.0) + sum(
                v for v in (ops.values() if isinstance(ops, dict) else ()) if _num(v) is not None)
    axes = sorted((a for a in per_axis if per_axis[a] > 0),   # axes that moved bytes
                  key=lambda a: (AXIS_ORDER.index(a) if a in AXIS_ORDER else len(AXIS_ORDER), a))
    if axes:
        out.append(("Traffic per axis", charts.bars(
            "traffic", "bytes per step, all ranks", axes,
            {"bytes/step": [per_axis[a] / 2**20 for a in axes]}, "traffic-bar", "MiB")))
    else:
        run.notes.append("no rank records its traffic (comm_bytes_per_step): the traffic chart "
                         "is left out")
    return out


def _table(header: list[str] | None, rows: list[list[Any]], *, cls: str = "") -> str:
    head = ("<thead><tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
            + "</tr></thead>") if header else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}>{head}<tbody>{body}</tbody></table>"


def run_table(run: Run) -> str:
    """The run in one two-column table: layout, size, steps, losses, throughput, fault
    tolerance and saves in figures."""
    s, rows = run.summary, []
    if _layout(run):
        world = s.get("world_size")
        rows.append(["layout", layout_text(_layout(run))
                     + (f" on {world} processes" if isinstance(world, int) else "")])
    if _num(s.get("params")) is not None:
        rows.append(["parameters", f"{s['params']:,}"])
    if run.steps:
        rows.append(["steps", f"{_step(run.steps[0])}-{_step(run.steps[-1])}"])
    _, loss = series(run.steps, "loss")
    if loss:
        rows.append(["loss", f"{loss[0]:.4f} -> {loss[-1]:.4f}"])
    ex, ey = series(run.evals, "loss")
    if ex:
        rows.append(["eval loss (last)", f"{ey[-1]:.4f} at step {ex[-1]}"])
    if _num(s.get("tokens_per_s")):
        rows.append(["tokens/s", f"{s['tokens_per_s']:,.0f}"])
    if _num(s.get("mfu")) is not None:
        rows.append(["MFU", f"{s['mfu']:.1%}"])
    ft = s.get("fault_tolerance")
    if isinstance(ft, dict):
        rows.append(["fault tolerance", ", ".join(
            FAULT_WORDS.get(k, k.replace("_", " ") + ": {}").format(v)
            for k, v in ft.items() if _num(v) is not None)])
    if run.saves:
        blocking = sum(_num(x.get("blocking_s")) or 0.0 for x in run.saves)
        rows.append(["saves", f"{len(run.saves)}, training blocked {blocking:.3f} s in all"])
    return _table(None, rows, cls="run")


def _figure(chart: Chart) -> str:
    data = html.escape(json.dumps(chart.data, allow_nan=False), quote=True)
    return f'<figure id="chart-{chart.name}" data-series="{data}">\n{chart.svg}\n</figure>'


def render(run: Run, title: str) -> str:
    """The page of ``run`` (module docstring)."""
    from trainmesh.observe.progress import rank_table
    sections = [*training_charts(run), *moe_charts(run), *fault_charts(run), *save_charts(run),
                *rank_charts(run)]
    body = [f"<h1>trainmesh run: {html.escape(title)}</h1>", "<h2>Run</h2>", run_table(run)]
    if run.notes:
        body.append("<ul class=\"note\">" + "".join(f"<li>{html.escape(n)}</li>" for n in run.notes)
                    + "</ul>")
    headers, rows = rank_table(run.summary)
    if rows:
        body += ["<h2>Ranks</h2>", _table(headers, rows)]
    for heading, content in sections:
        inner = _figure(content) if isinstance(content, Chart) else content
        body.append(f"<section><h2>{html.escape(heading)}</h2>\n{inner}\n</section>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>trainmesh run {html.escape(title)}</title><style>{STYLE}</style></head>"
            "<body>" + "\n".join(body) + "\n</body></html>\n")


def write_report(run: str, out: str) -> Path:
    """The HTML page of metrics file ``run``, written to ``out``."""
    page = render(read_run(run), Path(run).name)
    path = Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)   # -o reports/run1.html: made as asked
        path.write_text(page)
    except OSError as exc:
        raise ConfigError("--out", f"cannot write {out!r}: {exc.strerror or exc}") from None
    return path
