"""Human output on rank 0: a progress bar on a terminal, log lines otherwise; the summary table."""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("trainmesh")


def timed_steps(train_step: Callable[[Any], float], batch_of: Callable[[int], Any], *, start: int,
                last: int, tokens: int, enabled: bool,
                before_step: Callable[[int], None] | None = None) -> Iterator[tuple[int, float, float, float]]:
    """The step loop of ``trainmesh train`` (every strategy): for steps ``start..last``, the
    batch of the step, ``before_step(step)``, one timed ``train_step``; yields (step, loss,
    start time, seconds) to the caller's bookkeeping, then advances the progress bar (rank 0,
    ``enabled``)."""
    with Progress(total=last, enabled=enabled, start=start - 1) as bar:
        for step in range(start, last + 1):
            batch = batch_of(step)
            if before_step is not None:
                before_step(step)
            t0 = time.perf_counter()
            loss = train_step(batch)
            dt = time.perf_counter() - t0
            yield step, loss, t0, dt
            bar.update(step, loss=loss, tokens_per_s=tokens / dt if dt > 0 else 0.0)


class Progress:
    """``with Progress(total) as bar: bar.update(step, loss=...)``."""

    def __init__(self, total: int, *, enabled: bool = True, start: int = 0) -> None:
        self.total, self.enabled, self.start = total, enabled, start
        self.tty = enabled and sys.stdout.isatty()
        self.every = max(1, total // 10)
        self._bar = None

    def __enter__(self) -> "Progress":
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
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

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def print_summary(summary: dict[str, Any], *, first_loss: float) -> None:
    """A table of what every rank held and sent, and the loss from first to last step."""
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"trainmesh: {summary['params']:,} params, world {summary['world_size']}, "
                        f"loss {first_loss:.4f} -> {summary['final_loss']:.4f}")
    offload = summary["layout"].get("offload", "none")
    cols = ["rank", "dp/pp/tp", "params MiB", "grads MiB", "optim MiB", "peak MiB", "comm MiB/step"]
    if offload != "none":
        cols.insert(5, f"{offload} MiB")
    for col in cols:
        table.add_column(col, justify="right")
    for r in summary["ranks"]:
        c, s = r["coords"], r["model_state_bytes"]
        comm = sum(b for ops in r["comm_bytes_per_step"].values() for b in ops.values())
        row = [str(r["rank"]), f"{c['dp']}/{c['pp']}/{c['tp']}", _mib(s["params"]), _mib(s["grads"]),
               _mib(s["optimizer"]), _mib(r["peak_mem_bytes"]), _mib(comm)]
        if offload != "none":
            row.insert(5, _mib(sum(r.get("offloaded_bytes", {}).values())))
        table.add_row(*row)
    Console(file=sys.stdout).print(table)
