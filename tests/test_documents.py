"""Text data in the formats of the model ecosystem, tokenised by the model's own tokenizer.

A model directory holding a tokenizer (a BPE whose post-processor prepends BOS, as Llama 3's
does) and a tiny Llama; the same documents written as a text file (paragraphs), JSON-lines,
Parquet and a directory saved by the ``datasets`` library. Under ``--tokenizer model`` (the
default with such a ``--model-dir``) each source's token cache holds exactly
``AutoTokenizer.from_pretrained(D)``'s encoding of each document followed by EOS; the sources
are read in bounded pieces; bad sources exit 2 naming the flag.
"""
from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from helpers import run_train, steps

from trainmesh.config.train import build_train_config
from trainmesh.data import model_tokenizer, token_cache
from trainmesh.data.corpus import make_datasets
from trainmesh.data.documents import data_format, documents
from trainmesh.data.tokenizer import tokens_of

transformers = pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
transformers.logging.set_verbosity_error()

WORDS = ["the", "mesh", "trains", "a", "model", "over", "many", "ranks", "gradients", "shard",
         "state", "pipeline", "stage", "ring", "tokens", "expert", "é", "naïve", "überall"]


def _docs(n: int, seed: int = 0) -> list[str]:
    """Documents of random words, some with single line breaks inside (never a blank line)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
                 for _ in range(rng.randint(1, 3))]
        docs.append("\n".join(lines))
    return docs


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(_docs(200, seed=1), trainers.BpeTrainer(
        vocab_size=90, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tokenizer and a tiny random Llama of its vocabulary."""
    import torch
    d = tmp_path_factory.mktemp("llama")
    tok = _tokenizer()
    tok.save_pretrained(d)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(d)
    return d


def write_sources(where: Path, docs: list[str], field: str = "body") -> dict[str, tuple[Path, str]]:
    """The documents as each format holds them: {format: (path, text field)}."""
    where.mkdir(parents=True, exist_ok=True)
    text = where / "corpus.txt"
    text.write_text("\n\n\n".join(docs) + "\n")
    jsonl = where / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    parquet = where / "corpus.parquet"
    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), parquet, row_group_size=7)
    saved = where / "saved"
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({field: docs}).save_to_disk(str(saved), max_shard_size="2KB")
    return {"text": (text, "text"), "jsonl": (jsonl, field), "parquet": (parquet, field),
            "dataset": (saved, field)}


def expected_ids(model_dir: Path, docs: list[str]) -> np.ndarray:
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    out: list[int] = []
    for doc in docs:
        ids = tok(doc)["input_ids"]
        out += ids if ids[-1:] == [tok.eos_token_id] else [*ids, tok.eos_token_id]
    return np.asarray(out, dtype=np.int64)


@pytest.mark.parametrize("fmt", ["text", "jsonl", "parquet", "dataset"])
def test_model_tokens_are_autotokenizer_per_document(fmt, model_dir, tmp_path):
    """Bugs: documents run together (no EOS), BOS left out, a record read twice or skipped
    across Parquet row groups or Arrow shards, the wrong field."""
    docs = _docs(60)
    path, field = write_sources(tmp_path, docs)[fmt]
    assert data_format(str(path)) == fmt
    assert list(documents(str(path), fmt, field)) == docs
    got = np.asarray(tokens_of(str(path), "model", text_field=field, model_dir=str(model_dir)),
                     dtype=np.int64)
    want = expected_ids(model_dir, docs)
    assert got[0] == 1 and (got == 2).sum() == len(docs)        # BOS first, one EOS per document
    assert np.array_equal(got, want)
    cached = list(tmp_path.glob("*.tok-*.npy"))
    assert len(cached) == 1 and np.array_equal(np.load(cached[0]), want)


def test_a_vocabulary_past_uint16_is_cached_whole(tmp_path):
    """A model tokenizer of 70,000 ids (a word-level one: id i is word ``w{i}``): the token cache
    holds ids up to 69,999 as they are (a cache of uint16 would wrap 65,536 and above)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    d = tmp_path / "wide"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(d)
    docs = ["w3 w65535 w65536 w69999", "w70 w66000 w4"]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n\n".join(docs) + "\n")
    got = np.asarray(tokens_of(str(path), "model", model_dir=str(d)), dtype=np.int64)
    assert got.tolist() == [1, 3, 65535, 65536, 69999, 2, 1, 70, 66000, 4, 2]
    cached = np.load(next(tmp_path.glob("*.tok-*.npy")))
    assert np.iinfo(cached.dtype).max >= 69_999 and cached.max() == 69_999


def test_encoding_with_a_model_tokenizer_tells_its_progress(model_dir, tmp_path):
    """The token cache of --tokenizer model is built under one announced piece of work, naming
    the model's tokenizer and the cache file, and told every document's bytes."""
    import contextlib
    told: list = []

    @contextlib.contextmanager
    def begin(what, *, total=None, cache=None):
        told.append((what, total, cache))
        yield type("Work", (), {"advance": lambda self, n: told.append(n),
                                "phase": lambda self, text: told.append(text)})()
    docs = _docs(30)
    path, field = tmp_path / "corpus.jsonl", "body"
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs))
    tokens_of(str(path), "model", text_field=field, model_dir=str(model_dir), progress=begin)
    (cache,) = tmp_path.glob("*.tok-*.npy")
    assert told[0] == (f"encoding {path} with the tokenizer of {model_dir}", None, cache)
    assert sum(n for n in told[1:] if isinstance(n, int)) == sum(len(d.encode()) for d in docs)
    told.clear()
    tokens_of(str(path), "model", text_field=field, model_dir=str(model_dir), progress=begin)
    assert told == []      # cached: nothing to do, nothing told


def test_the_cache_is_keyed_by_source_field_and_tokenizer(model_dir, tmp_path):
    docs = _docs(20)
    path, field = write_sources(tmp_path, docs)["jsonl"]
    first = model_tokenizer.cache_path(str(path), "jsonl", field, str(model_dir))
    tokens_of(str(path), "model", text_field=field, model_dir=str(model_dir))
    assert first.exists()
    assert model_tokenizer.cache_path(str(path), "jsonl", "id", str(model_dir)) != first
    other = tmp_path / "other"
    _tokenizer().save_pretrained(other)
    (other / "tokenizer_config.json").write_text(
        (other / "tokenizer_config.json").read_text().replace('"</s>"', '"<unk>"'))
    assert model_tokenizer.cache_path(str(path), "jsonl", field, str(other)) != first
    write_sources(tmp_path, _docs(21))
    assert model_tokenizer.cache_path(str(path), "jsonl", field, str(model_dir)) != first


def test_a_saved_dataset_has_a_run_fingerprint(tmp_path):
    """A checkpoint's run record names its --data; a directory is named by its Arrow files."""
    from trainmesh.checkpoint.resume import data_fingerprint
    saved = write_sources(tmp_path, _docs(10))["dataset"][0]
    first = data_fingerprint(str(saved))
    assert first == data_fingerprint(str(saved)) and "dataset" in first
    write_sources(tmp_path, _docs(11))
    assert data_fingerprint(str(saved)) != first


def test_bytes_and_bpe_read_documents_as_text(tmp_path):
    docs = _docs(30)
    path, field = write_sources(tmp_path, docs)["parquet"]
    ids = np.asarray(tokens_of(str(path), "bytes", text_field=field), dtype=np.uint8)
    assert ids.tobytes() == "".join(d + "\n\n" for d in docs).encode()
    bpe = np.asarray(tokens_of(str(path), "bpe:300", text_field=field))
    assert 0 < len(bpe) < len(ids) and bpe.max() < 300


def test_the_tokenizer_defaults_to_the_models_with_text_data(model_dir, tmp_path):
    path, _ = write_sources(tmp_path, _docs(5))["jsonl"]
    base = {"model_dir": str(model_dir), "seq_len": 16}
    assert build_train_config({**base, "data": str(path)}).tokenizer == "model"
    assert build_train_config(base).tokenizer == "bytes"                 # synthetic data
    np.save(tmp_path / "ids.npy", np.arange(50))
    assert build_train_config({**base, "data": str(tmp_path / "ids.npy")}).tokenizer == "bytes"
    assert build_train_config({"data": str(path)}).tokenizer == "bytes"  # no model: bytes


def test_documents_are_read_in_bounded_pieces(model_dir, tmp_path, monkeypatch):
    """About 3.6 MB of JSON-lines encoded in batches of 16 K characters: what Python allocates
    is bounded by the fingerprint's read of the first MiB plus a batch (its ids as Python ints,
    ~40 bytes a token at ~3 characters a token, and its encodings), not by the file."""
    rng = random.Random(3)
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(20_000):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(25))}) + "\n")
    size = path.stat().st_size
    monkeypatch.setattr(model_tokenizer, "BATCH_CHARS", 1 << 14)
    tok = model_tokenizer.load_tokenizer(str(model_dir))     # loaded outside the measurement
    monkeypatch.setattr(model_tokenizer, "load_tokenizer", lambda _: tok)
    tracemalloc.start()
    try:
        tokens = tokens_of(str(path), "model", model_dir=str(model_dir))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(tokens) > 20_000 * 25
    bound = token_cache.FINGERPRINT_HEAD + 32 * model_tokenizer.BATCH_CHARS
    assert size > 2 * bound and peak < bound, (peak, bound, size)


@pytest.mark.parametrize("args, flag", [
    (["--tokenizer", "model", "--data", "{jsonl}"], "--tokenizer"),       # no --model-dir
    (["--text-field", "body", "--data", "{text}"], "--text-field"),       # a text file has none
    (["--text-field", "", "--data", "{jsonl}"], "--text-field"),
    (["--tokenizer", "model"], "--tokenizer"),                            # synthetic data
    (["--data", "{bad}"], "--data"),                                      # a line that is not JSON
    (["--data", "{jsonl}", "--tokenizer", "bpe:300"], "--text-field"),    # field 'text' absent
    (["--data", "{nodir}"], "--data"),                                    # a directory, not saved
])
def test_bad_sources_exit_2_naming_the_flag(args, flag, tmp_path, refused, no_launch, capsys):
    paths = write_sources(tmp_path, _docs(5))
    capsys.readouterr()
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\nnot json\n')
    (tmp_path / "nodir").mkdir()
    values = {"jsonl": paths["jsonl"][0], "text": paths["text"][0], "bad": tmp_path / "bad.jsonl",
              "nodir": tmp_path / "nodir"}
    line = refused(["train", *[a.format(**values) for a in args]], flag)
    if "bad" in args[-1]:
        assert "bad.jsonl:2" in line


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_train_on_jsonl_with_the_models_tokenizer(model_dir, tmp_path):
    """`trainmesh train --model-dir D --data corpus.jsonl` (the tokenizer by default): the run
    trains, and the windows it draws are windows of AutoTokenizer's encoding of the documents."""
    docs = _docs(300)
    path, _ = write_sources(tmp_path / "data", docs, field="text")["jsonl"]
    args = ["--model-dir", str(model_dir), "--data", str(path), "--seq-len", "16",
            "--global-batch", "4", "--steps", "3", "--warmup-steps", "1"]
    proc, records = run_train(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(steps(records)) == 3
    want = expected_ids(model_dir, docs)
    cfg = build_train_config({"model_dir": str(model_dir), "data": str(path), "seq_len": 16})
    train, _ = make_datasets(cfg.data, vocab_size=cfg.vocab_size, seq_len=16, held_out=False,
                             **cfg.data_options())
    rows = train.batch(cfg.seed, 1, 4)["input_ids"].numpy()
    windows = np.lib.stride_tricks.sliding_window_view(want, 16)
    for row in rows:                       # every row is a window of the expected stream
        assert (windows == row).all(axis=1).any()
