"""``--tokenizer model``: documents tokenised with a model directory's own tokenizer.

With ``--model-dir D`` and text data, the tokens are what ``AutoTokenizer.from_pretrained(D)``
gives each document (its special tokens included, e.g. a leading BOS), followed by the
tokenizer's end-of-sequence token where the encoding does not already end with it; the documents'
ids are concatenated into one stream, which the run reads in windows like any token file.
Documents come from :mod:`trainmesh.data.documents` (text paragraphs, JSON-lines, Parquet, a
saved ``datasets`` directory) and are encoded in batches of about :data:`BATCH_CHARS`
characters, streamed into the token cache (:mod:`trainmesh.data.token_cache`): named by the
source's fingerprint, the text field and the tokenizer files' fingerprint, written once and
atomically (the launcher's preflight writes it before any worker starts).
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from trainmesh.core.errors import ConfigError
from trainmesh.data.documents import documents, source_fingerprint
from trainmesh.data.prepare import Begin, Counted, quiet
from trainmesh.data.token_cache import TokenView, cache_dir, open_tokens, write_token_cache

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
"""Files of a saved tokenizer; any of the first, fourth or fifth makes a directory have one."""
BATCH_CHARS = 1 << 20
"""Characters of documents encoded at a time (the fast tokenizer runs a batch in parallel)."""


def has_tokenizer(model_dir: str) -> bool:
    """Whether ``model_dir`` holds a tokenizer (``tokenizer.json``, ``tokenizer.model`` or
    ``vocab.json``)."""
    d = Path(model_dir)
    return any((d / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def load_tokenizer(model_dir: str):
    """``AutoTokenizer.from_pretrained(model_dir)`` (local files only); ConfigError naming
    --tokenizer when there is none or it has no end-of-sequence token."""
    if not has_tokenizer(model_dir):
        raise ConfigError("--tokenizer", f"model tokenises with the --model-dir's tokenizer; "
                          f"{model_dir} has none (tokenizer.json); valid: bytes or bpe:VOCAB")
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except ImportError:
        raise ConfigError("--tokenizer", "model needs the transformers package "
                          "(pip install 'trainmesh[hf]')") from None
    except (OSError, ValueError) as exc:
        raise ConfigError("--tokenizer", f"cannot load the tokenizer of {model_dir}: {exc}") from None
    if tok.eos_token_id is None:
        raise ConfigError("--tokenizer", f"the tokenizer of {model_dir} has no end-of-sequence "
                          "token to separate documents with; valid: bytes or bpe:VOCAB")
    tok.model_max_length = 1 << 62     # documents are longer than one window: no warning
    return tok


def tokenizer_fingerprint(model_dir: str) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def cache_path(data: str, fmt: str, text_field: str, model_dir: str) -> Path:
    """The token cache of ``data`` under ``model_dir``'s tokenizer."""
    key = hashlib.sha256(f"{source_fingerprint(data, fmt, text_field)}:"
                         f"{tokenizer_fingerprint(model_dir)}".encode()).hexdigest()[:16]
    return cache_dir(data) / f"{Path(data).name}.tok-{key}.npy"


def encode_documents(tok, docs: Iterable[str]) -> Iterator[np.ndarray]:
    """Each document's ids under ``tok`` followed by EOS (unless it ends with it), in batches."""
    eos = tok.eos_token_id
    batch: list[str] = []
    size = 0

    def flush() -> np.ndarray:
        ids = tok(batch, add_special_tokens=True)["input_ids"]
        return np.fromiter((t for one in ids for t in (one if one[-1:] == [eos] else [*one, eos])),
                           dtype=np.int64)

    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= BATCH_CHARS:
            yield flush()
            batch, size = [], 0
    if batch:
        yield flush()


def model_tokens(data: str, fmt: str, *, model_dir: str, text_field: str = "text",
                 progress: Begin = quiet) -> TokenView:
    """The token ids of ``data`` under ``model_dir``'s tokenizer (encoded once into the cache,
    then opened, never loaded; the work told to ``progress``)."""
    path = cache_path(data, fmt, text_field, model_dir)
    if not path.exists():
        tok = load_tokenizer(model_dir)
        dtype = np.dtype(np.uint16 if len(tok) <= 2**16 else np.int32)
        total = os.path.getsize(data) if fmt == "text" else None
        try:
            with progress(f"encoding {data} with the tokenizer of {model_dir}", total=total,
                          cache=path) as work:
                docs = Counted(documents(data, fmt, text_field), work)
                write_token_cache(path, dtype, encode_documents(tok, docs))
        except OSError as exc:
            raise ConfigError("--data", f"cannot write the token cache of {data!r}: {exc}") from None
    return open_tokens(str(path))
