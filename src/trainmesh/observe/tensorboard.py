"""TensorBoard scalars of a run (``--tensorboard DIR``), written by rank 0 beside the JSONL.

Per step: ``loss``, ``grad_norm``, ``lr``, ``tokens_per_s``, ``mfu`` and ``loss_scale`` where
the step record has them, rank 0's resident memory (``memory/rank0_bytes``) and its bytes sent
per mesh axis (``comm_bytes/<axis>``, from the ledger's window of the step); ``eval/loss`` with
``--eval-every``; at the end every rank's peak memory (``memory/peak_bytes/rank<r>``). Uses
torch's :class:`~torch.utils.tensorboard.SummaryWriter` (the optional ``tensorboard`` package).
"""
from __future__ import annotations

from typing import Any

from trainmesh.comm.ledger import METRICS_NAME
from trainmesh.core.errors import ConfigError

STEP_SCALARS = ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "loss_scale")
"""Step-record keys logged under their own name when present."""


def require_tensorboard() -> None:
    """ConfigError naming --tensorboard unless the tensorboard package is importable."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError("--tensorboard", "needs the tensorboard package: "
                          "pip install 'trainmesh[tensorboard]'") from None


class TensorBoardLog:
    """One SummaryWriter under ``logdir``; every method is a no-op on ranks other than 0."""

    def __init__(self, logdir: str | None) -> None:
        self.writer = None
        if logdir is not None:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=logdir)

    def step(self, row: dict[str, Any], window: dict[str, dict[str, Any]], memory: int) -> None:
        """Scalars of one step record; ``window`` is the ledger's table of the step."""
        if self.writer is None:
            return
        step = row["step"]
        for key in STEP_SCALARS:
            if isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool):
                self.writer.add_scalar(key, row[key], step)
        self.writer.add_scalar("memory/rank0_bytes", memory, step)
        for axis, ops in window.items():
            total = sum(s.bytes for s in ops.values())
            self.writer.add_scalar(f"comm_bytes/{METRICS_NAME.get(axis, axis)}", total, step)

    def eval(self, record: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.add_scalar("eval/loss", record["loss"], record["step"])

    def close(self, summary: dict[str, Any]) -> None:
        """Every rank's peak memory at the last step; flush and close."""
        if self.writer is None:
            return
        for r in summary["ranks"]:
            self.writer.add_scalar(f"memory/peak_bytes/rank{r['rank']}", r["peak_mem_bytes"],
                                   summary["steps"])
        self.writer.close()
