"""What the planner knows about the model: a parameter count and, optionally, its shape.

With only ``params`` the planner models the model states exactly (ZeRO accounting) and reports
activations as 0 (a note says so). With ``layers``, ``hidden`` and ``heads`` it adds a decoder
transformer's activations (Korthikanti et al. 2022) and the attention FLOPs to the time model.
``seq_len`` and ``micro_batch`` default to 2048 and 1; they set the tokens per microbatch for the
time model even when no shape is given.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainmesh.core.errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer as the planner sees it."""

    params: int
    """Logical parameter count Psi."""
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

    def __post_init__(self) -> None:
        for flag, value in (("--params", self.params), ("--layers", self.layers),
                            ("--hidden", self.hidden), ("--heads", self.heads),
                            ("--seq-len", self.seq_len), ("--micro-batch", self.micro_batch),
                            ("--vocab-size", self.vocab)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(flag, f"must be a positive integer; got {value!r}")
        if self.hidden and self.heads and self.hidden % self.heads:
            raise ConfigError("--heads", f"must divide --hidden {self.hidden}; got {self.heads}")

    @property
    def has_shape(self) -> bool:
        """Whether layers, hidden and heads are all known (activations can be modelled)."""
        return None not in (self.layers, self.hidden, self.heads)

    @property
    def tokens_per_microbatch(self) -> int:
        return self.seq_len * self.micro_batch

    def missing_shape_flags(self) -> list[str]:
        """The shape flags not given, e.g. ``["--layers", "--heads"]``."""
        names = (("--layers", self.layers), ("--hidden", self.hidden), ("--heads", self.heads))
        return [flag for flag, value in names if value is None]
