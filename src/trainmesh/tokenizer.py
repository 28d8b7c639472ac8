"""Tokenisation of a text file (``--tokenizer bytes|bpe:VOCAB``).

``bytes`` reads the file as bytes (vocabulary 256). ``bpe:VOCAB`` trains a byte-level BPE of at
most VOCAB tokens on the file with the ``tokenizers`` library and encodes it once; the model's
vocabulary becomes VOCAB. Tokenizer and token ids are cached beside the file, keyed by the
file's SHA-256 and VOCAB (``FILE.bpe512-<hash>.json`` / ``.npy``), and written atomically
(a temporary file, then a rename): the launcher's preflight trains before any worker starts, and
ranks that start at once (torchrun) compute the same bytes, so whichever rename lands last wins
with identical content.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from .errors import ConfigError

MIN_BPE_VOCAB = 257
"""The 256 byte tokens plus at least one merge."""
MAX_BPE_VOCAB = 2**31 - 1


def bpe_vocab(spec: str) -> int | None:
    """``"bytes"`` -> None; ``"bpe:N"`` -> N; anything else: ConfigError naming --tokenizer."""
    if spec == "bytes":
        return None
    kind, _, n = spec.partition(":")
    if kind == "bpe" and n.isdigit() and MIN_BPE_VOCAB <= int(n) <= MAX_BPE_VOCAB:
        return int(n)
    raise ConfigError("--tokenizer", f"must be 'bytes' or 'bpe:VOCAB' with VOCAB an integer >= "
                      f"{MIN_BPE_VOCAB} (256 bytes plus merges); got {spec!r}")


def cache_paths(data: str, vocab: int) -> tuple[Path, Path]:
    """(tokenizer JSON, token ids .npy) of ``data`` under a ``vocab``-token BPE."""
    p = Path(data)
    digest = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
    stem = f"{p.name}.bpe{vocab}-{digest}"
    return p.with_name(stem + ".json"), p.with_name(stem + ".npy")


def bpe_tokens(data: str, vocab: int) -> np.ndarray:
    """The token ids of text file ``data`` under its ``vocab``-token BPE (trained, cached)."""
    try:
        tok_path, ids_path = cache_paths(data, vocab)
        if not ids_path.exists():
            _train(data, vocab, tok_path, ids_path)
        return np.load(ids_path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError("--tokenizer", f"cannot tokenise {data!r}: {exc}") from None


def _train(data: str, vocab: int, tok_path: Path, ids_path: Path) -> None:
    try:
        from tokenizers import ByteLevelBPETokenizer
    except ImportError:
        raise ConfigError("--tokenizer", "bpe needs the tokenizers package "
                          "(pip install tokenizers)") from None
    text = Path(data).read_bytes().decode("utf-8", errors="replace")
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([text], vocab_size=vocab, min_frequency=2, show_progress=False)
    ids = np.asarray(tok.encode(text).ids, dtype=np.int32)     # (tokens,)
    _atomic(tok_path, lambda f: f.write(tok._tokenizer.to_str().encode()))
    _atomic(ids_path, lambda f: np.save(f, ids, allow_pickle=False))


def _atomic(path: Path, write) -> None:
    """Write ``path`` through a private temporary file and a rename (readers never see half)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)
