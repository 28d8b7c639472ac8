"""One parameter server: a shard of the parameters and their optimizer, served over RPC.

A server keeps its shard as one flat buffer in float32 at least (:func:`flat_dtype`: a float64
model's in float64; the parameters are views into it, so a pull is one tensor) with a gradient buffer beside it, and an ordinary torch optimizer over the views.
Trainers call its static methods through ``rpc_async`` with the server's :class:`RRef`:

- sync: ``push`` adds a trainer's gradient (of its loss *sum*) and token count for a step; the
  future it returns completes once all trainers of the step have pushed, with the squared norm
  of this shard of the mean gradient (gradient sum / all tokens) and the global loss parts.
  ``update_and_pull`` (first caller of a step) clips by the coefficient the trainers computed
  from the global norm, steps the optimizer and LR schedule, and returns the new shard.
  Result: exactly the data-parallel step.
- async: ``push_pull`` applies one trainer's (already clipped, already averaged) gradient at
  once and returns the new shard (Hogwild); the LR schedule advances once per ``n_trainers``
  updates, so it follows the steps, not the pushes. Server 0 also keeps the step clock that
  bounds staleness (``tick`` / ``wait_clock``).
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from ..data_parallel.base import group_parameters

_LOCAL: dict[str, "ParameterServer"] = {}   # this process's server, the entry point of its RPCs


def local_server() -> "ParameterServer":
    """This process's server (called over ``rpc.remote`` to hand trainers an RRef to it)."""
    return _LOCAL["server"]


def flat_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The dtype a shard is held and sent in, by server and trainers alike: its parameters' in
    float32 at least (16-bit parameters get fp32 values and optimizer states, float64 ones keep
    theirs)."""
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors), torch.float32)


@dataclass
class _Round:
    """The gradients of one sync step arriving from the trainers."""
    arrived: int = 0
    loss_sum: float = 0.0
    tokens: float = 0.0
    done: Future = field(default_factory=Future)


class ParameterServer:
    """A shard of the parameters with its optimizer; see the module docstring for the protocol."""

    def __init__(self, *, n_trainers: int, mode: str,
                 optimizer: Callable[[Any], torch.optim.Optimizer],
                 param_groups: Callable[[str], dict] | None = None,
                 lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None) -> None:
        self.n_trainers, self.mode = n_trainers, mode
        self._factories = (optimizer, param_groups, lr_scheduler)
        self.lock = threading.Lock()
        self.flat = torch.zeros(0)
        self.grad = torch.zeros(0)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.applied = 0          # last step applied (sync) / updates applied (async)
        self.lr = 0.0             # LR of the last update
        self._rounds: dict[int, _Round] = {}
        self._done_steps = [0] * n_trainers   # the clock: last step each trainer finished
        self._waiters: list[tuple[int, Future]] = []

    def register(self) -> "ParameterServer":
        _LOCAL["server"] = self
        return self

    # ---------------------------------------------------------------- set-up
    @staticmethod
    def load(rref: rpc.RRef, named: list[tuple[str, torch.Tensor]]) -> int:
        """Take the shard's initial values (from trainer 0) and build the optimizer; returns bytes."""
        self = rref.local_value()
        with self.lock:
            dtype = flat_dtype(t for _, t in named)
            self.flat = torch.cat([t.detach().reshape(-1).to(dtype) for _, t in named])   # (Ψ_s,)
            self.grad = torch.zeros_like(self.flat)
            views, offset = [], 0
            for name, t in named:
                p = self.flat[offset: offset + t.numel()].view(t.shape)
                p.grad = self.grad[offset: offset + t.numel()].view(t.shape)
                views.append((name, p))
                offset += t.numel()
            make_opt, groups_of, make_sched = self._factories
            groups = group_parameters(views, groups_of)
            self.optimizer = make_opt([{**opts, "params": [p for _, p in ps]} for opts, ps in groups])
            self.scheduler = make_sched(self.optimizer) if make_sched else None
            self.lr = self.optimizer.param_groups[0]["lr"]
        return self.flat.numel() * self.flat.element_size()

    @staticmethod
    def pull(rref: rpc.RRef) -> torch.Tensor:
        self = rref.local_value()
        with self.lock:
            return self.flat.clone()

    @staticmethod
    def held_bytes(rref: rpc.RRef) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer states this server holds; its peak memory."""
        from trainmesh.observe.metrics import memory_peak
        self = rref.local_value()
        states = self.optimizer.state.values() if self.optimizer else []
        optim = sum(v.numel() * v.element_size() for st in states for v in st.values()
                    if torch.is_tensor(v) and v.dim() > 0)
        return {"params": self.flat.numel() * self.flat.element_size(),
                "grads": self.grad.numel() * self.grad.element_size(), "optimizer": optim,
                "peak_mem_bytes": memory_peak(torch.device("cpu"))}

    # ---------------------------------------------------------------- sync
    @staticmethod
    @rpc.functions.async_execution
    def push(rref: rpc.RRef, step: int, grad_sum: torch.Tensor, loss_sum: float,
             tokens: float) -> Future:
        """Add one trainer's gradient of step ``step``; completes when every trainer has."""
        self = rref.local_value()
        with self.lock:
            r = self._rounds.setdefault(step, _Round())
            if r.arrived == 0:
                self.grad.zero_()
            self.grad.add_(grad_sum)
            r.arrived, r.loss_sum, r.tokens = r.arrived + 1, r.loss_sum + loss_sum, r.tokens + tokens
            complete = r.arrived == self.n_trainers
            if complete:
                self.grad.div_(r.tokens)            # mean over every token of the global batch
                sq = torch.dot(self.grad.double(), self.grad.double()).item()
                del self._rounds[step]
        if complete:
            r.done.set_result((sq, r.loss_sum, r.tokens))
        return r.done

    @staticmethod
    def update_and_pull(rref: rpc.RRef, step: int, clip_coef: float) -> tuple[torch.Tensor, float]:
        """Apply step ``step`` once (clipped by ``clip_coef``); return the new shard and its LR."""
        self = rref.local_value()
        with self.lock:
            if self.applied < step:
                if clip_coef != 1.0:
                    self.grad.mul_(clip_coef)
                self._step(advance_schedule=True)
                self.applied = step
            return self.flat.clone(), self.lr

    # ---------------------------------------------------------------- async
    @staticmethod
    def push_pull(rref: rpc.RRef, grad_mean: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Apply one trainer's gradient at once (Hogwild); return the new shard and its LR."""
        self = rref.local_value()
        with self.lock:
            self.grad.copy_(grad_mean)
            self.applied += 1
            self._step(advance_schedule=self.applied % self.n_trainers == 0)
            return self.flat.clone(), self.lr

    @staticmethod
    def tick(rref: rpc.RRef, trainer: int, step: int) -> None:
        """Trainer ``trainer`` finished step ``step``: release waiters the slowest now allows."""
        self = rref.local_value()
        with self.lock:
            self._done_steps[trainer] = step
            slowest = min(self._done_steps)
            ready = [f for need, f in self._waiters if slowest >= need]
            self._waiters = [(need, f) for need, f in self._waiters if slowest < need]
        for f in ready:
            f.set_result(slowest)

    @staticmethod
    @rpc.functions.async_execution
    def wait_clock(rref: rpc.RRef, need: int) -> Future:
        """Completes (with the slowest trainer's finished step) once every trainer reached ``need``."""
        self = rref.local_value()
        fut: Future = Future()
        with self.lock:
            slowest = min(self._done_steps)
            if slowest < need:
                self._waiters.append((need, fut))
        if slowest >= need:
            fut.set_result(slowest)
        return fut

    def _step(self, *, advance_schedule: bool) -> None:
        assert self.optimizer is not None, "load the shard first"
        self.lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        if self.scheduler is not None and advance_schedule:
            self.scheduler.step()
