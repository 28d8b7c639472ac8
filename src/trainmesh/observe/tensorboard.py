"""TensorBoard scalars of a run (``--tensorboard DIR``), written by rank 0 beside the JSONL.

Every record the metrics file gets reaches TensorBoard too (:meth:`TensorBoardLog.record`, the
metrics writer's listener), so the two hold the same numbers:

- a step: each number of the record under its own name (``loss``, ``grad_norm``, ``lr``,
  ``tokens_per_s``, ``mfu``, ``loss_scale``, ``replicas``, ...), a nested one under
  ``group/name`` (``moe/aux_loss``, ``moe/max_over_mean_load``); flags (``skipped``,
  ``outer``) and nulls are left out;
- an eval: ``eval/loss``; a save: ``save/blocking_s``, ``save/total_s``; a quorum change:
  ``quorum/replicas``, ``quorum/lost``, ``quorum/joined`` (counts), ``quorum/recovering_s``;
  a discarded step attempt: ``discarded/attempt_s``.

Besides: rank 0's resident memory (``memory/rank0_bytes``) and bytes sent per mesh axis
(``comm_bytes/<axis>``, from the ledger's window of the step) per step; at the end every rank's
peak memory (``memory/peak_bytes/rank<r>``); the layout in words as the text ``layout``. Uses
torch's :class:`~torch.utils.tensorboard.SummaryWriter` (the optional ``tensorboard`` package).
"""
from __future__ import annotations

import math
from typing import Any

from trainmesh.comm.ledger import METRICS_NAME
from trainmesh.core.errors import ConfigError
from trainmesh.observe.layout import layout_text

SKIPPED = ("event", "step")
"""Keys of a record that are not scalars of it."""


def require_tensorboard() -> None:
    """ConfigError naming --tensorboard unless the tensorboard package is importable."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError("--tensorboard", "needs the tensorboard package: "
                          "pip install 'trainmesh[tensorboard]'") from None


def scalars(record: dict[str, Any], prefix: str = "", *, top: bool = True) -> dict[str, float]:
    """The numbers of a record by tag (``prefix`` + name): nested records as ``group/name``,
    lists as their length (``quorum/lost``); booleans, nulls and non-finite values left out,
    and the record's own ``event`` and ``step``."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if top and key in SKIPPED:
            continue
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, tag + "/", top=False))
        elif isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value):
            out[tag] = float(len(value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[tag] = float(value)
    return out


class TensorBoardLog:
    """One SummaryWriter under ``logdir``; every method is a no-op where ``logdir`` is None
    (ranks other than 0). ``layout``: the summary's layout record, written as text."""

    def __init__(self, logdir: str | None, layout: dict[str, Any] | None = None) -> None:
        self.writer = None
        if logdir is not None:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=logdir)
            if layout is not None:
                self.writer.add_text("layout", layout_text(layout), 0)

    def record(self, rec: dict[str, Any]) -> None:
        """The scalars of one metrics record (module docstring), at its step."""
        step = rec.get("step")
        if self.writer is None or not isinstance(step, int) or rec.get("event") == "summary":
            return
        event = rec.get("event")
        prefix = "" if event == "step" else f"{event}/"
        for tag, value in scalars(rec, prefix).items():
            self.writer.add_scalar(tag, value, step)

    def traffic(self, step: int, window: dict[str, dict[str, Any]], memory: int) -> None:
        """Rank 0's memory and its bytes per mesh axis in ``window`` (the ledger's table of
        the step)."""
        if self.writer is None:
            return
        self.writer.add_scalar("memory/rank0_bytes", memory, step)
        for axis, ops in window.items():
            total = sum(s.bytes for s in ops.values())
            self.writer.add_scalar(f"comm_bytes/{METRICS_NAME.get(axis, axis)}", total, step)

    def close(self, summary: dict[str, Any]) -> None:
        """Every rank's peak memory at the last step; flush and close."""
        if self.writer is None:
            return
        for r in summary["ranks"]:
            if "peak_mem_bytes" in r:
                self.writer.add_scalar(f"memory/peak_bytes/rank{r['rank']}", r["peak_mem_bytes"],
                                       summary["steps"])
        self.writer.close()
