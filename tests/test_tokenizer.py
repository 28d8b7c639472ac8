"""--tokenizer bpe:VOCAB: a byte-level BPE trained on the text, cached, equal across layouts."""
from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
from helpers import SMALL, assert_equivalent, run_train

from trainmesh.cli import main
from trainmesh.config.train import build_train_config
from trainmesh.data.tokenizer import bpe_tokens, cache_paths

ROOT = Path(__file__).resolve().parents[1]
NO_VOCAB = [a for i, a in enumerate(SMALL) if "--vocab-size" not in SMALL[max(i - 1, 0):i + 1]]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """The project's own docs as a real text file (in a fresh directory: the cache goes beside)."""
    path = tmp_path_factory.mktemp("text") / "docs.txt"
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    path.write_text("\n".join(p.read_text() for p in sources))
    return path


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bpe_run_at_dp2_equals_one_process(text, tmp_path):
    args = [*NO_VOCAB, "--data", str(text), "--tokenizer", "bpe:512"]
    ref_proc, ref = run_train(args, tmp_path, name="one")
    assert ref_proc.returncode == 0, ref_proc.stderr[-2000:]
    proc, run = run_train([*args, "--dp", "2"], tmp_path, name="dp2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_equivalent(ref, run)
    first = ref[0]["loss"]
    assert abs(first - np.log(512)) < 0.5, first     # the model's vocabulary is the tokenizer's


def _tokens(path: str) -> bytes:
    return np.asarray(bpe_tokens(path, 300), dtype=np.int64).tobytes()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bpe_cache_is_keyed_atomic_and_shared(text, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(text.read_text()[:20000])
    with mp.get_context("spawn").Pool(2) as pool:      # two ranks starting at once
        a, b = pool.map(_tokens, [str(path), str(path)])
    assert a == b
    ids = np.asarray(bpe_tokens(str(path), 300), dtype=np.int64)
    assert ids.tobytes() == a and 255 < ids.max() < 300 and len(ids) < 20000
    tok, npy = cache_paths(str(path), 300)
    assert tok.exists() and npy.exists()
    assert not list(tmp_path.glob(".*.tmp"))
    assert cache_paths(str(path), 512)[1] != npy            # keyed by the vocabulary
    path.write_text(text.read_text()[:20001])
    assert cache_paths(str(path), 300)[1] != npy            # and by the file's content
    cfg = build_train_config({"data": str(path), "tokenizer": "bpe:300"})
    assert cfg.gpt_config().vocab_size == 300


@pytest.mark.parametrize("args, field", [
    (["--tokenizer", "bpe:1"], "--tokenizer"),
    (["--tokenizer", "bpe"], "--tokenizer"),
    (["--tokenizer", "words"], "--tokenizer"),
    (["--tokenizer", "bpe:512"], "--tokenizer"),            # the synthetic corpus
])
def test_bad_tokenizer_exits_2_naming_the_flag(args, field, capsys):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and "Traceback" not in err[0], err


def test_bpe_of_a_token_file_exits_2(tmp_path, capsys):
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.int64))
    assert main(["train", "--data", str(tmp_path / "t.npy"), "--tokenizer", "bpe:512"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tokenizer" in err[0], err
