"""Training data: a learnable synthetic language, text, documents and token files.

The global batch of step k is a function of (seed, k) only, whatever the layout; each DP rank
takes its contiguous slice of rows (:func:`dp_slice`). Evaluation reads a held-out split
(:func:`make_datasets`): the last 5% of a token stream, or a disjoint seed stream of the
synthetic language. Files are read window by window (:mod:`trainmesh.data.token_cache`), never
loaded whole. A batch is a dict with ``input_ids`` and
``labels`` (the next tokens), both (batch, seq) int64; with ``--documents packed``
(:mod:`trainmesh.data.packing`) also ``position_ids``, and -100 labels where a document ends.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainmesh.core.errors import ConfigError
from trainmesh.data.prepare import Begin, quiet
from trainmesh.data.token_cache import SCAN_TOKENS, TokenView, id_range

Batch = dict[str, torch.Tensor]


HELD_OUT_FRACTION = 0.05
"""The share of a token stream held out for evaluation (its end)."""
_EVAL_STREAM = 0x9E3779B9
"""Added to the synthetic corpus' generator seeds for evaluation: disjoint from training's
(steps below 2.6e9). The CPU generator keeps a seed's low 32 bits, hence an offset below 2**32."""


def _generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step + stream) % 2**63)  # any int64 seed


@dataclass
class SyntheticCorpus:
    """A procedurally generated language with learnable structure.

    Each token has ``branching`` successors with skewed probabilities (a random sparse bigram
    grammar fixed by ``language_seed``), so the best achievable loss is far below log(vocab)
    (about 1.1 nats with the defaults) and a small model learns it within a few hundred steps.
    """

    vocab_size: int
    seq_len: int
    branching: int = 4
    language_seed: int = 1234
    stream: int = 0
    """Offset of the sample seeds: 0 trains, ``_EVAL_STREAM`` evaluates (same language)."""

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.language_seed)
        self.successors = torch.randint(0, self.vocab_size, (self.vocab_size, self.branching), generator=g)
        probs = torch.tensor([0.55, 0.25, 0.12, 0.08][: self.branching] or [1.0])
        self.probs = probs / probs.sum()

    def batch(self, seed: int, step: int, batch_size: int) -> Batch:
        g = _generator(seed, step, self.stream)
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=g)
        choice = torch.multinomial(self.probs, batch_size * self.seq_len, replacement=True,
                                   generator=g).view(batch_size, self.seq_len)
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], choice[:, t]]
        return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


@dataclass
class TokenStream:
    """Random windows of a token stream (a text file read as bytes, a token file or the token
    cache of a tokenised text), read from the file window by window."""

    tokens: TokenView
    seq_len: int

    def batch(self, seed: int, step: int, batch_size: int) -> Batch:
        _, rows_t = self.windows(seed, step, batch_size)
        return {"input_ids": rows_t[:, :-1].contiguous(), "labels": rows_t[:, 1:].contiguous()}

    def windows(self, seed: int, step: int, batch_size: int) -> tuple[list[int], torch.Tensor]:
        """(where each starts, the windows (batch, seq + 1) int64) of step ``step``."""
        g = _generator(seed, step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (batch_size,), generator=g)
        self.tokens.file.check()   # truncated or replaced since it was opened: DataError
        rows = np.stack([self.tokens.window(s, self.seq_len + 1) for s in starts.tolist()])
        return starts.tolist(), torch.from_numpy(rows.astype(np.int64))   # (batch, seq + 1)


def load_tokens(path: str, tokenizer: str = "bytes", *, text_field: str = "text",
                model_dir: str | None = None, progress: Begin = quiet) -> TokenView:
    """A token file (.npy, or .bin as uint16 like nanoGPT), or text — a text file read as bytes
    (vocab 256), or text and documents (JSON-lines, Parquet, a saved ``datasets`` directory)
    tokenised by ``tokenizer`` (:func:`trainmesh.data.tokenizer.tokens_of`, cached): opened,
    never loaded."""
    from trainmesh.data.tokenizer import tokens_of
    return tokens_of(path, tokenizer, text_field=text_field, model_dir=model_dir, progress=progress)


def check_tokens(tokens: TokenView, path: str, *, vocab_size: int, seq_len: int) -> None:
    """A token stream fit to train on: integer ids, one dimension, 0 <= id < vocab, long enough
    (the ids are scanned in chunks)."""
    if tokens.dtype.kind not in "iu":
        raise ConfigError("--data", f"{path!r} holds {tokens.dtype} values; token ids must be an "
                          "integer array (int or uint)")
    shape = tokens.file.shape
    if len(shape) != 1:
        raise ConfigError("--data", f"{path!r} has shape {shape}; a token file must be one "
                          "flat (1-D) sequence of ids")
    if len(tokens) < seq_len + 2:
        raise ConfigError("--data", f"{path!r} has {len(tokens)} tokens; need more than "
                          f"--seq-len + 1 = {seq_len + 1}")
    low, top = id_range(tokens)
    if low < 0:
        raise ConfigError("--data", f"{path!r} holds a negative token id ({low}); ids must be "
                          f"in 0..--vocab-size - 1")
    if top >= vocab_size:
        raise ConfigError("--vocab-size", f"must exceed the largest token id {top} in --data "
                          f"{path!r}; got {vocab_size}")


def split_tokens(tokens: TokenView, path: str, seq_len: int) -> tuple[TokenView, TokenView]:
    """(training tokens, held-out tokens): the held-out split is the stream's last 5%, at least
    one window of ``seq_len + 2`` tokens."""
    held = max(int(len(tokens) * HELD_OUT_FRACTION), seq_len + 2)
    if len(tokens) - held < seq_len + 2:
        raise ConfigError("--eval-every", f"needs --data long enough to hold out {held} tokens "
                          f"and train on {seq_len + 2}; {path!r} has {len(tokens)}")
    return tokens.split(len(tokens) - held)


def make_datasets(data: str, *, vocab_size: int, seq_len: int, held_out: bool,
                  tokenizer: str = "bytes", text_field: str = "text", model_dir: str | None = None,
                  documents: str = "stream", progress: Begin = quiet):
    """(training set, evaluation set or None): with ``held_out``, a deterministic split that
    every rank and layout computes alike (see :func:`split_tokens`). ``tokenizer``,
    ``text_field`` and ``model_dir``: how text data becomes tokens (:func:`load_tokens`);
    ``documents``: ``stream`` or ``packed`` (:mod:`trainmesh.data.packing`); ``progress``: who
    is told of a tokenisation under way (:mod:`trainmesh.data.prepare`)."""
    if data == "synthetic":
        if documents == "packed":
            raise ConfigError("--documents", "packed needs documents; the synthetic language "
                              "has none (valid with it: stream)")
        train = SyntheticCorpus(vocab_size, seq_len)
        return train, (SyntheticCorpus(vocab_size, seq_len, stream=_EVAL_STREAM) if held_out else None)
    if documents == "packed":
        from trainmesh.data.packing import PackedStream, packed_tokens
        tokens, starts = packed_tokens(data, tokenizer, text_field=text_field, model_dir=model_dir,
                                       progress=progress)
        stream = lambda view: PackedStream(TokenStream(view, seq_len), starts)   # noqa: E731
    else:
        tokens = load_tokens(data, tokenizer, text_field=text_field, model_dir=model_dir,
                             progress=progress)
        stream = lambda view: TokenStream(view, seq_len)   # noqa: E731
    check_tokens(tokens, data, vocab_size=vocab_size, seq_len=seq_len)
    if not held_out:
        return stream(tokens), None
    train, val = split_tokens(tokens, data, seq_len)
    return stream(train), stream(val)


def resident_bytes(data: str, *, vocab_size: int, seq_len: int, global_batch: int) -> int:
    """What a worker's data path keeps in its own memory: a batch's windows and their int64
    copies, plus the scan buffer of a file or the synthetic language's successor table. A file
    is read window by window, never held; the page cache it warms is not the process's."""
    batch = global_batch * (seq_len + 1) * 8 * 4     # windows, stacked, int64, inputs + labels
    if data == "synthetic":
        return batch + vocab_size * 4 * 8
    return batch + SCAN_TOKENS * 8 * 2               # a chunk of the id scan and its min/max


def dp_slice(batch: Batch, dp_rank: int, dp: int) -> Batch:
    """This DP rank's contiguous rows of the global batch."""
    rows = next(iter(batch.values())).shape[0]
    if rows % dp:
        raise ConfigError("global-batch", f"must be divisible by dp={dp}; got {rows}")
    n = rows // dp
    return {k: v[dp_rank * n : (dp_rank + 1) * n] for k, v in batch.items()}


def _rows(batch: Any) -> int:
    """Rows (dim 0) of a tensor, a tuple/list of tensors or a dict of tensors."""
    parts = list(batch.values()) if isinstance(batch, dict) else \
        list(batch) if isinstance(batch, (tuple, list)) else [batch]
    tensors = [t for t in parts if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors:
        raise TypeError(f"a batch is a tensor, a tuple/list of tensors or a dict of tensors; "
                        f"got {type(batch).__name__} with no tensor of dim >= 1")
    rows = {t.shape[0] for t in tensors}
    if len(rows) > 1:
        raise ValueError(f"the batch's tensors disagree on their rows (dim 0): {sorted(rows)}")
    return rows.pop()


def split_microbatches(batch: Any, m: int) -> list[Any]:
    """Split a tensor, a tuple/list of tensors or a dict of tensors along dim 0 into ``m`` equal
    microbatches of the same kind (values that are not tensors are passed to every microbatch)."""
    rows = _rows(batch)
    if rows % m:
        raise ConfigError("microbatches", f"{m} microbatches must divide this rank's batch of "
                          f"{rows} rows")

    def part(value: Any, i: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value[i * (rows // m) : (i + 1) * (rows // m)]
        return value

    if isinstance(batch, dict):
        return [{k: part(v, i) for k, v in batch.items()} for i in range(m)]
    if isinstance(batch, (tuple, list)):
        return [type(batch)(part(v, i) for v in batch) for i in range(m)]
    return [part(batch, i) for i in range(m)]
