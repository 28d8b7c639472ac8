"""Data files: read window by window, never whole; the same batches as an array in memory; a
file truncated or replaced while a run reads it stops the run (exit 1 naming --data), never a
SIGBUS; text is tokenised in pieces exactly as it would be whole."""
from __future__ import annotations

import hashlib
import json
import os
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import Launched

import trainmesh.data.token_cache as token_cache
import trainmesh.data.tokenizer as tokenizer
from trainmesh.core.errors import DataError
from trainmesh.data.corpus import _generator, make_datasets

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH, SEED = 16, 8, 5


def _words(n: int, seed: int = 7) -> bytes:
    words = ["alpha", "beta", "gamma", "delta", "pipeline", "shard", "token", "ring", "rank", "zero"]
    rng = np.random.default_rng(seed)
    return " ".join(words[i] for i in rng.integers(0, len(words), n)).encode() + "\nend é ü\n".encode()


def _files(tmp: Path) -> dict[str, tuple[Path, int]]:
    """A text file, and the same ids as .npy (int64) and .bin (uint16): name -> (path, vocab)."""
    (tmp / "t.txt").write_bytes(_words(6000))
    ids = (np.arange(20000, dtype=np.int64) * 7919) % 300
    np.save(tmp / "t.npy", ids)
    ids.astype(np.uint16).tofile(tmp / "t.bin")
    return {n: (tmp / n, v) for n, v in (("t.txt", 256), ("t.npy", 300), ("t.bin", 300))}


def _whole(path: Path) -> np.ndarray:
    """The token array as it used to be read: all of it in memory."""
    if path.suffix == ".npy":
        return np.load(path)
    if path.suffix == ".bin":
        return np.fromfile(path, dtype=np.uint16)
    return np.frombuffer(path.read_bytes(), dtype=np.uint8)


def _whole_batch(tokens: np.ndarray, step: int) -> torch.Tensor:
    g = _generator(SEED, step)
    starts = torch.randint(0, len(tokens) - SEQ - 1, (BATCH,), generator=g)
    return torch.from_numpy(np.stack([tokens[s : s + SEQ + 1] for s in starts.tolist()]).astype(np.int64))


def _digest(train, val) -> str:
    h = hashlib.sha256()
    for ds in (train, val):
        for step in (1, 2, 3, 50) if ds is not None else ():
            b = ds.batch(SEED, step, BATCH)
            h.update(b["input_ids"].numpy().tobytes())
            h.update(b["labels"].numpy().tobytes())
    return h.hexdigest()[:16]


# Digests of the batches (steps 1, 2, 3, 50; train then held-out) taken with the implementation
# that loaded the whole array (np.frombuffer of the text, np.load of the .npy): the split and the
# windows must not change.
BEFORE = {("t.txt", True): "51497fb4b87ed57f", ("t.txt", False): "b9d14354d1430d9e",
          ("t.npy", True): "e28ebb9d1ca57652", ("t.npy", False): "e7868c6bb6ef19b6",
          ("t.bin", True): "e28ebb9d1ca57652", ("t.bin", False): "e7868c6bb6ef19b6"}


@pytest.mark.timeout(60)
def test_batches_and_split_are_those_of_the_whole_array(tmp_path):
    for name, (path, vocab) in _files(tmp_path).items():
        whole = _whole(path)
        held = max(int(len(whole) * 0.05), SEQ + 2)          # README: the last 5% of a data file
        for held_out in (True, False):
            train, val = make_datasets(str(path), vocab_size=vocab, seq_len=SEQ, held_out=held_out)
            assert _digest(train, val) == BEFORE[name, held_out], (name, held_out)
            part = whole[: len(whole) - held] if held_out else whole
            for step in (1, 2, 50):
                b = train.batch(SEED, step, BATCH)
                rows = _whole_batch(part, step)
                assert torch.equal(b["input_ids"], rows[:, :-1]) and torch.equal(b["labels"], rows[:, 1:])
            if held_out:
                assert len(val.tokens) == held and np.array_equal(np.asarray(val.tokens), whole[-held:])
                assert torch.equal(val.batch(SEED, 1, BATCH)["input_ids"],
                                   _whole_batch(whole[-held:], 1)[:, :-1])


@pytest.mark.timeout(60)
def test_a_text_file_is_never_held_whole(tmp_path, monkeypatch):
    """About 18 MB of text: reading it, checking its ids and drawing batches allocates a small
    fraction of it (tracemalloc sees numpy's buffers), with reads no larger than a scan chunk."""
    path = tmp_path / "big.txt"
    path.write_bytes(_words(3_000_000)[: 20 << 20])
    size = path.stat().st_size
    largest = [0]
    pread = os.pread

    def counted(fd: int, n: int, at: int) -> bytes:
        largest[0] = max(largest[0], n)
        return pread(fd, n, at)
    monkeypatch.setattr(token_cache.os, "pread", counted)
    tracemalloc.start()
    try:
        train, val = make_datasets(str(path), vocab_size=256, seq_len=SEQ, held_out=True)
        for step in range(1, 20):
            train.batch(SEED, step, BATCH)
            val.batch(SEED, step, BATCH)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < size / 8, (peak, size)
    assert largest[0] <= token_cache.SCAN_TOKENS, largest[0]


def _old_bpe(text: str, vocab: int) -> np.ndarray:
    """The tokenizer trained on, and encoding, the whole text at once (the former way)."""
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([text], vocab_size=vocab, min_frequency=2, show_progress=False)
    return np.asarray(tok.encode(text).ids, dtype=np.int64)


@pytest.mark.timeout(120)
def test_bpe_in_pieces_equals_the_whole_text(tmp_path, monkeypatch):
    """Trained on and encoded in 2 KiB pieces, never read whole: the ids of the whole text."""
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    path = tmp_path / "docs.txt"
    path.write_text(text)
    sizes: list[int] = []

    class Reads:                                   # open() as tokenizer.py sees it, reads counted
        def __init__(self, *args) -> None:
            self.f = open(*args)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

        def read(self, n: int = -1) -> bytes:
            sizes.append(n)
            return self.f.read(n)
    monkeypatch.setattr(tokenizer, "PIECE_BYTES", 2048)
    monkeypatch.setattr(tokenizer, "open", Reads, raising=False)
    ids = np.asarray(tokenizer.bpe_tokens(str(path), 400), dtype=np.int64)
    assert sizes and all(0 < n <= 2048 for n in sizes), sorted(set(sizes))
    assert len(list(tokenizer.text_pieces(str(path)))) > 50
    assert np.array_equal(ids, _old_bpe(text, 400))


@pytest.mark.timeout(60)
def test_changed_file_raises_data_error_in_process(tmp_path):
    paths = _files(tmp_path)
    path, vocab = paths["t.txt"]
    train, _ = make_datasets(str(path), vocab_size=vocab, seq_len=SEQ, held_out=False)
    train.batch(SEED, 1, BATCH)
    with open(path, "r+b") as f:                     # truncated: a stale map would SIGBUS here
        f.truncate(1000)
    with pytest.raises(DataError, match=r"--data: .*t\.txt.* changed .*bytes"):
        train.batch(SEED, 2, BATCH)
    path, vocab = paths["t.npy"]
    train, _ = make_datasets(str(path), vocab_size=vocab, seq_len=SEQ, held_out=False)
    np.save(tmp_path / "other.npy", np.zeros(20000, dtype=np.int64))
    os.replace(tmp_path / "other.npy", path)          # replaced by another file of the same size
    with pytest.raises(DataError, match="--data: .*replaced"):
        train.batch(SEED, 2, BATCH)


@pytest.mark.timeout(60)
def test_memory_preflight_counts_the_data_path_not_the_file(tmp_path, monkeypatch):
    """Each local rank's data path is a few MiB whatever the file's size (it is read window by
    window), and the host memory check adds it: one byte short is refused."""
    import trainmesh.planner.fit as fit
    from trainmesh.cli import build_parser
    from trainmesh.cli.train import given_flags
    from trainmesh.config.train import build_train_config
    from trainmesh.core.errors import ConfigError
    from trainmesh.planner.predict import predict_run
    small, big = tmp_path / "small.txt", tmp_path / "big.txt"
    small.write_bytes(_words(1000))
    big.write_bytes(_words(1_000_000))

    def cfg(data: str):
        return build_train_config(given_flags(build_parser().parse_args(
            ["train", "--dp", "2", "--global-batch", "8", "--data", data])))
    per_rank = fit.data_bytes(cfg(str(big)))
    assert per_rank == fit.data_bytes(cfg(str(small))) and 0 < per_rank < 32 * 2**20
    assert 0 < fit.data_bytes(cfg("synthetic")) < 32 * 2**20
    base = 300 * 2**20
    monkeypatch.setattr(fit, "measured_base_bytes", lambda: base)
    run = cfg(str(big))
    need = sum(r.peak_mem_bytes for r in predict_run(run, base_bytes=base).ranks) + 2 * per_rank
    monkeypatch.setattr(fit, "host_memory_bytes", lambda: need - 1)
    with pytest.raises(ConfigError, match="memory"):
        fit.check_memory(run, local_ranks=2, cuda=False)
    monkeypatch.setattr(fit, "host_memory_bytes", lambda: need)
    fit.check_memory(run, local_ranks=2, cuda=False)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_token_file_truncated_mid_run_exits_1_naming_data(tmp_path):
    """`trainmesh train --dp 2` on a .npy token file cut to a tenth after the first steps: the
    launcher exits 1 naming --data and the rank (no worker dies of a signal)."""
    path = tmp_path / "tokens.npy"
    np.save(path, (np.arange(400_000, dtype=np.int64) * 31) % 64)
    out = tmp_path / "m.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = Launched(["train", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16",
                     "--vocab-size", "64", "--global-batch", "4", "--steps", "100000", "--dp", "2",
                     "--data", str(path), "--metrics-out", str(out)], tmp_path, env=env, name="m",
                    own_fork_server=False)
    try:
        deadline = time.monotonic() + 300     # start-up on a loaded machine
        while not (out.exists() and '"step"' in out.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.err.read_text()[-2000:]
            time.sleep(0.2)
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 10)
        _, err = proc.communicate(timeout=90)
    finally:
        proc.end()
    steps = [json.loads(line) for line in out.read_text().splitlines()]
    assert proc.returncode == 1, (proc.returncode, err[-2000:])
    lines = [line for line in err.splitlines() if line.startswith("trainmesh train:")]
    assert len(lines) == 1 and "--data" in lines[0] and "rank" in lines[0], err[-2000:]
    assert "tokens.npy" in lines[0] and "SIG" not in err and "Traceback" not in err, err[-2000:]
    assert steps and steps[-1]["step"] < 100000


@pytest.mark.timeout(30)
def test_cache_goes_to_the_user_cache_when_the_text_dir_is_read_only(tmp_path, monkeypatch):
    text = tmp_path / "ro" / "t.txt"
    text.parent.mkdir()
    text.write_bytes(_words(100))
    assert tokenizer.cache_paths(str(text), 300)[1].parent == text.parent.resolve()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(token_cache.os, "access", lambda path, mode: Path(path) != text.parent.resolve())
    tok, ids = tokenizer.cache_paths(str(text), 300)
    assert tok.parent == ids.parent == tmp_path / "cache" / "trainmesh" and ids.name.startswith("t.txt.bpe300-")
