"""Packed documents under every axis: `trainmesh train --documents packed` equals one process.

Each row runs 20 steps of the small GPT on packed JSON-lines documents (most shorter than a
sequence, some longer) against the one-process run of the same flags (loss within LOSS_ABS,
grad norm within NORM_REL relative; tests/helpers.py ``assert_equivalent``); the rows compose
the axes so that each appears at least once: dp, ZeRO-1/2/3, HSDP, offload, tp with sequence
parallelism, pp (zb1p, interleaved, 1f1b), cp, MoE with ep, fault tolerance, DiLoCo (the
16-process mesh composing dp, ZeRO-3, tp + SP, pp and cp); a Llama --model-dir under tp + SP
and pp; a packed run stopped and resumed. A step's record counts the global batch's documents
(``documents``).

Planted bugs caught here: DiLoCo averaging the replicas' changes equally where they counted
different tokens (the diloco row: "step 17: loss 3.0452157297442035 vs 3.046917207779423",
1.7e-3 off); a hub model's pipeline stages not given the microbatch's position ids ("step 1:
grad_norm 1.4585321381709053 vs 1.5000774045681926").
"""
from __future__ import annotations

import json
import random

import pytest
from helpers import SMALL, assert_equivalent, run_train, steps, summary
from tolerances import LOSS_ABS

from trainmesh.data.corpus import make_datasets
from trainmesh.data.packing import documents_in

MOE = ["--experts", "4", "--moe-aux-loss", "0.1"]
SGD = ["--optimizer", "sgd", "--grad-clip", "0", "--lr", "0.1"]
"""DiLoCo's row and reference (as tests/test_layout_matrix.py's: with one inner step, outer lr 1
and no outer momentum, SGD without clipping inside is DP exactly)."""
DILOCO = ["--strategy", "diloco", "--inner-steps", "1", "--outer-lr", "1.0", "--outer-momentum", "0.0"]
ROWS: dict[str, tuple[list[str], list[str]]] = {
    # name: (model and optimizer flags shared with the reference, the layout's flags)
    "moe-ft-dp4-shard2-zero1-ep2": (MOE, ["--dp", "4", "--dp-shard", "2", "--zero", "1",
                                          "--ep", "2", "--fault-tolerant"]),
    "diloco-dp4-shard2-zero2-offload-pp2-interleaved": ([*SGD, "--layers", "4"], [
        "--dp", "4", "--dp-shard", "2", "--zero", "2", "--offload", "cpu", "--pp", "2",
        "--microbatches", "2", "--schedule", "interleaved", "--virtual-stages", "2", *DILOCO]),
    "dp2-zero3-tp2-sp-pp2-zb1p-cp2": ([], ["--dp", "2", "--zero", "3", "--tp", "2",
                                           "--sequence-parallel", "--pp", "2", "--microbatches",
                                           "2", "--schedule", "zb1p", "--cp", "2"]),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """Documents of 0..40 characters plus their blank line: several per 16-token sequence, and
    pieces of those a sequence cuts."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("packed") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": "".join(rng.choice("abcdefgh \n") for _ in
                                                          range(rng.randint(0, 40)))}) + "\n"
                            for _ in range(400)))
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(ROWS))
def test_a_packed_layout_matches_one_process(name, corpus, reference_run, tmp_path):
    model, layout = ROWS[name]
    data = [*SMALL, "--vocab-size", "256", "--data", corpus, "--documents", "packed", *model]
    ref = reference_run(data)
    proc, run = run_train([*data, *layout], tmp_path, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train, _ = make_datasets(corpus, vocab_size=256, seq_len=16, held_out=False, documents="packed")
    want = [documents_in(train.batch(0, k, 8)) for k in range(1, 21)]
    assert [r["documents"] for r in steps(run)] == [r["documents"] for r in steps(ref)] == want
    assert all(8 < n for n in want)           # more documents (or pieces) than rows
    if "--strategy" not in layout:
        assert_equivalent(ref, run)
    else:                                     # DiLoCo forms no global gradient norm
        a, b = steps(ref), steps(run)
        assert len(a) == len(b) == 20 and all(r.get("outer") for r in b), (len(a), len(b))
        for x, y in zip(a, b):
            assert abs(x["loss"] - y["loss"]) <= LOSS_ABS, \
                f"step {x['step']}: loss {x['loss']} vs {y['loss']}"
    if "--cp" in layout:   # a stage gathers a microbatch's position ids once (b·s·8 bytes)
        ranks = summary(run)["ranks"]
        assert len(ranks) == 16
        for rank in ranks:
            assert rank["comm_bytes_per_step"]["cp"]["all_gather"] == 2 * 2 * 16 * 8, rank


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama of the bytes' vocabulary, saved as a --model-dir (no tokenizer: the
    data's bytes are its tokens)."""
    transformers = pytest.importorskip("transformers")
    import torch
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("llama") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(str(path))
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_packed_hub_model_under_tp_sp_and_pp_matches_one_process(corpus, llama_dir, reference_run,
                                                                     tmp_path):
    """A Llama --model-dir on packed documents (its rotary positions from the position ids, its
    mask per document): tp 2 + SP x pp 2 equals one process for 8 steps."""
    data = ["--model-dir", llama_dir, "--seq-len", "16", "--global-batch", "8", "--steps", "8",
            "--warmup-steps", "2", "--lr", "0.01", "--data", corpus, "--documents", "packed"]
    ref = reference_run(data)
    proc, run = run_train([*data, "--tp", "2", "--sequence-parallel", "--pp", "2",
                           "--microbatches", "2"], tmp_path, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(r["documents"] > 8 for r in steps(run))
    assert_equivalent(ref, run, min_steps=8)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_resumed_packed_run_continues_the_same_packing(corpus, reference_run, tmp_path):
    """Stopped after step 10 (its checkpoint), resumed at dp 2: steps 11-20 are the
    uninterrupted one-process run's, documents included (the batch of step k is k's)."""
    data = [*SMALL, "--vocab-size", "256", "--data", corpus, "--documents", "packed"]
    ref = reference_run(data)
    save = ["--save-dir", str(tmp_path / "ckpt"), "--save-every", "10"]
    proc, first = run_train([*data, *save, "--exit-after", "10"], tmp_path, name="first")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, resumed = run_train([*data, *save, "--resume", "--dp", "2"], tmp_path, name="resumed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in steps(resumed)] == list(range(11, 21))
    assert [r["documents"] for r in steps(first) + steps(resumed)] == \
        [r["documents"] for r in steps(ref)]
    later = [r for r in steps(ref) if r["step"] > 10]
    assert_equivalent(later, resumed, min_steps=10)
