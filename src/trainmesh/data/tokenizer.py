"""Tokenisation of text data (``--tokenizer bytes|bpe:VOCAB|model``).

``bytes`` reads the file as bytes (vocabulary 256): the text is its own token file, read
window by window. ``bpe:VOCAB`` trains a byte-level BPE of at most VOCAB tokens on the file with
the ``tokenizers`` library and encodes it once; the model's vocabulary becomes VOCAB. Both passes
stream the text in pieces (:func:`text_pieces`), so no process holds the whole text or all its
ids. Tokenizer and token ids are cached beside the file (or in the user cache directory when
that is not writable), keyed by VOCAB and the file's fingerprint: size, mtime and the hash of
its first MiB (``FILE.bpe512-<hash>.json`` / ``.npy``), and written atomically (a temporary
file, then a rename): the launcher's preflight tokenises before any worker starts, and ranks
that start at once (torchrun) compute the same bytes, so whichever rename lands last wins with
identical content. Workers read the ids through :class:`~trainmesh.data.token_cache.TokenView`.

Sources of documents (JSON-lines, Parquet, a saved ``datasets`` directory;
:mod:`trainmesh.data.documents`) are read as the text of their documents, each followed by a
blank line, under ``bytes`` and ``bpe``; ``model`` (:mod:`trainmesh.data.model_tokenizer`)
encodes every source document by document. :func:`tokens_of` picks the path.
"""
from __future__ import annotations

import codecs
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from trainmesh.core.errors import ConfigError
from trainmesh.data.documents import data_format, documents, source_fingerprint
from trainmesh.data.prepare import Begin, Counted, quiet
from trainmesh.data.token_cache import (
    TokenView,
    cache_dir,
    fingerprint,
    open_tokens,
    write_atomic,
    write_token_cache,
)

MIN_BPE_VOCAB = 257
"""The 256 byte tokens plus at least one merge."""
MAX_BPE_VOCAB = 2**31 - 1
PIECE_BYTES = 1 << 14
"""Bytes of text read, trained on and encoded at a time (16 KiB). Small: the ``tokenizers``
trainer buffers a few hundred pieces ahead (on 40 MB of text, 4 MiB pieces held 765 MiB while
training, 64 KiB pieces 49 MiB, 16 KiB pieces 14 MiB, all in about the same time), and an
encoding costs ~50 bytes per token until it is freed."""


def bpe_vocab(spec: str) -> int | None:
    """``"bytes"`` or ``"model"`` -> None; ``"bpe:N"`` -> N; anything else: ConfigError naming
    --tokenizer."""
    if spec in ("bytes", "model"):
        return None
    kind, _, n = spec.partition(":")
    if kind == "bpe" and n.isdigit() and MIN_BPE_VOCAB <= int(n) <= MAX_BPE_VOCAB:
        return int(n)
    raise ConfigError("--tokenizer", f"must be 'bytes', 'model' or 'bpe:VOCAB' with VOCAB an "
                      f"integer >= {MIN_BPE_VOCAB} (256 bytes plus merges); got {spec!r}")


def tokens_of(data: str, tokenizer: str = "bytes", *, text_field: str = "text",
              model_dir: str | None = None, progress: Begin = quiet) -> TokenView:
    """The token ids of ``--data`` under ``--tokenizer``: a token file as it is, text and
    documents tokenised (cached; the work told to ``progress``, :mod:`trainmesh.data.prepare`).
    ConfigError naming the flag for what cannot be."""
    fmt = data_format(data)
    if fmt == "tokens":
        if tokenizer != "bytes":
            raise ConfigError("--tokenizer", f"tokenises text; {data!r} holds token ids already")
        return open_tokens(data)
    if tokenizer == "model":
        if model_dir is None:
            raise ConfigError("--tokenizer", "model tokenises with the --model-dir's tokenizer; "
                              "needs --model-dir (valid without it: bytes or bpe:VOCAB)")
        from trainmesh.data.model_tokenizer import model_tokens
        return model_tokens(data, fmt, model_dir=model_dir, text_field=text_field, progress=progress)
    vocab = bpe_vocab(tokenizer)
    if vocab is not None:
        return bpe_tokens(data, vocab, fmt=fmt, text_field=text_field, progress=progress)
    return open_tokens(data) if fmt == "text" else _bytes_tokens(data, fmt, text_field, progress)


def text_size(data: str, fmt: str) -> int | None:
    """Bytes of text a pass over ``data`` reads: a text file's size (None for documents, whose
    text is known only once read)."""
    return os.path.getsize(data) if fmt == "text" else None


def _pieces(data: str, fmt: str, text_field: str) -> Callable[[], Iterator[str]]:
    """The text of a source in pieces: a text file's, or each document and a blank line."""
    if fmt == "text":
        return lambda: text_pieces(data)
    return lambda: (doc + "\n\n" for doc in documents(data, fmt, text_field))


def _stem(data: str, fmt: str, text_field: str, kind: str) -> str:
    """The cache's file name (without suffix): the source's name, ``kind`` and fingerprint."""
    fp = fingerprint(data) if fmt == "text" else source_fingerprint(data, fmt, text_field)
    return f"{Path(data).name}.{kind}-{fp}"


def cache_paths(data: str, vocab: int, *, fmt: str = "text", text_field: str = "text"
                ) -> tuple[Path, Path]:
    """(tokenizer JSON, token ids .npy) of ``data`` under a ``vocab``-token BPE: beside the
    data (else the user cache directory), named by its fingerprint."""
    stem = _stem(data, fmt, text_field, f"bpe{vocab}")
    where = cache_dir(data)
    return where / (stem + ".json"), where / (stem + ".npy")


def bpe_tokens(data: str, vocab: int, *, fmt: str = "text", text_field: str = "text",
               progress: Begin = quiet) -> TokenView:
    """The token ids of ``data`` under its ``vocab``-token BPE (trained and encoded once into
    the cache, then opened, never loaded)."""
    try:
        tok_path, ids_path = cache_paths(data, vocab, fmt=fmt, text_field=text_field)
        if not ids_path.exists():
            _train(_pieces(data, fmt, text_field), vocab, tok_path, ids_path, progress=progress,
                   data=data, total=text_size(data, fmt))
    except (OSError, ValueError) as exc:
        raise ConfigError("--tokenizer", f"cannot tokenise {data!r}: {exc}") from None
    return open_tokens(str(ids_path))


def _bytes_tokens(data: str, fmt: str, text_field: str, progress: Begin = quiet) -> TokenView:
    """The UTF-8 bytes of a source's documents, each followed by a blank line (cached)."""
    path = cache_dir(data) / (_stem(data, fmt, text_field, "bytes") + ".npy")
    if not path.exists():
        with progress(f"writing the text of {data} as bytes", total=None, cache=path) as work:
            pieces = Counted(_pieces(data, fmt, text_field)(), work)
            write_token_cache(path, np.dtype(np.uint8),
                              (np.frombuffer(p.encode(), dtype=np.uint8) for p in pieces))
    return open_tokens(str(path))


def text_pieces(path: str, piece_bytes: int | None = None) -> Iterator[str]:
    """The text of ``path`` (UTF-8, undecodable bytes replaced) in pieces of about
    ``piece_bytes``, each cut before a space that follows a letter or digit: the byte-level
    pre-tokenizer splits there anyway, so the pieces train and encode exactly as the whole text
    would. A stretch with no such space is cut at ``4 x piece_bytes`` characters."""
    piece_bytes = piece_bytes or PIECE_BYTES
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    carry = ""
    with open(path, "rb") as f:
        while True:
            raw = f.read(piece_bytes)
            text = carry + decoder.decode(raw, final=not raw)
            if not raw:
                if text:
                    yield text
                return
            cut = _cut(text)
            if cut <= 0 and len(text) < 4 * piece_bytes:
                carry = text
                continue
            cut = cut if cut > 0 else len(text)
            yield text[:cut]
            carry = text[cut:]


def _cut(text: str) -> int:
    """The last index of a space after a letter or digit (a pre-token boundary), else -1."""
    at = text.rfind(" ")
    while at > 0 and not text[at - 1].isalnum():
        at = text.rfind(" ", 0, at)
    return at


def _train(pieces: Callable[[], Iterator[str]], vocab: int, tok_path: Path, ids_path: Path, *,
           progress: Begin = quiet, data: str = "the text", total: int | None = None) -> None:
    """Train the BPE on one pass over ``pieces()``, then encode a second pass into the cache
    (each pass told to ``progress``; the second knows its total from the first)."""
    try:
        from tokenizers import ByteLevelBPETokenizer
    except ImportError:
        raise ConfigError("--tokenizer", "bpe needs the tokenizers package "
                          "(pip install tokenizers)") from None
    tok = ByteLevelBPETokenizer()
    with progress(f"training a byte-level BPE of {vocab} tokens on {data}", total=total,
                  cache=tok_path) as work:
        read = Counted(pieces(), work, then="computing the merges")
        tok.train_from_iterator(iter(read), vocab_size=vocab, min_frequency=2, show_progress=False)
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.int32)
    with progress(f"encoding {data} with its BPE of {vocab} tokens", total=read.bytes,
                  cache=ids_path) as work:
        write_token_cache(ids_path, dtype, (np.asarray(tok.encode(piece).ids, dtype=dtype)
                                            for piece in Counted(pieces(), work)))
    write_atomic(tok_path, lambda f: f.write(tok._tokenizer.to_str().encode()))
