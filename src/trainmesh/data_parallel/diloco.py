"""DiLoCo (Douillard et al., 2023): data parallelism across slow links.

Every DP replica holds the global parameters θ (the *outer* model) and its own copy θ_r that
its own *inner* optimizer trains: each step, replica r computes the gradient of the mean loss
over its own slice of the global batch and steps θ_r, with no communication. Every H
(``inner_steps``) inner steps the replicas synchronise::

    Δ = mean_r (θ - θ_r)                  # the outer gradient: one all-reduce of Ψ values (dp)
    θ <- OuterSGD(θ, Δ)                   # torch.optim.SGD(nesterov=True), lr / momentum outer
    θ_r <- θ                              # every replica restarts from the new θ

The inner optimizers' states stay local (never averaged). With H = 1, outer lr 1, outer
momentum 0 and plain SGD inside, θ <- mean_r(θ - lr g_r) = θ - lr mean_r g_r: plain DP.
Gradients are never reduced, so there is no global gradient: clipping (``clip``) and the
non-finite check use each replica's own gradient norm (:meth:`DiLoCo.local_norm`).

Checkpoints hold θ as the parameters, the outer momentum, and every replica's θ_r and inner
optimizer state (gathered over DP at save): a resume continues exactly, at any step, with the
same ``--dp``.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from trainmesh.core.errors import ConfigError

from ..comm import Comm
from .base import CountedFn, GradSync, OptimizerFactory, SyncOptions, group_parameters

REPLICA = "replica{}/"
"""Prefix of a replica's own tensors among a parameter's checkpointed states."""
INNER_DONE = "inner_steps_done"
"""Checkpointed state: inner steps taken since the last synchronisation (per parameter, all equal)."""


class DiLoCo(GradSync):
    """Local inner steps on each DP replica; an outer Nesterov step on the averaged change every
    ``inner_steps`` steps."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], comm: Comm,
                 options: SyncOptions | None = None, *, inner_steps: int, outer_lr: float,
                 outer_momentum: float) -> None:
        super().__init__(named_params, comm, options)
        self.inner_steps = inner_steps
        self.inner_done = 0
        """Inner steps since the last synchronisation."""
        self.synced = False
        """Whether the last :meth:`step` synchronised the replicas (an outer step)."""
        with torch.no_grad():   # θ: the outer model, fp32, as every replica starts it
            self.outer = [p.detach().clone() for _, p in named_params]
        self.outer_optimizer = torch.optim.SGD(self.outer, lr=outer_lr, momentum=outer_momentum,
                                               nesterov=outer_momentum > 0)

    # ---------------------------------------------------------------- backward: nothing to reduce
    def before_backward(self, *, is_last: bool) -> None:
        self.readiness.start()

    def expect_backwards(self, n: int) -> None:
        raise ConfigError("--pp", "is not supported with --strategy diloco (a replica holds the whole model)")

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for _, p in self.named_params if p.grad is not None]

    def finish(self, scale: float) -> None:
        """``scale``: 1 / this replica's token count (its own mean)."""
        self._scale(scale)

    def reduced_grads(self) -> list[torch.Tensor]:
        return self._grads()

    def grad_sq_sum(self, counted: CountedFn) -> torch.Tensor:
        """This replica's own squared gradient norm (no other replica's gradient is seen)."""
        total = torch.zeros((), dtype=torch.float32)
        for g in self._grads():
            total += g.float().pow(2).sum().cpu()
        return total

    def local_norm(self) -> float:
        """This replica's gradient norm (what it clips by); inf on every rank when any replica's
        is non-finite, so that all skip or stop together (one 4-byte all-reduce, world)."""
        norm = math.sqrt(float(self.grad_sq_sum(lambda name, p: True)))
        bad = torch.tensor([0.0 if math.isfinite(norm) else 1.0])
        self.comm.all_reduce(bad, "world", op=torch.distributed.ReduceOp.MAX)
        return norm if bad.item() == 0.0 else math.inf

    # ---------------------------------------------------------------- steps
    def build_optimizer(self, factory: OptimizerFactory, options=None) -> torch.optim.Optimizer:
        groups = group_parameters(self.named_params, options)
        if len(groups) == 1 and not groups[0][0]:
            self.optimizer = factory([p for _, p in groups[0][1]])
        else:
            self.optimizer = factory([{**opts, "params": [p for _, p in ps]} for opts, ps in groups])
        return self.optimizer

    def step(self) -> None:
        """The inner step; every ``inner_steps``-th one, the outer step after it."""
        self._optimizer_step()
        self.inner_done += 1
        self.synced = self.inner_done >= self.inner_steps   # >=: a resume with a smaller H
        if self.synced:
            self._outer_step()
            self.inner_done = 0

    @torch.no_grad()
    def _outer_step(self) -> None:
        params = [p for _, p in self.named_params]
        delta = torch.cat([(t - p).reshape(-1) for t, p in zip(self.outer, params)])   # (Ψ,)
        nbytes = delta.numel() * delta.element_size()
        self.reductions.count(nbytes)                   # transient: comm_buffer_peak_bytes
        self.comm.all_reduce(delta, self.axis)
        self.reductions.release(nbytes)
        delta.div_(self.dp)
        offset = 0
        for t in self.outer:
            t.grad = delta[offset : offset + t.numel()].view_as(t)
            offset += t.numel()
        self.outer_optimizer.step()
        for t, p in zip(self.outer, params):
            p.copy_(t)
            t.grad = None

    def zero_grad(self) -> None:
        for g in self._grads():
            g.zero_()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        inner = [t for st in self.optimizer.state.values() for t in st.values()
                 if torch.is_tensor(t)] if self.optimizer else []
        outer = [t for st in self.outer_optimizer.state.values() for t in st.values()
                 if torch.is_tensor(t)]
        return {"params": [p for _, p in self.named_params], "grads": self._grads(),
                "optimizer": [*inner, *self.outer, *outer]}

    # ---------------------------------------------------------------- checkpoints
    @torch.no_grad()
    def logical_state(self):
        """Collective over DP: θ as the parameters; per parameter the outer momentum, the inner
        step count and every replica's θ_r and inner states (``replica{r}/...``), gathered in
        the same order on every rank."""
        assert self.optimizer is not None
        params, optim = {}, {}
        for (name, p), t in zip(self.named_params, self.outer):
            params[name] = t
            states = optim[name] = {INNER_DONE: torch.tensor(self.inner_done, dtype=torch.int64)}
            momentum = self.outer_optimizer.state.get(t, {}).get("momentum_buffer")
            if momentum is not None:
                states["outer_momentum"] = momentum
            inner = {k: v for k, v in self.optimizer.state.get(p, {}).items() if torch.is_tensor(v)}
            for key in ["param", *sorted(inner)]:
                mine = (p if key == "param" else inner[key]).detach().contiguous()
                out = torch.empty(self.dp * mine.numel(), dtype=mine.dtype, device=mine.device)
                self.comm.all_gather(out, mine.reshape(-1), "dp")
                for r, theirs in enumerate(out.view(self.dp, *mine.shape)):
                    states[REPLICA.format(r) + key] = theirs.clone()   # own storage (safetensors)
        return params, optim

    @torch.no_grad()
    def load_logical_state(self, params, optim) -> None:
        assert self.optimizer is not None
        mine = REPLICA.format(self.comm.mesh.index("dp"))
        for (name, p), t in zip(self.named_params, self.outer):
            saved = optim.get(name, {})
            if INNER_DONE not in saved:
                raise ConfigError("--strategy", "the checkpoint was not written by a --strategy "
                                  "diloco run (no replica states); resume it with its own strategy")
            if mine + "param" not in saved:
                replicas = sum(1 for k in saved if k.endswith("/param"))
                raise ConfigError("--dp", f"a DiLoCo checkpoint resumes with its own number of "
                                  f"replicas: --dp {replicas}")
            t.copy_(params[name])
            p.copy_(saved[mine + "param"])
            self.inner_done = int(saved[INNER_DONE])
            if "outer_momentum" in saved:
                self.outer_optimizer.state[t] = {"momentum_buffer": saved["outer_momentum"].clone()}
            inner = {k[len(mine):]: v.clone() for k, v in saved.items()
                     if k.startswith(mine) and k != mine + "param"}
            if inner:
                self.optimizer.state[p] = inner
