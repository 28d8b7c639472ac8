"""DDP: gradients in one flat buffer, all-reduced in buckets from autograd hooks during backward.

Every parameter's ``.grad`` is a view into one contiguous buffer laid out in reverse
registration order (the order gradients tend to become ready). The buffer is cut into buckets
of about ``bucket_mb``. A post-accumulate-grad hook gives each final gradient to the
:class:`~.buckets.Bucketer`, which launches a bucket's all-reduce asynchronously once it is
complete — in bucket order, so every rank issues the same sequence — overlapping the rest of
backward; :class:`~.inflight.Reductions` waits for them. With gradient accumulation only the
last microbatch's backward reduces (under a pipeline: a gradient's last backward of the step,
:class:`~.readiness.Readiness`). Gradients are summed, then scaled once.

Mixed precision (``options.param_dtype``): parameters and the gradient buffer are 16-bit, the
optimizer updates fp32 masters (:mod:`.master`): 2Ψ + 2Ψ + 12Ψ bytes with AdamW.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from trainmesh.core.dtypes import wide

from ..comm import Comm
from .base import CountedFn, GradSync, OptimizerFactory, SyncOptions, group_parameters
from .buckets import Bucket, Bucketer
from .master import MasterWeights


@dataclass
class FlatBucket(Bucket):
    """A stretch ``[start, end)`` of DDP's flat gradient buffer."""

    start: int = 0               # element offset in the flat buffer
    end: int = 0
    launched_at: float = 0.0
    ready_when_launched: int = 0  # how many params of the model were ready at launch (overlap proof)
    names: list[str] = field(default_factory=list)


class DDP(GradSync):
    """Plain data parallel with bucketed, overlapped gradient all-reduce."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], comm: Comm,
                 options: SyncOptions | None = None, *, allreduce: str = "native") -> None:
        super().__init__(named_params, comm, options)
        self.allreduce = allreduce   # comm/algorithms.py; the hand-built ones run synchronously
        params = [p for _, p in named_params]
        dtype = params[0].dtype if params else torch.float32
        device = params[0].device if params else torch.device("cpu")
        masters = self._to_low_precision(params)
        dtype = self.options.param_dtype if masters else dtype
        self._numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(0, dtype=dtype, device=device)   # (Ψ,) every gradient, once allocated
        self.buckets: list[FlatBucket] = []
        cap = max(1, int(self.options.bucket_mb * 2**20) // dtype.itemsize)
        offset, current = 0, None
        for name, p in reversed(named_params):
            if current is None or offset - current.start >= cap:
                current = FlatBucket(len(self.buckets), start=offset, end=offset)
                self.buckets.append(current)
            offset += p.numel()
            current.end = offset
            current.params.append(p)
            current.names.append(name)
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._sync = False
        self.bucketer = Bucketer(self.buckets, self._launch)
        self.reductions.max_inflight = len(self.buckets)   # every bucket may be in flight
        if masters:
            self.master = MasterWeights(masters, [p.data for p in params], [])
        self._master_of = dict(zip(map(id, params), masters))

    def _allocate_grads(self) -> None:
        """The gradient buffer and every ``param.grad`` view into it, at the first backward:
        set-up holds the model alone (the peak that sharded initialisation bounds)."""
        if self.buffer.numel() == self._numel:
            return
        self.buffer = torch.zeros(self._numel, dtype=self.buffer.dtype, device=self.buffer.device)
        for b in self.buckets:
            offset = b.start
            for p in b.params:
                p.grad = self.buffer[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        if self.master is not None:
            self.master.grads = [p.grad for _, p in self.named_params]

    @torch.no_grad()
    def _to_low_precision(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """Mixed precision: fp32 master copies of ``params``, which become 16-bit; else []."""
        low = self.options.param_dtype
        if low is None or not params or all(p.dtype == low for p in params):
            return []
        masters = [nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in params]
        for p in params:
            p.data = p.data.to(low)
        return masters

    def _opt_param(self, p: nn.Parameter) -> nn.Parameter:
        """What the optimizer updates for ``p``: its fp32 master (mixed precision) or ``p``."""
        return self._master_of.get(id(p), p)

    # ---------------------------------------------------------------- backward
    def before_backward(self, *, is_last: bool) -> None:
        self._allocate_grads()
        self._sync = is_last and self.dp > 1
        self.readiness.start()
        self.bucketer.arm()

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if self.readiness.final(p) and self._sync:
            self.bucketer.give(p)

    def _no_grad(self, p: nn.Parameter) -> None:
        if self.readiness.passed(p) and self._sync:   # its bucket holds zeros for it
            self.bucketer.give(p)

    def _launch(self, b: FlatBucket) -> None:
        """All-reduce bucket ``b`` asynchronously (cast to ``reduce_dtype`` first, if set)."""
        b.launched_at, b.ready_when_launched = time.perf_counter(), len(self.readiness.ready)
        grads = self.buffer[b.start : b.end]
        reduce_dtype = self.options.reduce_dtype
        staged = reduce_dtype is not None and reduce_dtype != grads.dtype
        buf = self.reductions.alloc(grads.numel(), reduce_dtype).copy_(grads) if staged else grads
        self.reductions.all_reduce(buf, grads, algorithm=self.allreduce, transient=staged)

    def finish(self, scale: float) -> None:
        if self._sync:
            self._check_unused()
            self.bucketer.flush()
            self.reductions.drain()
        self._scale(scale)

    # ---------------------------------------------------------------- step
    def build_optimizer(self, factory: OptimizerFactory, options=None) -> torch.optim.Optimizer:
        groups = group_parameters(self.named_params, options)
        if len(groups) == 1 and not groups[0][0]:
            self.optimizer = factory([self._opt_param(p) for _, p in groups[0][1]])
        else:
            self.optimizer = factory([{**opts, "params": [self._opt_param(p) for _, p in ps]}
                                      for opts, ps in groups])
        return self.optimizer

    def grad_sq_sum(self, counted: CountedFn) -> torch.Tensor:
        # DP replicas hold identical reduced gradients: only DP rank 0 contributes.
        # in float32 at least (a float64 model's norm in float64)
        total = torch.zeros((), dtype=wide(self.buffer.dtype), device=self.buffer.device)
        if self.comm.mesh.index(self.axis) != 0:
            return total
        params = [p for name, p in self.named_params if counted(name, p)]
        if len(params) == len(self.named_params):   # everything counts: one pass over the buffer
            flat = self.buffer.to(total.dtype)
            return torch.dot(flat, flat) * self._pending_sq()
        for p in params:
            total += p.grad.to(total.dtype).pow(2).sum()
        return total * self._pending_sq()

    def reduced_grads(self) -> list[torch.Tensor]:
        return [self.buffer]

    def step(self) -> None:
        """The optimizer step; parameters no DP rank used this step have no gradient in it
        (``None``), so element-wise optimizers leave them and their states alone."""
        hidden = [self._opt_param(p) for p in self._unused]
        if self.master is not None:
            self.master.step(self.optimizer, skip={id(m) for m in hidden})
            return
        grads = [p.grad for p in hidden]
        for p in hidden:
            p.grad = None
        self._optimizer_step()
        for p, g in zip(hidden, grads):
            p.grad = g                            # the view into the buffer again

    def zero_grad(self) -> None:
        self._end_step()
        self.buffer.zero_()
        if self.master is not None:
            self.master.scale = 1.0

    def logical_state(self):
        assert self.optimizer is not None
        params = {n: self._opt_param(p).detach() for n, p in self.named_params}
        optim = {n: {k: v for k, v in self.optimizer.state.get(self._opt_param(p), {}).items()
                     if torch.is_tensor(v)} for n, p in self.named_params}
        return params, optim

    @torch.no_grad()
    def load_logical_state(self, params, optim) -> None:
        assert self.optimizer is not None
        for n, p in self.named_params:
            p = self._opt_param(p)
            p.copy_(params[n])
            if optim.get(n):
                self.optimizer.state[p] = {k: v.clone().to(p.device) if v.dim() else v.clone()
                                           for k, v in optim[n].items()}
        if self.master is not None:
            self.master.copy_to_params()

    def _names_of_optimizer_params(self) -> list[str]:
        name_of = {id(self._opt_param(p)): n for n, p in self.named_params}
        return [name_of[id(t)] for t in self.optimizer_params()]

    def logical_of(self, tensors):
        return dict(zip(self._names_of_optimizer_params(), tensors))

    def shards_from(self, whole):
        return [whole[n].to(t.device, t.dtype) for n, t in
                zip(self._names_of_optimizer_params(), self.optimizer_params())]

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        opt = self.optimizer.state.values() if self.optimizer else []
        masters = self.master.masters if self.master is not None else []
        return {"params": [p for _, p in self.named_params], "grads": [self.buffer],
                "optimizer": [*masters, *(t for st in opt for t in st.values() if torch.is_tensor(t))]}
