"""What the planner knows about the model: a parameter count and, optionally, its shape.

With only ``params`` the planner models the model states exactly (ZeRO accounting) and reports
activations as 0 (a note says so). With ``layers``, ``hidden`` and ``heads`` it adds a decoder
transformer's activations (:mod:`.activations`) and the attention FLOPs to the time model.
``seq_len`` and ``micro_batch`` default to 2048 and 1; they set the tokens per microbatch for the
time model even when no shape is given.

The rest of the shape defaults to a GPT block (every head its own keys and values, a 4h GELU
MLP, LayerNorm); a Llama-style model sets ``kv_heads`` (grouped-query attention), ``ffn`` and
``gated`` (SwiGLU: three matrices) and ``norm="rmsnorm"``; ``head_dim`` where heads x head_dim
is not the hidden size (GPT-3 13B: 40 x 128 = 5120 against a hidden size of 5140).

A mixture of experts (``experts`` E > 0) replaces the MLP of ``moe_layers`` layers (default:
all) by a router and E experts of width ``expert_ffn``, each token running through ``top_k`` of
them, plus ``shared_ffn`` of always-on shared experts (DeepSeek, Qwen-MoE). ``params`` counts
every expert; :attr:`ModelShape.active_params` (what a token runs through) sets the FLOPs.

Muon (``--optimizer muon``) takes the hidden weight matrices (:meth:`ModelShape.hidden_matrices`:
attention projections, MLPs, routers, each expert's matrices; not embeddings, head, norms or
biases), the same split ``trainmesh train`` makes.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainmesh.core.errors import ConfigError

NORMS = ("layernorm", "rmsnorm")
NORM_STATS = {"layernorm": 2, "rmsnorm": 1}
"""fp32 statistics a norm keeps per token for its backward (mean and rstd; rstd)."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer as the planner sees it."""

    params: int
    """Logical parameter count Psi (every expert counted)."""
    layers: int | None = None
    """Transformer layers L (None: unknown)."""
    hidden: int | None = None
    """Hidden size h (None: unknown)."""
    heads: int | None = None
    """Attention heads a (None: unknown)."""
    seq_len: int = 2048
    """Sequence length s."""
    micro_batch: int = 1
    """Sequences per microbatch per DP rank, b."""
    vocab: int | None = None
    """Vocabulary size (adds the logits to the last stage's activations when given)."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention; None: one per head)."""
    head_dim: int | None = None
    """Width of one head (None: hidden / heads)."""
    ffn: int | None = None
    """MLP width of a dense layer (None: 4 hidden)."""
    gated: bool = False
    """SwiGLU-style MLP (gate, up and down matrices) instead of fc, GELU, proj."""
    norm: str = "layernorm"
    """``layernorm`` or ``rmsnorm``."""
    experts: int = 0
    """Routed experts per MoE layer (0: dense)."""
    top_k: int = 1
    """Experts each token is routed to."""
    expert_ffn: int | None = None
    """Width of one routed expert (None: the dense MLP width over top_k)."""
    shared_ffn: int = 0
    """Width of the shared experts of a MoE layer, summed (every token runs through them)."""
    moe_layers: int | None = None
    """Layers whose MLP is a mixture of experts (None: all of them when ``experts``)."""
    document_len: float | None = None
    """Packed documents: their mean length weighted by length (sum of L^2 over sum of L), the
    keys a token's attention spans on average (None: one sequence of ``seq_len``)."""

    def __post_init__(self) -> None:
        for flag, value in (("--params", self.params), ("--layers", self.layers),
                            ("--hidden", self.hidden), ("--heads", self.heads),
                            ("--seq-len", self.seq_len), ("--micro-batch", self.micro_batch),
                            ("--vocab-size", self.vocab), ("--kv-heads", self.kv_heads),
                            ("head_dim", self.head_dim), ("--ffn", self.ffn),
                            ("--expert-ffn", self.expert_ffn)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(flag, f"must be a positive integer; got {value!r}")
        if self.hidden and self.heads and self.head_dim is None and self.hidden % self.heads:
            raise ConfigError("--heads", f"must divide --hidden {self.hidden}; got {self.heads}")
        if self.kv_heads and self.heads and self.heads % self.kv_heads:
            raise ConfigError("--kv-heads", f"must divide --heads {self.heads}; got {self.kv_heads}")
        if self.norm not in NORMS:
            raise ConfigError("norm", f"must be one of {', '.join(NORMS)}; got {self.norm!r}")
        if self.experts < 0 or (self.experts and not 1 <= self.top_k <= self.experts):
            raise ConfigError("--top-k", f"must be in 1..--experts ({self.experts}); got {self.top_k}")
        if self.moe_layers is not None and self.layers and not 0 <= self.moe_layers <= self.layers:
            raise ConfigError("moe_layers", f"must be in 0..{self.layers}; got {self.moe_layers}")
        if self.document_len is not None and not 1 <= self.document_len <= self.seq_len:
            raise ConfigError("--document-len", f"must be in 1..--seq-len ({self.seq_len}); "
                                                f"got {self.document_len!r}")

    @property
    def has_shape(self) -> bool:
        """Whether layers, hidden and heads are all known (activations can be modelled)."""
        return None not in (self.layers, self.hidden, self.heads)

    @property
    def attention_len(self) -> float:
        """The keys a token's attention is counted over: its document's length (packed
        documents, weighted by length), else the whole sequence."""
        return self.seq_len if self.document_len is None else self.document_len

    @property
    def tokens_per_microbatch(self) -> int:
        return self.seq_len * self.micro_batch

    def missing_shape_flags(self) -> list[str]:
        """The shape flags not given, e.g. ``["--layers", "--heads"]``."""
        names = (("--layers", self.layers), ("--hidden", self.hidden), ("--heads", self.heads))
        return [flag for flag, value in names if value is None]

    # ------------------------------------------------------------ derived widths
    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): heads x head_dim."""
        assert self.hidden and self.heads
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): kv_heads x head_dim."""
        assert self.heads
        return self.q_dim * (self.kv_heads or self.heads) // self.heads

    @property
    def ffn_width(self) -> int:
        assert self.hidden
        return self.ffn or 4 * self.hidden

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layer_count(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        if not self.experts:
            return 0
        return self.layers or 0 if self.moe_layers is None else self.moe_layers

    @property
    def expert_width(self) -> int:
        return self.expert_ffn or max(1, self.ffn_width // self.top_k)

    def mlp_params(self, width: int) -> int:
        """Parameters of one MLP of ``width`` (gated: three matrices; else two plus biases)."""
        assert self.hidden
        h = self.hidden
        return 3 * h * width if self.gated else 2 * h * width + width + h

    @property
    def expert_params(self) -> int:
        """Parameters of every routed expert of the model (0: dense or shape unknown)."""
        if not self.experts or not self.hidden:
            return 0
        return self.moe_layer_count * self.experts * self.mlp_params(self.expert_width)

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: every expert but the top_k of each MoE layer left
        out (the FLOPs of 6 x active params per token)."""
        if not self.expert_params:
            return self.params
        idle = self.moe_layer_count * (self.experts - self.top_k) * self.mlp_params(self.expert_width)
        return self.params - idle

    def hidden_matrices(self) -> list[tuple[int, tuple[int, int], bool]]:
        """Muon's matrices of the whole model: (how many, (rows, columns), routed expert's)
        per kind: each layer's q, k, v and output projections, a dense layer's MLP (gated:
        three matrices, else two), a MoE layer's router, each routed expert's matrices and the
        shared experts'. Latent attention is taken as full heads (module doc of
        :mod:`.model_dir`)."""
        assert self.hidden and self.layers and self.has_shape
        h, layers, moe = self.hidden, self.layers, self.moe_layer_count
        per_mlp = 3 if self.gated else 2
        kinds = [(layers, (self.q_dim, h), False), (2 * layers, (self.kv_dim, h), False),
                 (layers, (h, self.q_dim), False),
                 ((layers - moe) * per_mlp, (self.ffn_width, h), False),
                 (moe, (self.experts, h), False),
                 (moe * self.experts * per_mlp, (self.expert_width, h), True),
                 (moe * per_mlp if self.shared_ffn else 0, (self.shared_ffn or 1, h), False)]
        return [k for k in kinds if k[0]]
