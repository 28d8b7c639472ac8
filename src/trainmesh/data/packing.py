"""Packed documents (``--documents packed``): sequences of whole documents and pieces of long ones.

A packed sequence is a window of the token stream, as in stream mode (the same random starts,
a function of (seed, step)); what changes is that the documents in it are kept apart. The
window is cut at every document start inside it, and the piece before the first cut (the end
of a document begun before the window) and the piece after the last (a document the window
ends in) are documents of their own: so the stream of documents is packed greedily, in order,
each document that does not fit what is left of a sequence split between sequences. The batch
gains ``position_ids`` (batch, seq) int64: 0 at the first token of every document (or piece)
and counting up within it; the label of a document's last token (the one whose next token
starts another document) is -100, the loss's ignore index. The document of a token is
``cumsum(position_ids == 0)`` along its row (:func:`document_ids`).

Where the documents start is read from an index: the ascending token offsets of every
document's first token (int64, ``.npy``, read with ``pread`` like the tokens, never loaded),
cached beside the data. Its sources (:func:`packed_tokens`):

- ``--tokenizer bytes`` and ``bpe:VOCAB``: each document (a text file's paragraphs, a record's
  text field) is encoded alone, followed by a blank line, into a token cache of its own written
  with the index;
- ``--tokenizer model``: the stream mode's cache, whose every document ends with the
  tokenizer's end-of-sequence id, split after each EOS;
- a token file (``.npy``, ``.bin``) with ``--model-dir``: split after each EOS id of the model
  directory's tokenizer (else its ``config.json``'s ``eos_token_id``).
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainmesh.core.errors import ConfigError
from trainmesh.data.prepare import Begin, Counted, quiet
from trainmesh.data.token_cache import TokenView, cache_dir, fingerprint, open_tokens, write_token_cache

Batch = dict[str, torch.Tensor]
IGNORE = -100
"""The label the loss ignores: a document's last token predicts nothing."""


# ---------------------------------------------------------------- one packed batch
def pack_windows(windows: torch.Tensor, cuts: list[list[int]]) -> Batch:
    """The batch of ``windows`` (batch, seq + 1) whose row ``r`` has documents starting at
    offsets ``cuts[r]`` (each in 1..seq): ``input_ids``, ``labels`` (-100 where the next token
    starts another document) and ``position_ids`` (restarting at each start), (batch, seq)."""
    b, n = windows.shape
    seq = n - 1
    starts = torch.zeros(b, n, dtype=torch.bool)            # a document starts at this token
    starts[:, 0] = True
    for r, row in enumerate(cuts):
        starts[r, row] = True
    labels = windows[:, 1:].clone()
    labels[starts[:, 1:]] = IGNORE                          # the next token is another document's
    return {"input_ids": windows[:, :-1].contiguous(), "labels": labels,
            "position_ids": positions_of(starts[:, :seq])}


def positions_of(starts: torch.Tensor) -> torch.Tensor:
    """(batch, seq) bool, True at each document's first token -> each token's place in its
    document, int64 (0 at every start)."""
    seq = starts.shape[1]
    at = torch.arange(seq).expand_as(starts)
    begun = torch.where(starts, at, torch.zeros_like(at)).cummax(dim=1).values
    return at - begun


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """The document of each token: ``cumsum(position_ids == 0)`` along the row, (..., seq)."""
    return (position_ids == 0).cumsum(-1)


def documents_in(batch: Batch) -> int | None:
    """Documents (and pieces) in a packed batch; None for a batch of stream mode."""
    pos = batch.get("position_ids")
    return None if pos is None else int((pos == 0).sum())


# ---------------------------------------------------------------- the stream, packed
@dataclass
class PackedStream:
    """The windows of a token stream (:class:`~trainmesh.data.corpus.TokenStream`, the same
    random starts), packed: each cut at the document starts of ``starts`` (absolute token
    offsets in the file)."""

    stream: Any
    starts: TokenView

    @property
    def tokens(self) -> TokenView:
        return self.stream.tokens

    def batch(self, seed: int, step: int, batch_size: int) -> Batch:
        at, rows = self.stream.windows(seed, step, batch_size)   # (batch, seq + 1)
        self.starts.file.check()
        return pack_windows(rows, [self.cuts(s) for s in at])

    def cuts(self, at: int) -> list[int]:
        """The document starts inside the window at ``at`` (offsets 1..seq of the window)."""
        seq = self.stream.seq_len
        first = self.tokens.start + at
        i = _after(self.starts, first)                      # the first start past the window's first
        ahead = min(seq, len(self.starts) - i)
        if ahead <= 0:
            return []
        found = self.starts.window(i, ahead).astype(np.int64) - first
        return [int(c) for c in found if c <= seq]


def _after(starts: TokenView, value: int) -> int:
    """Index of the first entry of the ascending ``starts`` greater than ``value`` (bisection,
    one 8-byte read a probe)."""
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if int(starts.window(mid, 1)[0]) <= value:
            lo = mid + 1
        else:
            hi = mid
    return lo


# ---------------------------------------------------------------- the index of document starts
def packed_tokens(data: str, tokenizer: str, *, text_field: str = "text",
                  model_dir: str | None = None, progress: Begin = quiet) -> tuple[TokenView, TokenView]:
    """(tokens, document starts) of ``--data`` under ``--tokenizer`` (module docstring), both
    cached and opened, never loaded."""
    from trainmesh.data.documents import data_format
    from trainmesh.data.tokenizer import bpe_vocab, tokens_of
    fmt = data_format(data)
    if fmt == "tokens" or tokenizer == "model":
        tokens = tokens_of(data, tokenizer, text_field=text_field, model_dir=model_dir,
                           progress=progress)
        if model_dir is None:
            raise ConfigError("--documents", f"packed splits the token file {data!r} at the EOS "
                              "id of --model-dir's tokenizer; give --model-dir, or use stream")
        return tokens, _eos_index(tokens, model_dir, progress)
    return _encoded(data, fmt, bpe_vocab(tokenizer), text_field, progress)


def eos_of(model_dir: str) -> int:
    """The end-of-sequence id of ``model_dir``: its tokenizer's, else its config.json's
    ``eos_token_id`` (the first of a list); ConfigError naming --documents if neither."""
    from trainmesh.data.model_tokenizer import has_tokenizer, load_tokenizer
    if has_tokenizer(model_dir):
        return int(load_tokenizer(model_dir).eos_token_id)
    try:
        eos = json.loads((Path(model_dir) / "config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        eos = None
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if not isinstance(eos, int):
        raise ConfigError("--documents", f"packed splits a token file at the EOS id of "
                          f"--model-dir, and {model_dir} names none (no tokenizer, no "
                          "eos_token_id in config.json); valid: stream")
    return eos


def _eos_index(tokens: TokenView, model_dir: str, progress: Begin) -> TokenView:
    """The starts of ``tokens``' documents: 0 and every offset after an EOS id (cached)."""
    from trainmesh.data.model_tokenizer import TOKENIZER_FILES
    path = tokens.file.path
    tokenizer_files = [Path(model_dir) / n for n in TOKENIZER_FILES] + [Path(model_dir) / "config.json"]
    key = "-".join(fingerprint(str(f)) for f in tokenizer_files if f.is_file())
    stem = f"{Path(path).name}.docs-{hashlib.sha256(key.encode()).hexdigest()[:12]}-{fingerprint(path)}"
    index = cache_dir(path) / (stem + ".npy")
    if not index.exists():
        eos = eos_of(model_dir)
        whole = TokenView(tokens.file)

        def starts() -> Iterator[np.ndarray]:
            yield np.zeros(1, np.int64)
            at = 0
            for part in whole.chunks():
                after = np.flatnonzero(part == eos) + at + 1
                yield after[after < len(whole)]
                at += len(part)

        with progress(f"indexing the documents of {path} at EOS id {eos}", total=None, cache=index):
            write_token_cache(index, np.dtype(np.int64), starts())
    return open_tokens(str(index))


def _encoded(data: str, fmt: str, vocab: int | None, text_field: str,
             progress: Begin) -> tuple[TokenView, TokenView]:
    """Each document encoded alone (bytes, or the source's BPE) and a blank line, into a token
    cache and the index of its starts, written once (the index last: present means both are)."""
    from trainmesh.data.tokenizer import _stem, bpe_tokens, cache_paths
    kind = "packed-bytes" if vocab is None else f"packed-bpe{vocab}"
    stem = _stem(data, fmt, text_field, kind)
    ids_path, index = cache_dir(data) / (stem + ".npy"), cache_dir(data) / (stem + ".docs.npy")
    if not index.exists():
        if vocab is None:
            dtype, encode = np.dtype(np.uint8), lambda text: np.frombuffer(text.encode(), np.uint8)
        else:
            bpe_tokens(data, vocab, fmt=fmt, text_field=text_field, progress=progress)  # trains it
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(str(cache_paths(data, vocab, fmt=fmt, text_field=text_field)[0]))
            dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.int32)
            encode = lambda text: np.asarray(tok.encode(text).ids, dtype=dtype)   # noqa: E731
        _write_documents(data, fmt, text_field, ids_path, index, dtype, encode, progress)
    return open_tokens(str(ids_path)), open_tokens(str(index))


def _write_documents(data: str, fmt: str, text_field: str, ids_path: Path, index: Path,
                     dtype: np.dtype, encode: Callable[[str], np.ndarray], progress: Begin) -> None:
    """Stream every document's ids into ``ids_path`` and their lengths into a scratch file,
    then the starts (their running sum) into ``index``."""
    from trainmesh.data.documents import documents
    lengths = index.with_name(f".{index.name}.{os.getpid()}.lengths")
    try:
        with open(lengths, "wb") as out, progress(f"encoding the documents of {data} one by one",
                                                  total=None, cache=ids_path) as work:
            def ids() -> Iterator[np.ndarray]:
                for doc in Counted(documents(data, fmt, text_field), work):
                    one = encode(doc + "\n\n")
                    out.write(np.int64(len(one)).tobytes())
                    yield one
            write_token_cache(ids_path, dtype, ids())

        def starts() -> Iterator[np.ndarray]:
            total = 0
            with open(lengths, "rb") as f:
                while part := f.read(8 << 20):
                    ends = np.cumsum(np.frombuffer(part, np.int64)) + total
                    yield np.concatenate([[total], ends[:-1]]).astype(np.int64)
                    total = int(ends[-1])

        write_token_cache(index, np.dtype(np.int64), starts())
    finally:
        lengths.unlink(missing_ok=True)
