"""Documents of a data source, streamed: text, JSON-lines, Parquet and saved ``datasets``.

``--data`` names a token file (``.npy``, ``.bin``), a text file, a JSON-lines file
(``.jsonl``/``.ndjson``: one JSON object per line), a Parquet file (``.parquet``) or a
directory written by the ``datasets`` library's ``save_to_disk`` (``state.json`` and Arrow
files). The last three hold one document per record, its text in the field ``--text-field``
(default ``text``). A text file's documents are its paragraphs: runs of lines separated by one or
more blank lines, each cut at a line break before :data:`MAX_DOCUMENT_CHARS` (so a file without
blank lines is still read in bounded pieces).

Every source is read record by record (Parquet and Arrow in record batches of
:data:`ARROW_BATCH` rows, of the text column only), so memory does not grow with the file.
Reading Parquet or Arrow needs ``pyarrow`` (``pip install 'trainmesh[data]'``; the ``datasets``
library brings it too). Bad input raises :class:`~trainmesh.core.errors.ConfigError` naming
``--data`` or ``--text-field`` and where in the file it is.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from trainmesh.core.errors import ConfigError
from trainmesh.data.token_cache import fingerprint

FORMATS = ("tokens", "text", "jsonl", "parquet", "dataset")
"""What ``--data`` can hold (besides ``synthetic``)."""
JSONL_SUFFIXES = (".jsonl", ".ndjson")
MAX_DOCUMENT_CHARS = 1 << 20
"""A text file's paragraph longer than this is cut at a line break (bounded memory)."""
ARROW_BATCH = 1024
"""Rows of a Parquet or Arrow file read at a time."""


def data_format(path: str) -> str:
    """The kind of source ``path`` is (one of :data:`FORMATS`); ConfigError if it is none."""
    p = Path(path)
    if p.is_dir():
        if (p / "state.json").is_file():
            return "dataset"
        raise ConfigError("--data", f"{path!r} is a directory but not one saved by the datasets "
                          "library (no state.json); give a text, JSON-lines, Parquet or token file")
    if not p.is_file():
        raise ConfigError("--data", f"no such file {path!r}; use 'synthetic', a text, JSON-lines, "
                          "Parquet or token file, or a saved datasets directory")
    suffix = p.suffix.lower()
    if suffix in (".npy", ".bin"):
        return "tokens"
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "text"


def holds_records(fmt: str) -> bool:
    """Whether a source of this kind has a text field (``--text-field``)."""
    return fmt in ("jsonl", "parquet", "dataset")


def source_fingerprint(path: str, fmt: str, text_field: str = "") -> str:
    """16 hex digits naming the source's content (and field): a file's fingerprint, or a saved
    dataset's Arrow files' and its ``state.json``."""
    h = hashlib.sha256(f"{fmt}:{text_field}:".encode())
    files = [path] if fmt != "dataset" else [str(Path(path) / "state.json"),
                                             *map(str, _arrow_files(path))]
    for f in files:
        h.update(fingerprint(f).encode())
    return h.hexdigest()[:16]


def documents(path: str, fmt: str, text_field: str = "text") -> Iterator[str]:
    """The documents of ``path`` (a source of kind ``fmt``), in order."""
    if fmt == "text":
        return _paragraphs(path)
    if fmt == "jsonl":
        return _jsonl(path, text_field)
    if fmt == "parquet":
        return _parquet(path, text_field)
    if fmt == "dataset":
        return _dataset(path, text_field)
    raise ConfigError("--data", f"{path!r} holds token ids, not documents")


def _paragraphs(path: str) -> Iterator[str]:
    lines: list[str] = []
    size = 0
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        for line in f:
            if not line.strip():
                if lines:
                    yield "".join(lines).rstrip("\r\n")
                lines, size = [], 0
                continue
            if size + len(line) > MAX_DOCUMENT_CHARS and lines:
                yield "".join(lines).rstrip("\r\n")
                lines, size = [], 0
            lines.append(line)
            size += len(line)
    if lines:
        yield "".join(lines).rstrip("\r\n")


def _text_of(record: object, field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise ConfigError("--data", f"{where} is not a JSON object (one object per line)")
    if field not in record:
        keys = ", ".join(sorted(map(str, record))[:8]) or "none"
        raise ConfigError("--text-field", f"{field!r} is not a field of {where} (its fields: {keys})")
    value = record[field]
    if not isinstance(value, str):
        raise ConfigError("--text-field", f"{field!r} of {where} is {type(value).__name__}, not text")
    return value


def _jsonl(path: str, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError("--data", f"{path}:{n} is not JSON ({exc.msg}); a JSON-lines "
                                  "file holds one JSON object per line") from None
            yield _text_of(record, field, f"{path}:{n}")


def _pyarrow(what: str):
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ConfigError("--data", f"reading {what} needs pyarrow (pip install "
                          "'trainmesh[data]')") from None
    return pyarrow


def _column(batch, field: str, where: str) -> list:
    names = batch.schema.names
    if field not in names:
        raise ConfigError("--text-field", f"{field!r} is not a column of {where} (its columns: "
                          f"{', '.join(names[:8]) or 'none'})")
    column = batch.column(names.index(field))
    pa = _pyarrow("Arrow data")
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ConfigError("--text-field", f"{field!r} of {where} holds {column.type}, not text")
    return column.to_pylist()


def _parquet(path: str, field: str) -> Iterator[str]:
    pa = _pyarrow("Parquet")
    try:
        pq_file = pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError("--data", f"cannot read {path!r} as Parquet: {exc}") from None
    if field not in pq_file.schema_arrow.names:
        names = pq_file.schema_arrow.names
        raise ConfigError("--text-field", f"{field!r} is not a column of {path} (its columns: "
                          f"{', '.join(names[:8]) or 'none'})")
    for batch in pq_file.iter_batches(batch_size=ARROW_BATCH, columns=[field]):
        yield from (t for t in _column(batch, field, path) if t is not None)


def _arrow_files(path: str) -> list[Path]:
    try:
        state = json.loads((Path(path) / "state.json").read_text())
        files = [Path(path) / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError("--data", f"{path!r}: its state.json does not list the dataset's Arrow "
                          f"files ({exc}); give a directory written by save_to_disk") from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ConfigError("--data", f"{path!r} lacks {', '.join(missing)} (listed in state.json)")
    return files


def _dataset(path: str, field: str) -> Iterator[str]:
    pa = _pyarrow("a saved datasets directory")
    for file in _arrow_files(path):
        try:
            with pa.OSFile(str(file)) as f:
                reader = pa.ipc.open_stream(f)
                for batch in reader:
                    yield from (t for t in _column(batch, field, str(file)) if t is not None)
        except pa.ArrowException as exc:
            raise ConfigError("--data", f"cannot read {file} as Arrow: {exc}") from None
