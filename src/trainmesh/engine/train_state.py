"""The training state beside the tensors: the step count, each parameter group's learning rate,
the LR schedule's position, the fp16 loss scaler, the random number generators and the count of
non-finite steps in a row (``--on-nonfinite skip``).

One piece, saved and restored together: a checkpoint stores :meth:`TrainState.state_dict` as
its ``trainer`` record (JSON), and a fault-tolerant replica that rejoins takes the same record
from a peer with the live parameters (docs/FAULT_TOLERANCE.md). Records written before the
generators were part of it (no ``rng`` key) still load; the generators are then left as they
are. So do records without the non-finite count: it is then 0.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import torch

from trainmesh.core.compat import set_last_lr
from trainmesh.engine.precision import Precision


@dataclass
class TrainState:
    """What an optimizer step advances besides the parameters and optimizer moments."""

    optimizer: torch.optim.Optimizer
    lr_scheduler: Any | None
    """A ``LambdaLR``-style scheduler over ``optimizer`` (``last_epoch``, ``lr_lambdas``), or None."""
    precision: Precision
    """Holds the fp16 loss scaler (its scale and run of good steps)."""
    device: torch.device
    step: int = 0
    """Optimizer steps taken (a skipped fp16 step counts: the data moved on)."""
    nonfinite_run: int = 0
    """Non-finite steps in a row, each skipped (``--on-nonfinite skip``); 0 after a finite one.
    Part of the state, so that a replica that rejoins mid-run stops where its peers do."""

    def state_dict(self) -> dict[str, Any]:
        """A JSON-able record of the whole state."""
        state: dict[str, Any] = {"step": self.step, "nonfinite_run": self.nonfinite_run,
                                 "group_lrs": [g["lr"] for g in self.optimizer.param_groups],
                                 "precision": self.precision.state_dict(),
                                 "rng": _rng_state(self.device)}
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = {"last_epoch": self.lr_scheduler.last_epoch,
                                     "last_lr": self.lr_scheduler.get_last_lr()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a record of :meth:`state_dict` (or of a checkpoint written before the
        generators were saved)."""
        self.step = int(state["step"])
        self.nonfinite_run = int(state.get("nonfinite_run", 0))
        for group, lr in zip(self.optimizer.param_groups, state["group_lrs"]):
            group["lr"] = lr
        if self.lr_scheduler is not None and "lr_scheduler" in state:
            self.lr_scheduler.last_epoch = state["lr_scheduler"]["last_epoch"]
            set_last_lr(self.lr_scheduler, state["lr_scheduler"]["last_lr"])
        if "precision" in state:
            self.precision.load_state_dict(state["precision"])
        if "rng" in state:
            _set_rng_state(state["rng"], self.device)

    def apply_lr_schedule(self) -> None:
        """Set each group's learning rate from the schedule at its current position (after a
        load under a changed schedule: the next step follows this run's schedule)."""
        sched = self.lr_scheduler
        if sched is None:
            return
        for group, base, factor in zip(self.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * factor(sched.last_epoch)

    def advance(self, *, applied: bool) -> None:
        """One step done: the schedule moves on only when the optimizer stepped (a skipped
        fp16 step keeps its learning rate), the step count always."""
        if applied and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step += 1


def _rng_state(device: torch.device) -> dict[str, str]:
    state = {"cpu": _encode(torch.get_rng_state())}
    if device.type == "cuda":
        state["cuda"] = _encode(torch.cuda.get_rng_state(device))
    return state


def _set_rng_state(state: dict[str, str], device: torch.device) -> None:
    torch.set_rng_state(_decode(state["cpu"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_decode(state["cuda"]), device)


def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
