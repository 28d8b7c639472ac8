"""ZeRO-Offload: this rank's fp32 master shards and optimizer states off the compute device,
the optimizer step on the CPU (Ren et al. 2021, "ZeRO-Offload").

With ``--offload cpu`` the optimizer a ZeRO stage builds is built over *host* fp32 masters of
this rank's flat shards (pinned memory when the device is a GPU), so its states are born on the
host too. Each step::

    host_grad[b] = grad_shard[b].to(host, fp32)    # in backward, as each bucket's reduction lands
    host_grad *= scale; optimizer.step()           # unscaled, stepped on the host masters
    param_shard.copy_(host_master)                 # 16-bit or fp32; then ZeRO-1/2 all-gather

The gradient shards stream to the host during backward: once a bucket's (ZeRO-1/2) or unit's
(ZeRO-3) reduction of the step's last microbatch has landed, its slice of the shard is final and
is copied into a host fp32 buffer (:meth:`HostMaster.stream`; on a GPU ``non_blocking`` into
pinned memory on a side stream, one event per copy, which the step waits on), overlapping the
rest of backward. Whatever did not stream (buckets reduced several times a step in a pipeline's
ZeRO-2) is copied once every reduction is done (:meth:`HostMaster.prefetch_grads`), so
correctness never depends on a hook. Under sequence parallelism the partial gradients are
completed over tp on the device once every reduction is done, and the shards holding them are
copied again before the step (:meth:`HostMaster.restream`). On a CPU the host *is* the device: a master whose values
already sit in the parameters (fp32, host-resident shards) is the parameter shard itself (no
copy), and the offloaded bytes are the optimizer states alone (8Ψ/N with AdamW); in mixed
precision the masters are separate (12Ψ/N), and the 16-bit gradient slices are converted into
the fp32 host buffers during backward.

``--offload nvme`` keeps the same host objects but swaps the states and the separate masters
out to one file per rank between steps (:mod:`.nvme`). What the rank keeps off the compute
device is measured from those tensors and that file (:meth:`HostMaster.offloaded_bytes`).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from trainmesh.observe.metrics import storage_bytes

HOST = torch.device("cpu")


class StateStore(Protocol):
    """Where the optimizer states live between steps: host memory, or files (:mod:`.nvme`)."""

    def register(self, masters: list[nn.Parameter]) -> None:
        """``masters`` are copies of the parameters: the store keeps them with the states."""

    def step(self, optimizer: torch.optim.Optimizer, before_group: Any, after_group: Any,
             run: Any) -> None:
        """Step the optimizer with ``run(optimizer)`` (in place of ``optimizer.step()``), calling
        ``before_group(group)`` once a group's masters are in host memory and
        ``after_group(group)`` once it is updated."""

    def resident(self, optimizer: torch.optim.Optimizer) -> Any:
        """A context in which every state and master is in host memory (checkpoints)."""

    def file_bytes(self) -> int:
        """Bytes of the files the store holds (0 in host memory)."""


class HostStore:
    """``--offload cpu``: the states stay in host memory; the step is the optimizer's own."""

    def register(self, masters: list[nn.Parameter]) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer, before_group: Any, after_group: Any,
             run: Any) -> None:
        for group in optimizer.param_groups:
            before_group(group)
        run(optimizer)
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


@dataclass
class StreamStats:
    """Elements of this rank's gradient shards on the host at two points of the last step."""

    total: int = 0
    in_backward: int = 0      # when backward returned (``finish`` began)
    by_step: int = 0          # when every reduction was done, before the rest was copied


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
        self.stats = StreamStats(total=sum(g.numel() for g in grads))
        """How much of the gradient shards was streamed to the host by when, in the last step."""
        self._host_grads: list[torch.Tensor | None] = []    # fp32, shaped like ``grads``
        self._copied: list[torch.cuda.Event] = []           # one per streamed copy (GPU)
        self._streamed: list[dict[Any, int]] = []           # per group: index -> elements
        self._all_on_host = False
        self._side: torch.cuda.Stream | None = None
        self.discard_grads()

    @property
    def separate_masters(self) -> list[nn.Parameter]:
        """Masters that are copies of the parameters (what a file store swaps out too)."""
        return [m for m, a in zip(self.masters, self.aliased) if not a]

    def stream(self, gi: int, index: int | slice) -> None:
        """Copy ``grads[gi][index]``, now final for the step, into its host buffer: on a GPU a
        ``non_blocking`` copy on the side stream (ordered after what the compute stream has
        issued, e.g. the reduction's accumulate), with an event the step waits on."""
        if self._host_grads[gi] is None:
            self._host_grads[gi] = torch.empty(self.grads[gi].shape, dtype=torch.float32, pin_memory=self.pin)
        src, dst = self.grads[gi].detach()[index], self._host_grads[gi][index]
        key = (index.start, index.stop) if isinstance(index, slice) else index
        self._streamed[gi][key] = src.numel()
        if not self.pin:   # host == device: the conversion to fp32 happens here, in backward
            dst.copy_(src)
            return
        if self._side is None:
            self._side = torch.cuda.Stream()
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._side)
        self._copied.append(event)

    def backward_done(self) -> None:
        """Backward has returned: note how much of the gradient shards is on the host already."""
        self.stats.in_backward = self._n_streamed()

    def _n_streamed(self) -> int:
        return sum(sum(s.values()) for s in self._streamed)

    def prefetch_grads(self) -> None:
        """Every reduction of the step is done: copy what was not streamed (a skipped or unused
        bucket, a pipeline's ZeRO-2 buckets), so correctness never depends on a hook."""
        if self._all_on_host:
            return
        self.stats.by_step = self._n_streamed()
        for gi, g in enumerate(self.grads):
            if sum(self._streamed[gi].values()) < g.numel():
                self._streamed[gi].clear()
                self.stream(gi, slice(None))
        self._all_on_host = True

    def restream(self, gi: int) -> None:
        """``grads[gi]`` changes on the device after it streamed (sequence parallelism sums its
        partial pieces over tp once every reduction is done): copy it again before the step."""
        self._stale.add(gi)

    def step(self, optimizer: torch.optim.Optimizer, *, run: Any = None) -> None:
        """Unscale the gradients into the host masters, step them on the CPU (``run(optimizer)``
        in place of ``optimizer.step()``: ZeRO's per-parameter step), copy them back into the
        device shards (group by group: a file store swaps states around each)."""
        self.prefetch_grads()
        for gi in sorted(self._stale):
            self.stream(gi, slice(None))
        for event in self._copied:
            event.synchronize()
        self.store.step(optimizer, self._before_group, self._after_group,
                        run if run is not None else _plain_step)
        self.discard_grads()
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
        """After a step, or a skipped one: drop the host copies of its gradients."""
        self._host_grads = [None] * len(self.grads)
        self._copied, self._all_on_host = [], False
        self._stale: set[int] = set()
        self._streamed = [{} for _ in self.grads]

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


def _plain_step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


def make_store(kind: str, *, directory: str | None, rank: int) -> StateStore:
    """The state store of ``--offload kind``."""
    if kind == "cpu":
        return HostStore()
    from .nvme import NvmeStore
    return NvmeStore(directory, rank=rank)
