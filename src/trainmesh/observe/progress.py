"""Human output on rank 0: a progress bar on a terminal, log lines otherwise; the summary table."""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from trainmesh.observe.layout import (
    column_title,
    coord_cells,
    coord_columns,
    layout_text,
)

log = logging.getLogger("trainmesh")


class Progress:
    """``with Progress(total) as bar: bar.update(step, loss=...)``."""

    def __init__(self, total: int, *, enabled: bool = True, start: int = 0) -> None:
        self.total, self.enabled, self.start = total, enabled, start
        self.tty = enabled and sys.stdout.isatty()
        self.every = max(1, total // 10)
        self._bar = None

    def __enter__(self) -> Progress:
        if self.tty:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress
            self._bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self._bar.start()
            self._task = self._bar.add_task("train", total=self.total, completed=self.start, info="")
        return self

    def update(self, step: int, *, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        info = f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
        elif step == 1 or step % self.every == 0 or step == self.total:
            log.info("step %d/%d  %s", step, self.total, info)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


PREPARE_AFTER_S = 2.0
"""Preparation shorter than this shows nothing; longer, a line saying what and where, then its
progress (:class:`Preparing`)."""
PREPARE_EVERY_S = 5.0
"""Off a terminal, a progress line at most this often."""
MIB = 2**20


class Preparing:
    """``with Preparing(what, total=bytes, cache=path) as work: work.advance(n)``: the progress
    of a data preparation (a :data:`trainmesh.data.prepare.Begin`), on stderr. Once it has taken
    ``after_s``: one line saying what is done and where the cache goes, then a bar on a terminal,
    else a line every ``every_s`` (done, of what total where known, rate, phase); at the end the
    time it took."""

    def __init__(self, what: str, *, total: int | None = None, cache: Any = None,
                 after_s: float | None = None, every_s: float | None = None) -> None:
        self.what, self.total, self.cache = what, total, cache
        self.after_s = PREPARE_AFTER_S if after_s is None else after_s
        self.every_s = PREPARE_EVERY_S if every_s is None else every_s
        self.done, self.info, self.shown, self._bar = 0, "", False, None
        self.t0 = self.last = time.monotonic()

    def __enter__(self) -> Preparing:
        self.t0 = self.last = time.monotonic()
        return self

    def advance(self, n: int) -> None:
        self.done += n
        self._show()

    def phase(self, text: str) -> None:
        self.info = text
        self._show(now=True)

    def _show(self, *, now: bool = False) -> None:
        elapsed = time.monotonic() - self.t0
        if not self.shown:
            if elapsed < self.after_s:
                return
            self._start()
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, info=self.info)
        elif now or time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            _say(f"{self.what}: {self._amount(elapsed)}{f'; {self.info}' if self.info else ''}")

    def _amount(self, elapsed: float) -> str:
        done = f"{self.done / MIB:,.1f}"
        rate = f"{self.done / MIB / elapsed:,.1f} MiB/s" if elapsed > 0 else ""
        if self.total:
            pct = min(100, 100 * self.done // self.total)
            return f"{pct}% ({done} of {self.total / MIB:,.1f} MiB), {rate}"
        return f"{done} MiB, {rate}"

    def _start(self) -> None:
        self.shown = True
        _say(f"{self.what}{f'; cache: {self.cache}' if self.cache else ''}")
        if sys.stderr.isatty():
            from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress
            self._bar = RichProgress(TextColumn("preparing"), BarColumn(), DownloadColumn(binary_units=True),
                                     TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                     console=console(sys.stderr))
            self._bar.start()
            self._task = self._bar.add_task("preparing", total=self.total, info="")

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
        if self.shown and exc_type is None:
            _say(f"{self.what}: done, {self.done / MIB:,.1f} MiB in {time.monotonic() - self.t0:.1f} s")


def preparing(what: str, *, total: int | None = None, cache: Any = None) -> Preparing:
    """A :data:`trainmesh.data.prepare.Begin` that shows the work (:class:`Preparing`)."""
    return Preparing(what, total=total, cache=cache)


def _say(line: str) -> None:
    sys.stderr.write(f"trainmesh: {line}\n")
    sys.stderr.flush()


WIDE = 200
"""Columns of a table written to a pipe or file (no terminal to measure, COLUMNS unset)."""


def console(file: Any = None) -> Any:
    """A rich Console as wide as the terminal (or COLUMNS); a wide page when writing to a pipe,
    so tables are never cut there."""
    from rich.console import Console
    out = Console(file=file or sys.stdout, highlight=False)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(file=file or sys.stdout, width=WIDE, highlight=False)
    return out


def wide_table(title: str | None, columns: list[str], *, left: tuple[str, ...] = ("", "offload",
               "recompute", "comm bytes / step", "gpu"), compact: bool = False) -> Any:
    """A rich Table whose cells fold (never cut with an ellipsis) when the width is short;
    ``compact``: no vertical rules (a narrow terminal)."""
    from rich import box
    from rich.table import Table
    table = Table(title=title, box=box.SIMPLE_HEAD if compact else box.HEAVY_HEAD,
                  padding=(0, 1) if not compact else (0, 0, 0, 1), pad_edge=not compact)
    for name in columns:
        table.add_column(name, justify="left" if name in left else "right", overflow="fold")
    return table


def fmt_size(n: float) -> str:
    """Bytes as a size: 512 B, 3.2 KiB, 12.5 MiB, 1.50 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}" if unit != "GiB" else f"{n / scale:,.2f} {unit}"
    return f"{n:.0f} B"


def run_header(*, params: int, world: int, layout: dict[str, Any], steps: int, start: int,
               device: str) -> str:
    """One readable line saying what is about to run (not a dict repr)."""
    steps_text = f"steps {start}-{steps}" if start > 1 else f"{steps} steps"
    return (f"trainmesh: {params:,} params on {world} process{'es' if world > 1 else ''} "
            f"({device}): {layout_text(layout)}; {steps_text}")


def _sum_bytes(ops: Any) -> int | None:
    """Bytes of a ``{axis: {op: bytes}}`` (or ``{op: bytes}``) record; None if it holds none."""
    if not isinstance(ops, dict):
        return None
    total = 0
    for v in ops.values():
        inner = _sum_bytes(v) if isinstance(v, dict) else v
        if isinstance(inner, (int, float)) and not isinstance(inner, bool):
            total += inner
    return total


def _size(value: Any) -> str | None:
    return fmt_size(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _state(r: dict[str, Any], key: str) -> str | None:
    held = r.get("model_state_bytes")
    return _size(held.get(key)) if isinstance(held, dict) else None


def rank_table(summary: dict[str, Any], *, joined: bool = False) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of what every rank of a summary is, held and sent: its coordinate on
    every axis of the layout, role or replica, model state, offloaded bytes, peak memory,
    traffic per step, restarts. A column appears only where some rank has a value, so the
    ranks of every strategy (mesh, ps, diloco, fault-tolerant replicas) fit one table.
    ``joined``: the coordinates in one column (``dp/cp/pp/tp/ep``, a narrow terminal's)."""
    layout = summary.get("layout") if isinstance(summary.get("layout"), dict) else {}
    ranks = summary.get("ranks") if isinstance(summary.get("ranks"), list) else []
    ranks = [r for r in ranks if isinstance(r, dict)]
    coords = coord_columns(layout, ranks)
    offload = layout.get("offload", "none")

    def row(r: dict[str, Any]) -> list[Any]:
        placed = (coord_cells(r.get("coords"), coords, layout) if isinstance(r.get("coords"), dict)
                  else [None] * len(coords))
        return [r.get("rank"), r.get("role"), r.get("replica"), *placed,
                _state(r, "params"), _state(r, "grads"), _state(r, "optimizer"),
                _size(_sum_bytes(r.get("offloaded_bytes")) or None), _size(r.get("peak_mem_bytes")),
                _size(_sum_bytes(r.get("comm_bytes_per_step"))), r.get("restarts"), r.get("failed")]

    headers = ["rank", "role", "replica", *map(column_title, coords), "params", "grads",
               "optimizer", f"on {offload}" if offload != "none" else "offloaded", "peak memory",
               "comm/step", "restarts", "failed"]
    cells = [row(r) for r in ranks]
    if joined and coords:
        at = headers.index(column_title(coords[0]))
        headers[at:at + len(coords)] = ["/".join(map(column_title, coords))]
        cells = [c[:at] + [None if c[at] is None else "/".join(map(str, c[at:at + len(coords)]))]
                 + c[at + len(coords):] for c in cells]
    keep = [i for i in range(len(headers)) if any(c[i] is not None for c in cells)]
    return [headers[i] for i in keep], [["" if c[i] is None else str(c[i]) for i in keep] for c in cells]


def print_summary(summary: dict[str, Any], *, first_loss: float, first_step: int = 1,
                  wall_s: float | None = None, eval_loss: float | None = None) -> None:
    """A table of what every rank held and sent (:func:`rank_table`), the loss from the run's
    first step to its last (a resumed run: from the step it resumed at), the last eval loss
    and the wall time."""
    title = (f"trainmesh: {summary['params']:,} params, world {summary['world_size']}, loss "
             f"{first_loss:.4f} -> {summary['final_loss']:.4f} (from step {first_step})")
    if eval_loss is not None:
        title += f", eval loss {eval_loss:.4f}"
    out = console()
    left = ("", "role", "failed", "offloaded", f"on {summary['layout'].get('offload', 'none')}")
    for compact in (False, True, None):   # narrower: no rules, then the coordinates joined
        headers, rows = rank_table(summary, joined=compact is None)
        table = wide_table(None, headers, left=left, compact=compact is not False)
        for row in rows:
            table.add_row(*row)
        if out.measure(table, options=out.options.update_width(10**4)).maximum <= out.width:
            break
    out.print(title)
    out.print(f"layout: {layout_text(summary['layout'])}")
    out.print(table)
    if wall_s is not None:
        tps = summary.get("tokens_per_s") or 0.0
        out.print(f"trainmesh: done in {wall_s:.1f} s ({tps:,.0f} tokens/s)")


def print_outputs(paths: list[tuple[str, str]]) -> None:
    """One list, on stderr, of the files a run wrote: (what, path)."""
    if not paths:
        return
    width = max(len(what) for what, _ in paths)
    lines = [f"  {what:<{width}}  {path}" for what, path in paths]
    sys.stderr.write("trainmesh: wrote\n" + "\n".join(lines) + "\n")


def outputs_of(cfg: Any) -> list[tuple[str, str]]:
    """(what, path) of every file or directory a run of ``cfg`` writes."""
    named = (("metrics", cfg.metrics_out), ("checkpoints", cfg.save_dir), ("trace", cfg.trace_out),
             ("timeline", cfg.timeline_out), ("tensorboard", cfg.tensorboard))
    return [(what, os.path.abspath(path)) for what, path in named if path]
