"""ZeRO-Offload: this rank's fp32 master shards and optimizer states off the compute device,
the optimizer step on the CPU (Ren et al. 2021, "ZeRO-Offload").

With ``--offload cpu`` the optimizer a ZeRO stage builds is built over *host* fp32 masters of
this rank's flat shards (pinned memory when the device is a GPU), so its states are born on the
host too. Each step::

    host_grad = grad_shard.to(host, fp32) * scale   # the reduced shard, unscaled on the host
    optimizer.step()                               # on the host masters (foreach kernels)
    param_shard.copy_(host_master)                 # 16-bit or fp32; then ZeRO-1/2 all-gather

On a GPU the gradient copies are issued on a side stream with ``non_blocking`` as soon as the
reductions of the step are done (:meth:`HostMaster.prefetch_grads`), so they overlap the
gradient-norm reduction; the step waits for them. On a CPU the host *is* the device: a master
whose values already sit in the parameters (fp32, host-resident shards) is the parameter shard
itself, so nothing is copied and the offloaded bytes are the optimizer states alone (8Ψ/N with
AdamW); in mixed precision the masters are separate (12Ψ/N).

``--offload nvme`` keeps the same host objects but swaps the states and the separate masters
out to one file per rank between steps (:mod:`.nvme`). What the rank keeps off the compute
device is measured from those tensors and that file (:meth:`HostMaster.offloaded_bytes`).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch import nn

from ..metrics import storage_bytes

HOST = torch.device("cpu")


class StateStore(Protocol):
    """Where the optimizer states live between steps: host memory, or files (:mod:`.nvme`)."""

    def register(self, masters: list[nn.Parameter]) -> None:
        """``masters`` are copies of the parameters: the store keeps them with the states."""

    def step(self, optimizer: torch.optim.Optimizer, before_group: Any, after_group: Any) -> None:
        """Run ``optimizer.step()``, calling ``before_group(group)`` once a group's masters are
        in host memory and ``after_group(group)`` once it is updated."""

    def resident(self, optimizer: torch.optim.Optimizer) -> Any:
        """A context in which every state and master is in host memory (checkpoints)."""

    def file_bytes(self) -> int:
        """Bytes of the files the store holds (0 in host memory)."""


class HostStore:
    """``--offload cpu``: the states stay in host memory; the step is the optimizer's own."""

    def register(self, masters: list[nn.Parameter]) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer, before_group: Any, after_group: Any) -> None:
        for group in optimizer.param_groups:
            before_group(group)
        optimizer.step()
        for group in optimizer.param_groups:
            after_group(group)

    def resident(self, optimizer: torch.optim.Optimizer) -> Any:
        return nullcontext()

    def file_bytes(self) -> int:
        return 0


def host_copy(t: torch.Tensor, *, pin: bool) -> torch.Tensor:
    """A contiguous fp32 host copy of ``t`` (pinned: page-locked, for async GPU copies)."""
    out = torch.empty(t.shape, dtype=torch.float32, pin_memory=pin)
    out.copy_(t, non_blocking=pin)
    return out


class HostMaster:
    """fp32 ``masters`` on the host (what the optimizer updates) of the device parameter shards
    ``lows`` (16-bit or fp32, same shapes), whose reduced gradients are ``grads`` (on the
    device). Stands where :class:`~.master.MasterWeights` stands for the ZeRO stages: the
    gradient factors are deferred into ``scale`` and applied on the host."""

    def __init__(self, values: list[nn.Parameter], lows: list[torch.Tensor],
                 grads: list[torch.Tensor], *, store: StateStore, device: torch.device) -> None:
        self.pin = device.type == "cuda"
        self.lows, self.grads, self.store = lows, grads, store
        self.masters: list[nn.Parameter] = []
        self.aliased: list[bool] = []       # the master is the parameter shard itself (CPU, fp32)
        for v, low in zip(values, lows):
            if v.device.type == "cpu" and v.dtype == torch.float32:
                master = v
            else:
                master = nn.Parameter(host_copy(v.detach(), pin=self.pin))
            self.masters.append(master)
            self.aliased.append(master.data_ptr() == low.data_ptr() and master.dtype == low.dtype)
        self._index = {id(m): i for i, m in enumerate(self.masters)}
        store.register(self.separate_masters)
        self.scale = 1.0
        """The factor the device gradients still have to be multiplied by."""
        self._host_grads: list[torch.Tensor] | None = None
        self._copied: torch.cuda.Event | None = None

    @property
    def separate_masters(self) -> list[nn.Parameter]:
        """Masters that are copies of the parameters (what a file store swaps out too)."""
        return [m for m, a in zip(self.masters, self.aliased) if not a]

    def prefetch_grads(self) -> None:
        """Start copying the reduced gradient shards to the host (a side stream on a GPU)."""
        if self._host_grads is not None:
            return
        if not self.pin:
            self._host_grads = [g.detach().to(HOST, torch.float32, copy=True) for g in self.grads]
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._host_grads = [host_copy(g.detach(), pin=True) for g in self.grads]
            self._copied = torch.cuda.Event()
            self._copied.record(stream)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients into the host masters, step them on the CPU, copy them back
        into the device shards (group by group: a file store swaps states around each)."""
        self.prefetch_grads()
        if self._copied is not None:
            self._copied.synchronize()
        self.store.step(optimizer, self._before_group, self._after_group)
        self._host_grads, self._copied = None, None
        self.scale = 1.0

    def _before_group(self, group: dict) -> None:
        for p in group["params"]:
            i = self._index.get(id(p))
            if i is not None:
                p.grad = self._host_grads[i].view_as(p).mul_(self.scale)

    def _after_group(self, group: dict) -> None:
        for p in group["params"]:
            i = self._index.get(id(p))
            if i is not None:
                p.grad = None
                self._copy_back(i)

    def discard_grads(self) -> None:
        """A skipped step: drop the host copies of its gradients."""
        self._host_grads, self._copied = None, None

    @torch.no_grad()
    def _copy_back(self, i: int) -> None:
        if not self.aliased[i]:
            self.lows[i].copy_(self.masters[i], non_blocking=self.pin)

    def copy_to_params(self) -> None:
        """Cast the masters into the device parameter shards (after a checkpoint load)."""
        for i in range(len(self.masters)):
            self._copy_back(i)

    @contextmanager
    def resident(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Every master and state in host memory for the duration (checkpoints)."""
        with self.store.resident(optimizer):
            yield

    def offloaded_bytes(self, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        """Model-state bytes this rank keeps off the compute device, measured: host masters
        (not the parameters themselves) and host-resident states; the store's files."""
        states = [t for st in (optimizer.state.values() if optimizer else [])
                  for t in st.values() if torch.is_tensor(t)]
        return {"cpu": storage_bytes([*self.separate_masters, *states]),
                "nvme": self.store.file_bytes()}


def make_store(kind: str, *, directory: str | None, rank: int) -> StateStore:
    """The state store of ``--offload kind``."""
    if kind == "cpu":
        return HostStore()
    from .nvme import NvmeStore
    return NvmeStore(directory, rank=rank)
