"""Mixture of experts for the reference GPT: a top-k router, E GELU expert MLPs, dropless routing.

One MoE layer replaces a block's MLP (``blocks.{i}.mlp``). Its parameters are
``blocks.{i}.mlp.router.weight`` (E x d, no bias) and, per expert ``e`` by its *global* index,
``blocks.{i}.mlp.experts.{e}.fc`` / ``.proj`` (the dense MLP's shapes with the expert width).
Under expert parallelism a rank keeps only its experts, under the same names, so a checkpoint
holds every expert once by its global index and loads under any ``--ep``.

Forward, for the ``T = b * s`` tokens of a microbatch:

1. router: ``p = softmax(x W_r^T)`` over the E experts; each token's ``k`` largest are its
   experts, their gates renormalised to sum to 1 over the chosen k;
2. dispatch: the ``T * k`` (token, expert) pairs sorted by expert (stable, so by token within an
   expert); every pair is computed, none dropped (no capacity factor);
3. each expert runs its rows in one matmul per layer (a loop over experts: CPU torch has no
   grouped GEMM); under expert parallelism the rows travel to the expert's rank and back
   (:class:`Exchange`, injected by :mod:`trainmesh.expert_parallel`). An expert no row reached
   is not run, so its parameters get no gradient that step (None: the optimizer leaves them, their
   moments and their step count alone, in one process and under every layout);
4. combine: each token's output is the gate-weighted sum of its k experts' outputs.

Load balancing (Switch/GShard): per *sequence*, ``aux = E * sum_e f_e * P_e`` with ``f_e`` the
share of the sequence's k-routed slots that went to expert e and ``P_e`` its mean router
probability over the sequence (1.0 when perfectly balanced). It is computed per sequence, so its
mean over the global batch does not depend on how sequences are split over ranks or
microbatches. Where each sequence is itself split over ranks (context parallelism, sequence
parallelism: :class:`SequenceSplit`, injected by the engine), the router runs on the tokens this
rank holds and the per-sequence slot counts are summed over the ranks holding the other parts
before ``f`` is formed; this rank's part ``E * sum_e f_e * (sum of its P over its tokens) / S``
then sums over those ranks to the whole sequence's aux, and its gradient is the whole one's
restricted to this rank's tokens: the same number as in one process. Its gradient enters without a loss term (:class:`AuxGrad`: the layer's output
carries it in backward), so it works on every pipeline stage; the training objective is
``CE mean + moe_aux_loss * sum over MoE layers of (mean over sequences of aux)`` when every
position carries a label (each sequence's aux is weighted by its length ``s`` and the sum divided
by the global label count, the denominator of the CE mean).

The layers share one :class:`MoEStats` (``GPT.moe_stats``): the typed side channel through which
the engine sets the loss scale of the aux gradient (and, for a Hugging Face model, how its
sequences are split) and reads the step's aux loss and routing
counts. Nothing is a module global.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from trainmesh.core.compat import in_backward
from trainmesh.core.dtypes import wide
from trainmesh.core.moe_stats import MoEStats, SequenceSplit


class Exchange(Protocol):
    """Runs the experts on rows sorted by expert, wherever they live: ``(rows, counts, compute)``
    -> (outputs in the rows' order, rows this rank's experts computed). ``counts``: rows per
    global expert (int64, length E); ``compute(rows, per_expert)`` runs this rank's experts on
    rows grouped by its local expert."""

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor,
                 compute: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> tuple[torch.Tensor, int]:
        ...


class AuxGrad(torch.autograd.Function):
    """Identity on ``x`` whose backward also gives ``aux`` the gradient ``weight``: the aux loss
    joins the backward of whatever loss ``x`` feeds, on any pipeline stage."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.aux_dtype = weight, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.weight, dtype=ctx.aux_dtype, device=grad.device), None


class Expert(nn.Module):
    """One expert: the dense MLP's shape with width ``hidden``."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class MoE(nn.Module):
    """A dropless top-k mixture of experts (module docstring); layer ``index`` of the model's
    MoE layers, reporting into ``stats``."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, hidden: int, *, aux_coef: float,
                 index: int, stats: MoEStats | None) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.aux_coef, self.index = n_experts, top_k, aux_coef, index
        self.stats = stats
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): Expert(d_model, hidden) for e in range(n_experts)})
        self.exchange: Exchange | None = None
        """Expert parallelism's all-to-all (None: every expert is here)."""
        self.sequence: SequenceSplit | None = None
        """The ranks holding the other parts of this rank's sequences (None: whole sequences)."""

    def local_experts(self) -> list[int]:
        """Global indices of the experts this rank holds, ascending."""
        return sorted(int(e) for e in self.experts)

    def compute(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """This rank's experts on ``rows`` grouped by local expert (``per_expert`` rows each).
        An expert with no row is not run: it takes no part in the step and gets no gradient
        (None), so the optimizer leaves it alone, as for any unused parameter."""
        chunks = rows.split(per_expert)
        outs = [self.experts[str(e)](chunk) for e, chunk in zip(self.local_experts(), chunks)
                if chunk.shape[0]]
        return torch.cat(outs) if outs else rows

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router probabilities (T, E) in fp32 or wider, chosen experts (T, k), renormalised
        gates (T, k))."""
        logits = self.router(flat)
        probs = logits.to(wide(logits.dtype)).softmax(-1)
        top_p, top_e = probs.topk(self.top_k, dim=-1)
        return probs, top_e, top_p / top_p.sum(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # (b, s, d) -> (b, s, d)
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        probs, top_e, gates = self.route(flat)
        expert_of = top_e.reshape(-1)                          # (T k,) slot -> expert
        order = torch.argsort(expert_of, stable=True)         # slots sorted by expert
        counts = torch.bincount(expert_of, minlength=self.n_experts)
        token_of = order // self.top_k                         # sorted slot -> its token
        rows = flat[token_of]
        if self.exchange is None:
            out, received = self.compute(rows, counts.tolist()), rows.shape[0]
        else:
            out, received = self.exchange(rows, counts, self.compute)
        weighted = out * gates.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        y = flat.new_zeros(flat.shape).index_add(0, token_of, weighted.to(flat.dtype)).view(b, s, d)
        if not torch.is_grad_enabled():
            return y
        # per-sequence load balancing: E * sum_e f_e P_e, f from the chosen slots, P from probs
        slots = F.one_hot(top_e.view(b, s * self.top_k), self.n_experts).sum(1).to(probs.dtype)
        parts = 1 if self.sequence is None else self.sequence.parts
        if parts > 1:                     # the sequence is split: its whole slot counts
            self.sequence(slots)
        length = s * parts                # S, the whole sequence's tokens
        f = slots / (length * self.top_k)
        aux = self.n_experts * (f * probs.view(b, s, -1).sum(1) / length).sum(-1)   # (b,): this part
        stats = self.stats
        if stats is not None and not in_backward():
            stats.counts[self.index] += counts.double().cpu()
            stats.aux_sum[self.index] += float(aux.detach().sum())
            stats.sequences[self.index] += b / parts
            stats.received[self.index] += received
        scale = stats.loss_scale if stats is not None else 1.0
        return AuxGrad.apply(y, aux.sum(), self.aux_coef * length * scale)
