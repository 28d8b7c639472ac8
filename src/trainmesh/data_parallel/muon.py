"""Muon on the hidden weight matrices, AdamW on every other parameter: one optimizer object.

:class:`MuonAdamW` steps parameter groups whose option ``muon`` is true with
``torch.optim.Muon``'s update and the others with ``torch.optim.AdamW``'s (its functional
kernel), so a strategy that hands the optimizer one flat shard per group (ZeRO) or a
tensor-parallel shard keeps doing so. Per matrix, Muon's update is::

    buf.lerp_(g, 1 - momentum)                              # element-wise: any shard of it
    u = g.lerp(buf, momentum) if nesterov else buf          # element-wise
    u = NS(u) * adjust(global shape)                        # needs the whole matrix
    p.mul_(1 - lr * wd); p.add_(u, alpha=-lr)               # element-wise

Only the Newton-Schulz iteration needs a whole matrix: the optimizer maps it over whole
matrices through its ``wholes`` attribute, which the engine sets to what the layout needs
(:mod:`.muon_owners`: tp owners; :mod:`.zero_owners`: ZeRO owners, which take a ZeRO shard's
matrices in buckets of :data:`BUCKET_VALUES` whole values), or over all of a group's matrices
at once through its ``map_many`` where it has one, in buckets of :data:`BUCKET_VALUES` held
values (tp owners); either way each rank iterates its own matrices while the others iterate
theirs. The default, :class:`Local`, takes the tensors as held, right where every parameter is
whole (one process, DDP). The momentum buffer (``momentum_buffer``)
is laid out like the parameter, a moment as AdamW's ``exp_avg``: checkpoints, offload and
resharding treat it as one.

Which parameters take Muon: :func:`muon_options` (2-D hidden weights and stacked experts, each
expert's matrix on its own; not embeddings, the output head, norms or biases).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS
from torch.optim._muon import _zeropower_via_newtonschulz
from torch.optim.adamw import adamw

BUCKET_VALUES = 1 << 24
"""Values of the momentum's (held) tensors a ``map_many`` takes at once (tp owners), and of the
whole matrices ZeRO's owners take at once: the transient memory of a bucket is its Nesterov
inputs, the exchanged shards or stretches (there and back), the matrices this rank owns whole
and their results, about six times this many values at most (16 Mi: under 400 MiB in fp32)."""

_NOT_HIDDEN = ("embed", "wte", "wpe", "lm_head", "head.out", "output.weight")


def is_hidden_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """Whether Muon takes parameter ``name`` of (global) ``shape``: a 2-D weight, or experts
    stacked in one ``(E, a, b)`` tensor, that is not an embedding or the output head."""
    if any(part in name for part in _NOT_HIDDEN):
        return False
    return len(shape) == 2 or (len(shape) == 3 and "expert" in name)


def muon_options(shapes: Mapping[str, tuple[int, ...]],
                 decay: Callable[[str], dict]) -> Callable[[str], dict]:
    """Parameter-group options for :class:`MuonAdamW`: ``decay(name)`` (weight decay) plus
    ``muon``, from the parameter's name and its whole-model shape (``shapes``)."""
    def options(name: str) -> dict:
        shape = shapes.get(name)
        return {**decay(name), "muon": shape is not None and is_hidden_matrix(name, tuple(shape))}
    return options


def matrices(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a stack of matrices (m, a, b): one for a 2-D tensor, E for stacked experts."""
    return t.reshape(-1, *t.shape[-2:])


def adjust_ratio(shape: tuple[int, ...], fn: str | None) -> float:
    """torch.optim.Muon's learning-rate factor for a matrix of ``shape`` (its last two dims)."""
    a, b = shape[-2:]
    if fn is None or fn == "original":
        return math.sqrt(max(1, a / b))
    if fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    return 1.0


def newton_schulz(u: torch.Tensor, group: Mapping) -> torch.Tensor:
    """Orthogonalise each matrix of ``u`` (2-D, or stacked experts: each on its own) with the
    group's coefficients and steps, scaled by its learning-rate factor (fp32 result)."""
    ratio = adjust_ratio(tuple(u.shape), group["adjust_lr_fn"])
    out = torch.empty(u.shape, dtype=torch.float32, device=u.device)
    for src, dst in zip(matrices(u), matrices(out)):     # never the E matrices as one
        dst.copy_(_zeropower_via_newtonschulz(src, group["ns_coefficients"], group["ns_steps"],
                                              group["eps"]))
    return out.mul_(ratio)


def ns_flops(shape: tuple[int, ...], steps: int = DEFAULT_NS_STEPS) -> int:
    """Multiply-add FLOPs of the iteration on a matrix (or stacked matrices) of ``shape``: per
    step the gram (2 m^2 n), its square (2 m^3) and the product (2 m^2 n), m the shorter side."""
    if len(shape) < 2:                      # not a matrix (a whole-parameter optimizer's): its size
        return max(1, math.prod(shape))
    count = math.prod(shape[:-2]) if len(shape) > 2 else 1
    m, n = sorted(shape[-2:])
    return count * steps * (4 * m * m * n + 2 * m ** 3)


class Local:
    """Where every parameter is whole (one process, DDP, ...): ``fn`` on the tensors as held."""

    def map(self, p: torch.Tensor, tensors: list[torch.Tensor],
            fn: Callable[[str | None, list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        return fn(None, tensors)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on groups with ``muon=True``, AdamW on the others (module docstring). Muon's
    momentum, Nesterov flag, Newton-Schulz coefficients, steps and eps, and learning-rate
    adjustment default to torch.optim.Muon's; ``lr`` and ``weight_decay`` are shared."""

    needs_whole_params = True
    """The engine must let it see whole matrices (through :attr:`orthogonalize`)."""

    def __init__(self, params, lr: float = 1e-3, *, betas: tuple[float, float] = (0.9, 0.999),
                 adam_eps: float = 1e-8, weight_decay: float = 0.01, momentum: float = 0.95,
                 nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                 eps: float = EPS, ns_steps: int = DEFAULT_NS_STEPS,
                 adjust_lr_fn: str | None = None) -> None:
        defaults = {"lr": lr, "betas": betas, "adam_eps": adam_eps, "weight_decay": weight_decay,
                    "momentum": momentum, "nesterov": nesterov, "ns_coefficients": ns_coefficients,
                    "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn, "muon": False}
        super().__init__(params, defaults)
        self.flops_run = 0
        """The iteration's FLOPs this rank has run (an owner runs its matrices' only)."""
        self.bucket_values = BUCKET_VALUES
        """Where the map takes many matrices at once: the values of one bucket (of the tensors
        as held under tp owners, of the whole matrices under ZeRO's), at least (one matrix more
        crosses it)."""
        self.wholes = Local()
        """Whole matrices where the layout cuts them: ``map(param, tensors, fn)`` applies
        ``fn`` to each whole matrix of tensors laid out like ``param`` (:mod:`.muon_owners`)."""

    def orthogonalize(self, p: torch.Tensor, u: torch.Tensor, group: dict) -> torch.Tensor:
        """NS(u) x learning-rate factor of each whole matrix, laid out like ``p``."""
        return self.wholes.map(p, [u], self._iterate(group))

    def _iterate(self, group: dict) -> Callable[[str | None, list[torch.Tensor]], torch.Tensor]:
        def iterate(name: str | None, whole: list[torch.Tensor]) -> torch.Tensor:
            self.flops_run += ns_flops(tuple(whole[0].shape), group["ns_steps"])
            return newton_schulz(whole[0], group)
        return iterate

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon(group)
            else:
                self._adamw(group)
        return loss

    def _muon(self, group: dict) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        many = getattr(self.wholes, "map_many", None)
        held: list[tuple[torch.Tensor, torch.Tensor]] = []
        values = 0
        for p in group["params"]:
            if p.grad is None:
                continue
            u = self._momentum(p, group)
            if many is None:
                update = self.orthogonalize(p, u, group)
                p.mul_(1 - lr * wd)
                p.add_(update.to(p.dtype), alpha=-lr)
                continue
            held.append((p, u))            # the map iterates a bucket of matrices together
            values += u.numel()
            if values >= self.bucket_values:
                self._step_bucket(held, many, group)
                held, values = [], 0
        if held:
            self._step_bucket(held, many, group)

    def _step_bucket(self, held: list[tuple[torch.Tensor, torch.Tensor]], many, group: dict) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        updates = many([p for p, _ in held], [u for _, u in held], self._iterate(group))
        for (p, _), update in zip(held, updates):
            p.mul_(1 - lr * wd)
            p.add_(update.to(p.dtype), alpha=-lr)

    def _momentum(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """The momentum step on ``p``'s buffer; the tensor the iteration takes (Nesterov's or
        the buffer)."""
        g, mu = p.grad, group["momentum"]
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.lerp_(g, 1 - mu)
        return g.lerp(buf, mu) if group["nesterov"] else buf

    def _adamw(self, group: dict) -> None:
        params, grads, avgs, sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            avgs.append(state["exp_avg"])
            sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(params, grads, avgs, sqs, [], steps, foreach=True, amsgrad=False, beta1=beta1,
              beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
              eps=group["adam_eps"], maximize=False)
