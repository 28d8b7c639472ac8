"""Published model shapes for ``trainmesh plan --model NAME`` (instead of --params and the
shape flags), with the global batch of the run that published them.

Shapes from the papers and the models' config.json: GPT-3 (Brown et al. 2020, table 2.1: 1.3B
with 24 layers, hidden 2048, 24 heads of 128; 13B with 40 layers, hidden 5140, 40 heads of 128;
175B with 96 layers, hidden 12288, 96 heads of 128; batches of 1M and 2M tokens for 1.3B and 13B,
and 1536 sequences of 2048 for 175B as Narayanan et al. 2021 ran it), Llama 2 (Touvron et al.
2023: 4M-token batches), Llama 3 (Llama Team 2024, table 3: grouped-query attention with 8
key/value heads, SwiGLU MLP; 405B with the 16M-token batch of its table 4; 8B and 70B with 4M
tokens, 512 sequences of 8192), Mixtral 8x7B (its config.json: 8 experts of 14336, top 2) and
DeepSeek-V3 (its config.json: 61 layers, hidden 7168, 128 heads, the first 3 layers dense of
18432, then 256 routed experts of 2048 and one shared, top 8; 671B parameters, 37B active, as
its README gives them). GPT-3's table lists heads x head width (3072, 5120) that is not the
hidden size (2048, 5140); the shape is taken as the table writes it. DeepSeek-V3's latent
attention is taken as 128 heads of 192 for queries and keys.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from trainmesh.core.errors import ConfigError

from .shapes import ModelShape


@dataclass(frozen=True)
class Published:
    """A published model: its shape and the global batch of the run that published it."""

    shape: ModelShape
    global_batch: int
    """Sequences per optimizer step in the published run."""


def _llama(params: int, layers: int, hidden: int, heads: int, ffn: int, *, kv: int = 8,
           vocab: int = 128256, seq: int = 8192) -> ModelShape:
    return ModelShape(params=params, layers=layers, hidden=hidden, heads=heads, kv_heads=kv,
                      ffn=ffn, gated=True, norm="rmsnorm", vocab=vocab, seq_len=seq)


def _gpt3(params: int, layers: int, hidden: int, heads: int, vocab: int = 50257) -> ModelShape:
    return ModelShape(params=params, layers=layers, hidden=hidden, heads=heads, head_dim=128,
                      vocab=vocab, seq_len=2048)


MODELS: dict[str, Published] = {
    "gpt3-1.3b": Published(_gpt3(1_300_000_000, 24, 2048, 24), 512),
    "gpt3-13b": Published(_gpt3(13_000_000_000, 40, 5140, 40), 1024),
    "gpt3-175b": Published(_gpt3(174_600_000_000, 96, 12288, 96, vocab=51200), 1536),
    "llama2-7b": Published(_llama(6_738_000_000, 32, 4096, 32, 11008, kv=32, vocab=32000, seq=4096), 1024),
    "llama2-70b": Published(_llama(68_977_000_000, 80, 8192, 64, 28672, vocab=32000, seq=4096), 1024),
    "llama3-8b": Published(_llama(8_030_000_000, 32, 4096, 32, 14336), 512),
    "llama3-70b": Published(_llama(70_554_000_000, 80, 8192, 64, 28672), 512),
    "llama3-405b": Published(_llama(405_853_000_000, 126, 16384, 128, 53248), 2048),
    "mixtral-8x7b": Published(replace(_llama(46_703_000_000, 32, 4096, 32, 14336, vocab=32000, seq=4096),
                                      experts=8, top_k=2, expert_ffn=14336), 1024),
    "deepseek-v3": Published(ModelShape(params=671_000_000_000, layers=61, hidden=7168, heads=128,
                                        head_dim=192, ffn=18432, gated=True, norm="rmsnorm",
                                        vocab=129280, seq_len=4096, experts=256, top_k=8,
                                        expert_ffn=2048, shared_ffn=2048, moe_layers=58), 15360),
}
"""Published shapes by ``--model`` name (``llama3.1-*`` are the ``llama3-*`` shapes)."""


def published(name: str) -> Published:
    row = MODELS.get(name.lower().replace("llama3.1-", "llama3-"))
    if row is None:
        raise ConfigError("--model", f"must be a published shape ({', '.join(MODELS)}) or a "
                                     f"built-in GPT preset; got {name!r}")
    return row
