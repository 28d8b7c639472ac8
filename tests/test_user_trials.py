"""Odd inputs a new user gives, each refused before any worker starts (exit 2, one line naming
the field and what is valid): output paths that cannot be made, an encoder's model directory,
and a TOML config whose keys sit in a table."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmesh.cli import main

T = ["--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--steps", "1"]


@pytest.mark.parametrize("argv, flag", [
    (["train", *T, "--metrics-out", "{f}/sub/m.jsonl"], "--metrics-out"),
    (["train", *T, "--trace-out", "{f}/t.json"], "--trace-out"),
    (["train", *T, "--pp", "2", "--layers", "2", "--timeline-out", "{f}/x/t.svg"], "--timeline-out"),
    (["train", *T, "--save-dir", "{f}/ck"], "--save-dir"),
    (["train", *T, "--fault-tolerant", "--dp", "2", "--metrics-out", "{f}/m.jsonl"], "--metrics-out"),
    (["report", "{run}", "-o", "{f}/r/r.html"], "--out"),
    (["schedule", "--pp", "2", "--microbatches", "2", "--out", "{f}/s.svg"], "--out"),
    (["checkpoint", "export-hf", "{tmp}", "{f}/hf"], "OUTDIR"),
])
def test_an_output_path_under_a_regular_file_is_refused(argv, flag, tmp_path, refused, no_launch):
    """A directory that cannot be made (its parent is a file): one line naming the flag, not a
    traceback from inside a worker."""
    afile = tmp_path / "afile"
    afile.write_text("")
    run = tmp_path / "run.jsonl"
    run.write_text(json.dumps({"event": "step", "step": 1, "loss": 1.0}) + "\n")
    line = refused([a.format(f=afile, run=run, tmp=tmp_path / "ck") for a in argv], flag)
    assert "afile" in line and "not a directory" in line, line
    assert not no_launch


def test_output_directories_that_do_not_exist_yet_are_made_before_launch(tmp_path, capsys, no_launch):
    """--trace-out new/dir/t.json: the check lets it through (its directory can be made), so the
    directory is made before any worker starts (the trace writer, on rank 0 at the end, makes
    none: without this the run failed there with a traceback, exit 1)."""
    out = {flag: tmp_path / name.split(".")[0] / "sub" / name
           for flag, name in (("--metrics-out", "m.jsonl"), ("--trace-out", "t.json"),
                              ("--timeline-out", "l.svg"))}
    main(["train", *T, "--pp", "2", "--layers", "2", *(a for f, p in out.items() for a in (f, str(p)))])
    assert no_launch, capsys.readouterr().err
    for path in out.values():
        assert path.parent.is_dir() and not path.exists(), path


def test_report_makes_the_directory_of_its_page(tmp_path, capsys):
    run = tmp_path / "run.jsonl"
    run.write_text(json.dumps({"event": "step", "step": 1, "loss": 1.0, "grad_norm": 1.0,
                               "tokens": 8, "step_time_s": 0.1}) + "\n")
    page = tmp_path / "reports" / "today" / "r.html"
    assert main(["report", str(run), "-o", str(page)]) == 0, capsys.readouterr().err
    assert page.read_text().startswith("<!")


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    """A tiny BERT's config.json (an encoder; what is refused is read from the config alone)."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("bert")
    transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=64,
                            architectures=["BertForMaskedLM"]).to_json_file(d / "config.json")
    return d


def test_an_encoder_is_refused_by_train_and_plan_alike(bert_dir, refused, no_launch):
    """BERT attends both ways: trained as a causal LM it would see the tokens it predicts, and
    planned it is a model trainmesh will not run; both commands give the same line."""
    train = refused(["train", "--model-dir", str(bert_dir), "--steps", "1"], "--model-dir")
    plan = refused(["plan", "--model-dir", str(bert_dir), "--gpus", "8"], "--model-dir")
    assert "encoder" in train and "is_decoder" in train
    assert train.split("error: ", 1)[1] == plan.split("error: ", 1)[1]
    assert not no_launch


def test_an_encoder_with_a_decoder_config_is_planned(bert_dir, tmp_path, capsys):
    """``is_decoder: true`` makes BERT a causal LM (transformers' BertLMHeadModel): planned."""
    config = json.loads((bert_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "is_decoder": True}))
    assert main(["plan", "--model-dir", str(tmp_path), "--gpus", "8"]) == 0, capsys.readouterr().err


def test_toml_tables_group_keys(tmp_path, no_launch):
    """``[train]`` then ``steps = 3``: the table groups the key, the run takes it (not the demo's
    layout and steps)."""
    path = tmp_path / "run.toml"
    path.write_text("[train]\nsteps = 3\n")
    main(["train", "--config", str(path)])
    (cfg,) = no_launch
    assert cfg.steps == 3 and cfg.parallel.world_size == 1


@pytest.mark.parametrize("toml, words", [
    ("steps = 3\n[train]\nsteps = 4\n", ["'steps' is set twice", "the top level", "table [train]"]),
    ("[train]\nsteps = 3\n[run]\nsteps = 4\n", ["'steps' is set twice", "table [train]", "table [run]"]),
    ("[train]\nglobal-batch = 8\n[parallel]\nglobal_batch = 4\n", ["set twice"]),
    ("[train.schedule]\nsteps = 3\n", ["[train.schedule]", "one level deep"]),
])
def test_toml_keys_set_twice_or_nested_tables_are_refused(toml, words, tmp_path, refused, no_launch):
    path = tmp_path / "run.toml"
    path.write_text(toml)
    for command in (["train", "--config", str(path)],
                    ["launch", "slurm", "--nodes", "1", "--", "--config", str(path)]):
        line = refused(command, "--config")
        assert all(w in line for w in words), line
    assert not no_launch


# ---------------------------------------------------------------- long preparation is shown
def _corpus(path: Path, words: int = 12_000) -> Path:
    import random
    rng = random.Random(0)
    vocab = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) for _ in range(400)]
    path.write_text(" ".join(rng.choice(vocab) for _ in range(words)) + "\n")
    return path


def test_tokenising_text_says_what_where_and_how_far(tmp_path, capsys, monkeypatch, no_launch):
    """trainmesh train --data TEXT --tokenizer bpe:N before any worker starts: one line for the
    tokenizer's training and one for the encoding, each naming its cache file, then lines of
    progress (every advance here: the thresholds at 0), the merges, and the end of each."""
    import trainmesh.observe.progress as progress
    monkeypatch.setattr(progress, "PREPARE_AFTER_S", 0.0)
    monkeypatch.setattr(progress, "PREPARE_EVERY_S", 0.0)
    monkeypatch.setattr("trainmesh.data.tokenizer.PIECE_BYTES", 4096)   # several pieces
    data = _corpus(tmp_path / "corpus.txt")
    main(["train", *T, "--seq-len", "16", "--data", str(data), "--tokenizer", "bpe:300"])
    assert no_launch, capsys.readouterr().err
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("trainmesh: ")]
    train = f"trainmesh: training a byte-level BPE of 300 tokens on {data}"
    encode = f"trainmesh: encoding {data} with its BPE of 300 tokens"
    (tok,) = tmp_path.glob("corpus.txt.bpe300-*.json")
    (ids,) = tmp_path.glob("corpus.txt.bpe300-*.npy")
    assert f"{train}; cache: {tok}" in lines and f"{encode}; cache: {ids}" in lines, lines
    for what in (train, encode):
        steps = [ln for ln in lines if ln.startswith(f"{what}: ") and "% (" in ln]
        assert len(steps) >= 3 and steps[-1].split(": ", 2)[2].startswith("100% ("), steps
        assert any(ln.startswith(f"{what}: done, ") for ln in lines), lines
    assert any(ln.endswith("; computing the merges") for ln in lines), lines


def test_short_preparation_shows_nothing(capsys):
    from trainmesh.observe.progress import Preparing
    with Preparing("encoding x", total=100, cache="c", after_s=60.0) as work:
        work.advance(100)
        work.phase("almost")
    assert capsys.readouterr().err == ""
