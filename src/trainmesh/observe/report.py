"""One self-contained HTML page of a run from its metrics file (``trainmesh report``).

Charts are matplotlib SVG inlined in the page (no script, no external resource): loss (and
eval loss) and gradient norm per step, tokens/s, peak memory per rank (beside the planner's
prediction where the summary records one), and bytes per step per mesh axis. Each chart's
data artists carry ids (``loss-curve``, ``memory-bar-rank3``, ...) so a browser check can find
them.
"""
from __future__ import annotations

import html
import io
import json
from pathlib import Path
from typing import Any

from trainmesh.core.errors import ConfigError


def read_records(path: str) -> list[dict[str, Any]]:
    """The JSON lines of a metrics file; ConfigError naming RUN.jsonl if unreadable."""
    try:
        lines = Path(path).read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError("RUN.jsonl", f"cannot read metrics file {path!r}: {exc}") from None


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _curve(title: str, series: list[tuple[str, list[int], list[float], str]], ylabel: str) -> str:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    for label, xs, ys, gid in series:
        (line,) = ax.plot(xs, ys, label=label, marker="." if len(xs) < 50 else None)
        line.set_gid(gid)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    return _svg(fig)


def _bars(title: str, labels: list[str], groups: dict[str, list[float]], gid: str,
          ylabel: str) -> str:
    """Grouped bars: one bar per label and group; each bar's id is ``{gid}-{group}-{label}``
    (the first group's ``{gid}-{label}``)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    width = 0.8 / max(len(groups), 1)
    for g, (name, values) in enumerate(groups.items()):
        bars = ax.bar([i + g * width for i in range(len(labels))], values, width, label=name)
        for label, bar in zip(labels, bars):
            bar.set_gid(f"{gid}-{label}" if g == 0 else f"{gid}-{name}-{label}")
    ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(labels))], labels)
    ax.set(title=title, ylabel=ylabel)
    if len(groups) > 1:
        ax.legend()
    return _svg(fig)


def charts(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(heading, inline SVG) of every chart the records allow."""
    import matplotlib
    matplotlib.use("Agg")
    steps = [r for r in records if r.get("event") == "step"]
    evals = [r for r in records if r.get("event") == "eval"]
    summary = next((r for r in records if r.get("event") == "summary"), None)
    out = []
    if steps:
        xs = [r["step"] for r in steps]
        loss = [("train", xs, [r["loss"] for r in steps], "loss-curve")]
        if evals:
            loss.append(("eval", [r["step"] for r in evals], [r["loss"] for r in evals],
                         "eval-curve"))
        out.append(("Loss", _curve("loss", loss, "nats/token")))
        norms = [r["grad_norm"] for r in steps]
        speed = [r["tokens_per_s"] for r in steps]
        out.append(("Gradient norm", _curve("gradient norm",
                                            [("grad norm", xs, norms, "grad-norm-curve")], "L2")))
        out.append(("Throughput", _curve("tokens/s", [("tokens/s", xs, speed, "tokens-curve")],
                                         "tokens/s")))
    if summary and summary.get("ranks"):
        ranks = summary["ranks"]
        labels = [f"rank{r['rank']}" for r in ranks]
        mem = {"peak measured": [r["peak_mem_bytes"] / 2**20 for r in ranks]}
        if all("predicted_mem_bytes" in r for r in ranks):
            mem["planner prediction"] = [r["predicted_mem_bytes"] / 2**20 for r in ranks]
        out.append(("Memory per rank",
                    _bars("peak memory per rank", labels, mem, "memory-bar", "MiB")))
        axes = sorted({a for r in ranks for a in r["comm_bytes_per_step"]})
        per_axis = [sum(sum(r["comm_bytes_per_step"].get(a, {}).values()) for r in ranks) / 2**20
                    for a in axes]
        out.append(("Traffic per axis", _bars("bytes per step, all ranks", axes,
                                              {"bytes/step": per_axis}, "traffic-bar", "MiB")))
    return out


def _table(header: list[str] | None, rows: list[list[Any]]) -> str:
    head = ("<thead><tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
            + "</tr></thead>") if header else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table>{head}<tbody>{body}</tbody></table>"


def run_table(records: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The run in one two-column table: layout, size, steps, losses, throughput."""
    from trainmesh.observe.progress import layout_text
    steps = [r for r in records if r.get("event") == "step"]
    evals = [r for r in records if r.get("event") == "eval"]
    rows: list[list[Any]] = []
    if summary.get("layout"):
        rows.append(["layout", f"{layout_text(summary['layout'])} on {summary.get('world_size')} "
                               "processes"])
    if "params" in summary:
        rows.append(["parameters", f"{summary['params']:,}"])
    rows.append(["steps", f"{steps[0]['step']}-{steps[-1]['step']}"])
    rows.append(["loss", f"{steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}"])
    if evals:
        rows.append(["eval loss (last)", f"{evals[-1]['loss']:.4f} at step {evals[-1]['step']}"])
    if summary.get("tokens_per_s"):
        rows.append(["tokens/s", f"{summary['tokens_per_s']:,.0f}"])
    if summary.get("mfu") is not None:
        rows.append(["MFU", f"{summary['mfu']:.1%}"])
    return "<h2>Run</h2>" + _table(None, rows)


def ranks_table(summary: dict[str, Any]) -> str:
    """What every rank held and sent, as sizes."""
    from trainmesh.observe.progress import fmt_size
    if not summary.get("ranks"):
        return ""
    rows = []
    for r in summary["ranks"]:
        c, st = r["coords"], r["model_state_bytes"]
        comm = sum(b for ops in r["comm_bytes_per_step"].values() for b in ops.values())
        rows.append([r["rank"], f"{c['dp']}/{c['pp']}/{c['tp']}", fmt_size(st["params"]),
                     fmt_size(st["grads"]), fmt_size(st["optimizer"]),
                     fmt_size(r["peak_mem_bytes"]), fmt_size(comm)])
    return "<h2>Ranks</h2>" + _table(["rank", "dp/pp/tp", "params", "grads", "optimizer",
                                      "peak memory", "comm/step"], rows)


def write_report(run: str, out: str) -> Path:
    """The HTML page of metrics file ``run``, written to ``out``."""
    records = read_records(run)
    if not any(r.get("event") == "step" for r in records):
        raise ConfigError("RUN.jsonl", f"{run!r} has no step records (a --metrics-out file?)")
    summary = next((r for r in records if r.get("event") == "summary"), {})
    sections = "\n".join(f"<section><h2>{html.escape(h)}</h2>\n{svg}\n</section>"
                         for h, svg in charts(records))
    page = (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>trainmesh run {html.escape(Path(run).name)}</title>"
            "<style>body{font-family:sans-serif;max-width:60em;margin:auto}"
            "svg{max-width:100%;height:auto}table{border-collapse:collapse;margin:1em 0}"
            "th,td{border:1px solid #ccc;padding:.2em .6em;text-align:right}"
            "th:first-child,td:first-child{text-align:left}</style>"
            f"</head><body><h1>trainmesh run: {html.escape(Path(run).name)}</h1>"
            f"{run_table(records, summary)}\n{ranks_table(summary)}\n{sections}\n</body></html>\n")
    path = Path(out)
    path.write_text(page)
    return path
