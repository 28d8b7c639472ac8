"""Reference GPT: pre-LN decoder, causal self-attention, GELU MLP, learned positions, untied head.

Module names are part of the interface (tensor-parallel plans, checkpoints and the planner use
them): ``embed.wte``, ``embed.wpe``, ``blocks.{i}.ln1``, ``blocks.{i}.attn.{q,k,v,proj}``,
``blocks.{i}.ln2``, ``blocks.{i}.mlp.{fc,proj}``, ``head.ln_f``, ``head.out``; with ``n_experts``
> 0, the MLP of every ``moe_every``-th block (blocks ``moe_every - 1``, ``2 moe_every - 1``, ...) is a
mixture of experts, ``blocks.{i}.mlp.router`` and ``blocks.{i}.mlp.experts.{e}.{fc,proj}``
(:mod:`.moe`). Attention derives
its local head count from the width of ``q``, so a column-sharded ``q``/``k``/``v`` simply holds
fewer heads. Two parameter-free submodules, ``embed.positions`` (:class:`Positions`) and
``blocks.{i}.attn.causal`` (:class:`CausalAttention`), are the seams context parallelism swaps
(each rank then holds part of every sequence). Packed documents (``forward(..., position_ids=)``):
the learned positions are indexed by ``position_ids``, and attention is causal within each
document (:func:`document_mask`, SDPA with a boolean mask); the ids reach every block, and a
pipeline stage's through :meth:`GPT.pipeline_forward`.

The GPT carries its own parallel hints, so the parallel building blocks stay generic:
``tp_plan()`` (its Megatron tensor-parallel plan) and ``check_tp()`` (its shapes against a TP
degree, :func:`validate_gpt`) for tensor parallelism; ``pipeline_layers()`` (the ordered layers a
pipeline splits) and ``pipeline_output()`` (what ``forward`` returns given the last layer's
output) for pipeline parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainmesh.core.dtypes import wide
from trainmesh.core.errors import ConfigError

from .init import init_module, init_value
from .moe import MoE, MoEStats


@dataclass
class GPTConfig:
    """Shape of the reference GPT."""

    vocab_size: int = 512
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 0
    """MLP width; 0 means 4 * d_model."""
    n_experts: int = 0
    """Experts per MoE layer; 0: every MLP is dense."""
    top_k: int = 2
    """Experts each token is routed to (MoE)."""
    moe_every: int = 1
    """Every N-th block's MLP is a mixture of experts (blocks N-1, 2N-1, ...)."""
    moe_hidden: int = 0
    """Hidden width of one expert; 0 means 4 * d_model / top_k (the dense MLP's FLOPs per token)."""
    moe_aux_loss: float = 0.01
    """Coefficient of the load-balancing loss (a mean over sequences)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ConfigError(name.replace("_", "-").replace("n-", ""),
                                  f"must be >= 1; got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError("heads", f"must divide --d-model {self.d_model}; got {self.n_heads}")
        if self.d_ff == 0:
            self.d_ff = 4 * self.d_model
        if self.n_experts:
            if not 1 <= self.top_k <= self.n_experts:
                raise ConfigError("--top-k", f"must be in 1..--experts ({self.n_experts}); got {self.top_k}")
            if self.moe_every < 1:
                raise ConfigError("--moe-every", f"must be >= 1; got {self.moe_every}")
            if self.moe_hidden == 0:
                self.moe_hidden = max(1, 4 * self.d_model // self.top_k)

    def moe_blocks(self) -> list[int]:
        """Indices of the blocks whose MLP is a mixture of experts (every ``moe_every``-th)."""
        if not self.n_experts:
            return []
        return [i for i in range(self.n_layers) if (i + 1) % self.moe_every == 0]

    def expert_params(self) -> int:
        """Parameters of one expert: ``2 d h + h + d``."""
        d, h = self.d_model, self.moe_hidden
        return 2 * d * h + h + d

    def num_params(self, *, active: bool = False) -> int:
        """Logical parameter count: 2Vd + Sd + L(4d^2 + 2d*ff + 9d + ff) + 2d, each MoE block's
        MLP replaced by its router (E d) and E experts (``active``: the k a token runs through)."""
        v, s, d, f, n_layers = self.vocab_size, self.seq_len, self.d_model, self.d_ff, self.n_layers
        mlp = (d * f + f) + (f * d + d)
        block = 4 * (d * d + d) + mlp + 4 * d
        moe = len(self.moe_blocks())
        experts = self.top_k if active else self.n_experts
        delta = moe * (self.n_experts * d + experts * self.expert_params() - mlp)
        return 2 * v * d + s * d + n_layers * block + 2 * d + delta

    def flops_per_token(self) -> float:
        """Training FLOPs per token, forward + backward: ``6N + 12·L·s·d`` with N the *active*
        parameters (a token runs through k of the E experts; :mod:`trainmesh.observe.flops`)."""
        from trainmesh.observe.flops import transformer_flops_per_token
        return transformer_flops_per_token(self.num_params(active=True), self.n_layers, self.seq_len,
                                           self.d_model)


def validate_gpt(cfg: GPTConfig, tp: int, *, sequence_parallel: bool = False) -> None:
    """The GPT's shape against tensor-parallel degree ``tp`` (ConfigError naming the flag)."""
    if tp == 1:
        return
    checks = [("d-model", cfg.d_model, "the hidden size"),
              ("heads", cfg.n_heads, "attention heads (each rank holds whole heads)"),
              ("ffn", cfg.d_ff, "the MLP width (d_ff)"),
              ("vocab-size", cfg.vocab_size, "the vocabulary (split across ranks)")]
    if sequence_parallel:
        checks.append(("seq-len", cfg.seq_len, "the sequence (split across ranks by --sequence-parallel)"))
    for field, value, what in checks:
        if value % tp:
            raise ConfigError(field, f"{what} must be divisible by --tp {tp}; got {value}")


def gpt_plan(cfg: GPTConfig | None = None) -> dict[str, str | tuple[str, ...]]:
    """The GPT's Megatron tensor-parallel plan (styles: :mod:`trainmesh.tensor_parallel.plan`).
    MoE layers stay whole on every TP rank (their experts replicated over tp): their blocks'
    MLP entries name only the dense blocks. Under sequence parallelism a MoE layer runs on the
    rank's sequence chunk, so its gradients are partial over tp (``sequence_parallel``)."""
    plan = _dense_plan()
    moe = cfg.moe_blocks() if cfg is not None else []
    if moe:
        for key in ("blocks.*.mlp", "blocks.*.mlp.fc", "blocks.*.mlp.proj"):
            style = plan.pop(key)
            plan.update({key.replace("*", str(i)): style for i in range(cfg.n_layers) if i not in moe})
        plan.update({f"blocks.{i}.mlp": "sequence_parallel" for i in moe})
    return plan


def _dense_plan() -> dict[str, str | tuple[str, ...]]:
    return {
        "embed.wte": "vocab_embedding",
        "embed": "sequence_scatter",            # SP: the (wte + wpe) output is split by sequence
        "blocks.*.ln1": "sequence_parallel",
        "blocks.*.attn": "parallel_input",      # one f for q, k, v (whole heads per rank)
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.ln2": "sequence_parallel",
        "blocks.*.mlp": "parallel_input",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
        "head.ln_f": "sequence_parallel",
        "head.out": "vocab_head",               # SP: gathers its input along the sequence
        "criterion": "vocab_ce",
    }


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=512, seq_len=64, d_model=64, n_layers=4, n_heads=4),
    "small": GPTConfig(vocab_size=1024, seq_len=128, d_model=256, n_layers=6, n_heads=8),
}


class Positions(nn.Module):
    """Parameter-free: the position of each of the ``s`` tokens a rank holds, 0..s-1. Context
    parallelism swaps it for the tokens' places in the whole sequence."""

    def forward(self, s: int, device: torch.device) -> torch.Tensor:  # -> (s,)
        return torch.arange(s, device=device)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(b, s) positions restarting at 0 at each document -> (b, 1, s, s) bool, True where query
    i may attend key j: j <= i in the same document (block-diagonal causal)."""
    doc = (position_ids == 0).cumsum(-1)                                 # (b, s)
    s = position_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=position_ids.device).tril()
    return (doc.unsqueeze(-1) == doc.unsqueeze(-2)).logical_and(causal).unsqueeze(1)


class CausalAttention(nn.Module):
    """Parameter-free core of attention: causal softmax(q k^T / sqrt(hd)) v over the sequence the
    rank holds; given ``position_ids`` (packed documents), causal within each document only.
    Context parallelism swaps it for attention over the whole sequence (taking the same
    ``position_ids`` keyword)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)   # (b, heads, s, hd)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(position_ids))


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        # An explicit (meta) weight skips nn.Embedding's random init: on meta it costs seconds.
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=torch.empty(cfg.vocab_size, cfg.d_model))
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model, _weight=torch.empty(cfg.seq_len, cfg.d_model))
        self.positions = Positions()

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # (b, s) -> (b, s, d); packed documents: each token's place in its document
        pos = self.positions(idx.shape[1], idx.device) if position_ids is None else position_ids
        return self.wte(idx) + self.wpe(pos)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q, self.k, self.v = (nn.Linear(cfg.d_model, cfg.d_model) for _ in range(3))
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.causal = CausalAttention()

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention; (b, heads, s, hd) x3 -> (b, heads, s, hd). Selective recompute target."""
        if position_ids is None:   # the attention in place may not take the keyword
            return self.causal(q, k, v)
        return self.causal(q, k, v, position_ids=position_ids)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape                          # (b, s, d) -> (b, s, d)
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.q, self.k, self.v))
        y = self.core(q, k, v, position_ids)       # (b, heads_local, s, hd)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))       # (b, s, d) -> (b, s, ff) -> (b, s, d)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, moe: MoE | None = None) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp: nn.Module = moe if moe is not None else MLP(cfg)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), position_ids)
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, d) -> (b, s, vocab)
        return self.out(self.ln_f(x))


class CrossEntropySum(nn.Module):
    """(logits, labels) -> (sum of token losses, number of counted tokens); label -100 ignored."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # at least float32 (16-bit logits widened; a float64 model's kept float64)
        logits = logits.flatten(0, -2)
        loss = F.cross_entropy(logits.to(wide(logits.dtype)),
                               labels.flatten(), reduction="sum", ignore_index=-100)
        return loss, (labels != -100).sum()


class GPT(nn.Module):
    """The reference decoder. ``forward(input_ids, labels)`` -> (loss_sum, tokens); no labels -> logits."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.seed = seed
        moe = cfg.moe_blocks()
        self.moe_stats = MoEStats(len(moe), cfg.n_experts) if moe else None
        """The MoE layers' side channel to the engine (None without experts)."""
        with torch.device("meta"):
            self.embed = Embedding(cfg)
            self.blocks = nn.ModuleList(
                Block(cfg, MoE(cfg.d_model, cfg.n_experts, cfg.top_k, cfg.moe_hidden,
                               aux_coef=cfg.moe_aux_loss, index=moe.index(i), stats=self.moe_stats)
                      if i in moe else None) for i in range(cfg.n_layers))
            self.head = Head(cfg)
        self.criterion = CrossEntropySum()
        self.run_blocks = self._run_blocks
        if device != "meta":
            init_module(self, seed=seed, n_layers=cfg.n_layers)
            self.to(device)

    def init_parameter(self, name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
        """Sharded init: ``full[index]`` of parameter ``name``'s initial value, built alone (a
        ``GPT(..., device="meta")`` handed to the engine is materialised slice by slice)."""
        return init_value(name, shape, seed=self.seed, n_layers=self.cfg.n_layers, index=index)

    def _run_blocks(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, position_ids)
        return x

    # ---------------------------------------------------------------- parallel hints
    def tp_plan(self) -> dict[str, str | tuple[str, ...]]:
        return gpt_plan(self.cfg)

    def check_tp(self, tp: int, *, sequence_parallel: bool = False) -> None:
        validate_gpt(self.cfg, tp, sequence_parallel=sequence_parallel)

    def flops_per_token(self) -> float:
        """Training FLOPs per token of the whole model (MFU)."""
        return self.cfg.flops_per_token()

    def pipeline_layers(self) -> list[nn.Module]:
        """The ordered layers: embedding, each block, then final norm + head."""
        return [self.embed, *self.blocks, self.head]

    def pipeline_forward(self, names: list[str], layers: list[nn.Module], x: torch.Tensor,
                         microbatch=None) -> torch.Tensor:
        """A pipeline stage's ``layers`` on ``x``: a packed microbatch's ``position_ids`` go to
        the embedding and every block (they travel with the microbatch to every stage)."""
        pos = microbatch.get("position_ids") if isinstance(microbatch, dict) else None
        for layer in layers:
            x = layer(x) if pos is None or isinstance(layer, Head) else layer(x, pos)
        return x

    def pipeline_output(self, logits: torch.Tensor, input_ids: torch.Tensor | None = None,
                        labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None):
        """What ``forward(input_ids, labels)`` returns given the last layer's ``logits``."""
        return logits if labels is None else self.criterion(logits, labels)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None):
        """``position_ids`` (packed documents, (b, s)): positions restart at each document and
        attention stays within it; None: one sequence, positions 0..s-1."""
        x = self.embed(input_ids) if position_ids is None else self.embed(input_ids, position_ids)
        x = self.run_blocks(x) if position_ids is None else self.run_blocks(x, position_ids)
        return self.pipeline_output(self.head(x), input_ids, labels)   # logits (b, s, vocab)
