"""Published model shapes for ``trainmesh plan --model NAME`` (instead of --params and the
shape flags), with the global batch of the run that published them.

Shapes from the papers: GPT-3 (Brown et al. 2020, table 2.1; batches of 1M and 2M tokens for
1.3B and 13B, and 1536 sequences of 2048 for 175B as Narayanan et al. 2021 ran it), Llama 2
(Touvron et al. 2023: 4M-token batches) and Llama 3 (Llama Team 2024, table 3; 405B with the
16M-token batch of its table 4; 8B and 70B with 4M tokens, 512 sequences of 8192).
Grouped-query attention and the SwiGLU widths are folded into the parameter count; the planner's
activation model is Megatron's for the given layers, hidden and heads.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainmesh.core.errors import ConfigError


@dataclass(frozen=True)
class Published:
    """A published decoder: its size, shape and the run's sequence length and global batch."""

    params: int
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    global_batch: int
    """Sequences per optimizer step in the published run."""


MODELS: dict[str, Published] = {
    "gpt3-1.3b": Published(1_315_000_000, 24, 2048, 16, 50257, 2048, 512),
    "gpt3-13b": Published(12_850_000_000, 40, 5120, 40, 50257, 2048, 1024),
    "gpt3-175b": Published(174_600_000_000, 96, 12288, 96, 51200, 2048, 1536),
    "llama2-7b": Published(6_738_000_000, 32, 4096, 32, 32000, 4096, 1024),
    "llama2-70b": Published(68_977_000_000, 80, 8192, 64, 32000, 4096, 1024),
    "llama3-8b": Published(8_030_000_000, 32, 4096, 32, 128256, 8192, 512),
    "llama3-70b": Published(70_554_000_000, 80, 8192, 64, 128256, 8192, 512),
    "llama3-405b": Published(405_853_000_000, 126, 16384, 128, 128256, 8192, 2048),
}
"""Published shapes by ``--model`` name."""


def published(name: str) -> Published:
    row = MODELS.get(name.lower())
    if row is None:
        raise ConfigError("--model", f"must be a published shape ({', '.join(MODELS)}) or a "
                                     f"built-in GPT preset; got {name!r}")
    return row
