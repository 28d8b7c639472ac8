"""DiLoCo (Douillard et al., 2023): data parallelism across slow links.

Every replica holds the global parameters θ (the *outer* model) and its own copy θ_r that its
own *inner* optimizer trains: each step, replica r computes the gradient of the mean loss over
its own slice of the global batch and steps θ_r, with no communication between replicas. Every
H (``inner_steps``) inner steps the replicas synchronise::

    Δ = mean_r (θ - θ_r)                  # the outer gradient: one all-reduce across replicas
                                          # (weighted by their tokens where they differ)
    θ <- OuterSGD(θ, Δ)                   # torch.optim.SGD(nesterov=True), lr / momentum outer
    θ_r <- θ                              # every replica restarts from the new θ

A replica may itself be several ranks (docs/DILOCO.md): the tp x pp x cp ranks of one dp index
(``--zero 0``), or, with ZeRO inside it, one shard group of ``--dp-shard`` dp indices (each with
its tp x pp ranks). Inside, the replica's own strategy runs unchanged (:attr:`DiLoCo.inner`: DDP
over ``cp``, or ZeRO over ``dp_shard``: its reductions never leave the replica); across
replicas, each rank's outer step covers what its inner optimizer updates — its tp/pp slice, its
ZeRO shard — in fp32 at least whatever the precision (the fp32 masters; a float64 model's in
float64), all-reduced with the ranks holding the same piece in the other replicas
(``outer_axis``: ``dp``, or ``dp_replicate``).

The inner optimizers' states stay per replica (never averaged). With H = 1, outer lr 1, outer
momentum 0 and plain SGD inside, θ <- mean_r(θ - lr g_r) = θ - lr mean_r g_r: plain DP. No
global gradient is formed: clipping and the non-finite check use each replica's own gradient
norm (:meth:`DiLoCo.local_norm`).

Checkpoints hold θ as the parameters, the outer momentum, and every replica's θ_r and inner
optimizer state (gathered across replicas at save): a resume continues exactly, at any step,
with the same number of replicas.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainmesh.core.dtypes import wide
from trainmesh.core.errors import ConfigError
from trainmesh.core.layout import Group

from ..comm import Comm
from .base import CountedFn, GradSync, OptimizerFactory, SyncOptions
from .composite import CompositeSync

REPLICA = "replica{}/"
"""Prefix of a replica's own tensors among a parameter's checkpointed states."""
INNER_DONE = "inner_steps_done"
"""Checkpointed state: inner steps taken since the last synchronisation (per parameter, all equal)."""
INNER_TOKENS = "inner_tokens"
"""Checkpointed state where the replicas counted different tokens since the last synchronisation
(packed documents): each replica's count (per parameter, all equal)."""


def replica_axes(zero: int, cp: int) -> tuple[Group, Group]:
    """(the group a replica's own strategy reduces over, the group across replicas): without
    ZeRO a replica is one dp index (its cp ranks hold other tokens of the same sequences); with
    ZeRO it is one HSDP shard group."""
    return (Group.cp, Group.dp) if zero == 0 else (Group.dp_shard, Group.dp_replicate)


def wrap(cfg: Any, comm: Comm, options: SyncOptions, build: Callable[[SyncOptions], GradSync]) -> DiLoCo:
    """``--strategy diloco``'s gradient sync (its declaration's ``grad_sync``,
    :mod:`trainmesh.strategies.diloco`): each replica's own strategy, ``build`` over the group
    inside the replica (:func:`replica_axes`, no replicas of its own), and the outer step across."""
    inner, outer = replica_axes(cfg.zero, cfg.cp)
    return DiLoCo(build(dataclasses.replace(options, axis=inner, replicate_axis=None)), comm,
                  outer_axis=outer, inner_steps=cfg.inner_steps, outer_lr=cfg.outer_lr,
                  outer_momentum=cfg.outer_momentum)


class DiLoCo(CompositeSync):
    """A replica's own strategy ``inner`` (steps every step) and the outer Nesterov step on the
    averaged change across replicas every ``inner_steps`` steps (module docstring)."""

    def __init__(self, inner: GradSync, comm: Comm, *, outer_axis: str, inner_steps: int,
                 outer_lr: float, outer_momentum: float) -> None:
        super().__init__([inner])
        self.inner = inner
        self.outer_axis = outer_axis
        self.n_replicas = comm.mesh.size(outer_axis)
        """How many replicas synchronise."""
        self.replica = comm.mesh.index(outer_axis)
        """This rank's replica."""
        self.inner_steps = inner_steps
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.inner_done = 0
        """Inner steps since the last synchronisation."""
        self.inner_tokens = [0.0] * self.n_replicas
        """Each replica's tokens since the last synchronisation: the weights of its change in
        the outer gradient."""
        self.synced = False
        """Whether the last :meth:`step` synchronised the replicas (an outer step)."""
        self.outer: list[torch.Tensor] = []
        self.outer_optimizer: torch.optim.Optimizer | None = None

    # ---------------------------------------------------------------- set-up
    def build_optimizer(self, factory: OptimizerFactory,
                        options: Callable[[str], dict] | None) -> torch.optim.Optimizer:
        """The replica's inner optimizer; θ: a copy of what it updates (this rank's slice or
        shard) in fp32 at least (a float64 model's in float64), stepped by the outer Nesterov SGD."""
        optimizer = super().build_optimizer(factory, options)
        with torch.no_grad(), self.inner.resident():
            self.outer = [t.detach().to(wide(t.dtype), copy=True) for t in self.inner.optimizer_params()]
        self.outer_optimizer = torch.optim.SGD(self.outer, lr=self.outer_lr, momentum=self.outer_momentum,
                                               nesterov=self.outer_momentum > 0)
        return optimizer

    # ---------------------------------------------------------------- per replica
    def replica_slots(self, value: float) -> list[float]:
        """``value`` at this replica's slot of a vector with one slot per replica (summed over
        the world: each replica's total, e.g. its token count, riding on the loss all-reduce)."""
        slots = [0.0] * self.n_replicas
        slots[self.replica] = value
        return slots

    def extra_sums(self, count: float) -> list[float]:
        """Each replica's token count rides along the loss all-reduce (:meth:`replica_slots`)."""
        return self.replica_slots(count)

    def token_total(self, tokens: float, sums: Sequence[float]) -> float:
        """The mean over the replica's own tokens: its slot of :meth:`extra_sums`, summed (every
        replica's kept for the outer step's weights)."""
        self.inner_tokens = [a + b for a, b in zip(self.inner_tokens, sums)]
        return sums[self.replica]

    def norm(self, counted: CountedFn, global_norm: Callable[[], float]) -> float:
        """No global gradient is formed: the replica clips by its own norm (:meth:`local_norm`)."""
        return self.local_norm(counted)

    def step_metrics(self, grad_norm: float) -> dict[str, Any]:
        """``grad_norm`` null (no global gradient), ``outer`` on the steps that synchronised."""
        return {"grad_norm": None, **({"outer": True} if self.synced else {})}

    def local_norm(self, counted: CountedFn) -> float:
        """This replica's gradient norm (what it clips by; its ranks' parts summed, one world
        all-reduce of a value per replica); inf on every rank when any replica's is non-finite,
        so that all skip or stop together; in float32 at least (a float64 model's in float64)."""
        mine = self.inner.grad_sq_sum(counted).reshape(())
        slots = torch.zeros(self.n_replicas, dtype=wide(mine.dtype))
        slots[self.replica] = mine.to(slots.dtype).cpu()
        self.comm.all_reduce(slots, Group.world)
        if not bool(torch.isfinite(slots).all()):
            return math.inf
        return math.sqrt(float(slots[self.replica]))

    # ---------------------------------------------------------------- steps
    def step(self) -> None:
        """The inner step; every ``inner_steps``-th one, the outer step after it."""
        super().step()                     # through the optimizer view: an LR schedule sees it
        self.inner_done += 1
        self.synced = self.inner_done >= self.inner_steps   # >=: a resume with a smaller H
        if self.synced:
            self._outer_step()
            self.inner_done = 0

    @torch.no_grad()
    def _outer_step(self) -> None:
        assert self.outer_optimizer is not None, "build_optimizer first"
        with self.inner.resident():
            mine = self.inner.optimizer_params()
            delta = torch.cat([(t - p.to(t.device, t.dtype)).reshape(-1)
                               for t, p in zip(self.outer, mine)])              # (this rank's Ψ,)
            nbytes = delta.numel() * delta.element_size()
            self.reductions.count(nbytes)                   # transient: comm_buffer_peak_bytes
            counts, self.inner_tokens = self.inner_tokens, [0.0] * self.n_replicas
            # replicas that counted different tokens (packed documents, whose ends count none)
            # weigh by them: with H = 1 and SGD, sum_r n_r/N lr g_r/n_r = lr g/N, as DP
            weighted = len(set(counts)) > 1
            if weighted:
                delta.mul_(counts[self.replica] / sum(counts))
            reduced = delta.to(self.device)
            self.comm.all_reduce(reduced, self.outer_axis)
            self.reductions.release(nbytes)
            delta.copy_(reduced)
            if not weighted:
                delta.div_(self.n_replicas)
            offset = 0
            for t in self.outer:
                t.grad = delta[offset : offset + t.numel()].view_as(t)
                offset += t.numel()
            self.outer_optimizer.step()
            for t, p in zip(self.outer, mine):
                p.copy_(t)
                t.grad = None
        self.inner.params_changed()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = self.inner.held_tensors()
        outer = [t for st in self.outer_optimizer.state.values() for t in st.values()
                 if torch.is_tensor(t)] if self.outer_optimizer else []
        return {**held, "optimizer": [*held["optimizer"], *self.outer, *outer]}

    @property
    def comm_buffer_peak_bytes(self) -> int:      # type: ignore[override]
        return self.inner.comm_buffer_peak_bytes + self.reductions.peak_bytes

    # ---------------------------------------------------------------- checkpoints
    @torch.no_grad()
    def logical_state(self):
        """Collective: θ as the parameters; per parameter the outer momentum, the inner step
        count and every replica's θ_r and inner states (``replica{r}/...``), gathered across
        replicas in the same order on every rank."""
        assert self.outer_optimizer is not None
        params = self.inner.logical_of(self.outer)
        buffers = [self.outer_optimizer.state.get(t, {}).get("momentum_buffer") for t in self.outer]
        momentum = self.inner.logical_of(buffers) if all(b is not None for b in buffers) else {}
        mine, inner = self.inner.logical_state()
        # which states each replica holds (a parameter never stepped has none): one object gather
        held = {n: {k: (list(v.shape), str(v.dtype)) for k, v in sorted(inner.get(n, {}).items())}
                for n in mine}
        everyone = self.comm.all_gather_object(held, self.outer_axis)
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for name in mine:
            states = optim[name] = {INNER_DONE: torch.tensor(self.inner_done, dtype=torch.int64)}
            if len(set(self.inner_tokens)) > 1:
                states[INNER_TOKENS] = torch.tensor(self.inner_tokens, dtype=torch.float64)
            if name in momentum:
                states["outer_momentum"] = momentum[name]
            keys = sorted({k for h in everyone for k in h[name]})
            for key in ["param", *keys]:
                if key == "param":
                    t = mine[name]
                else:
                    shape, dtype = next(h[name][key] for h in everyone if key in h[name])
                    t = inner.get(name, {}).get(key)
                    if t is None:
                        t = torch.zeros(shape, dtype=getattr(torch, dtype.removeprefix("torch.")),
                                        device=self.device)
                t = t.detach().contiguous()
                out = torch.empty(self.n_replicas * t.numel(), dtype=t.dtype, device=t.device)
                self.comm.all_gather(out, t.reshape(-1), self.outer_axis)
                for r, theirs in enumerate(out.view(self.n_replicas, *t.shape)):
                    if key == "param" or key in everyone[r][name]:
                        states[REPLICA.format(r) + key] = theirs.clone()   # own storage
        return params, optim

    @torch.no_grad()
    def load_logical_state(self, params, optim) -> None:
        assert self.outer_optimizer is not None
        mine = REPLICA.format(self.replica)
        for name, _ in self.named_params:
            saved = optim.get(name, {})
            if INNER_DONE not in saved:
                raise ConfigError("--strategy", "the checkpoint was not written by a --strategy "
                                  "diloco run (no replica states); resume it with its own strategy")
            if mine + "param" not in saved:
                replicas = sum(1 for k in saved if k.endswith("/param"))
                raise ConfigError("--dp", f"a DiLoCo checkpoint resumes with its own number of "
                                  f"replicas ({replicas}); this layout has {self.n_replicas}")
        self.inner.load_logical_state(
            {n: optim[n][mine + "param"] for n, _ in self.named_params},
            {n: {k[len(mine):]: v for k, v in optim[n].items() if k.startswith(mine) and k != mine + "param"}
             for n, _ in self.named_params})
        for t, v in zip(self.outer, self.inner.shards_from(params)):
            t.copy_(v)
        self.inner_done = int(optim[self.named_params[0][0]][INNER_DONE]) if self.named_params else 0
        first = optim[self.named_params[0][0]] if self.named_params else {}
        self.inner_tokens = (first[INNER_TOKENS].tolist() if INNER_TOKENS in first
                             else [0.0] * self.n_replicas)
        if all("outer_momentum" in optim[n] for n, _ in self.named_params):
            moms = self.inner.shards_from({n: optim[n]["outer_momentum"] for n, _ in self.named_params})
            for t, m in zip(self.outer, moms):
                self.outer_optimizer.state[t] = {"momentum_buffer": m.to(t.device, t.dtype)}
