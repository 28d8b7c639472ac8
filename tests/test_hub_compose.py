"""A Hugging Face model nobody here wrote, with tied embeddings (``tie_word_embeddings``: the
head's weight is the input embedding's), through ``trainmesh train --model-dir`` where it meets
the axes that treat a tied weight specially, against the one-process engine the same command
builds (in this process):

- ``--pp 2 --dp 2``: the head's stage holds the weight alone, read from the file under its
  alias; its gradient is summed over the two stages before the DP reduction;
- ``--dp 2 --fault-tolerant``: replica 1 is SIGKILLed inside step 3's all-reduce and rejoins at
  step 6 with the live state (tied weight included) sent by replica 0; the curve is one
  process's throughout;
- ``--dp 2 --strategy diloco`` with one inner SGD step and the plain outer step: data
  parallelism, so one process's curve.
"""
from __future__ import annotations

import pytest
import torch
from helpers import run_train, step_differences, steps, train_config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SCHEDULE = 8
BASE = ["--seq-len", "16", "--global-batch", "4", "--steps", str(SCHEDULE), "--warmup-steps", "1",
        "--lr", "0.01", "--seed", "3"]


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory) -> str:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    directory = str(tmp_path_factory.mktemp("hub") / "llama-tied")
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def reference(tied_llama) -> list[tuple[float, float]]:
    return _one_process(["--model-dir", tied_llama, *BASE])


def _one_process(args: list[str]) -> list[tuple[float, float]]:
    """[(loss, grad norm)] per step of the engine ``trainmesh train ARGS`` builds, in one
    process (this one)."""
    from trainmesh.core.mesh import ParallelMesh
    from trainmesh.data.corpus import make_datasets
    from trainmesh.run.trainer import build_engine
    cfg = train_config(args)
    engine = build_engine(cfg, torch.device("cpu"), ParallelMesh(local=True))
    data, _ = make_datasets(cfg.data, vocab_size=cfg.vocab_size, seq_len=16, held_out=False)
    return [(engine.train_step(data.batch(cfg.seed, step, 4)), engine.last["grad_norm"])
            for step in range(1, SCHEDULE + 1)]


def _curve(records: list[dict]) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in steps(records)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tied_embeddings_at_pp2_dp2(tied_llama, reference, tmp_path) -> None:
    proc, records = run_train(["--model-dir", tied_llama, *BASE, "--pp", "2", "--dp", "2",
                               "--microbatches", "2", "--exit-after", "4"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    curve = _curve(records)
    assert len(curve) == 4
    failures = step_differences(reference, curve, "tied Llama --pp 2 --dp 2")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replica_lost_and_rejoined(tied_llama, reference, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRAINMESH_FT_INJECT", "1@3,1.1@6:join,0@6:hold")
    proc, records = run_train(["--model-dir", tied_llama, *BASE, "--dp", "2", "--fault-tolerant",
                               "--timeout", "30"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    quorums = [(q["step"], q["replicas"], q["lost"], q["joined"])
               for q in records if q["event"] == "quorum"]
    assert quorums == [(3, 1, [1], []), (6, 2, [], [1])], quorums
    assert [r["replicas"] for r in steps(records)] == [2, 2, 1, 1, 1, 2, 2, 2]
    failures = step_differences(reference, _curve(records), "tied Llama --fault-tolerant")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_diloco_with_one_inner_sgd_step_is_data_parallel(tied_llama, tmp_path) -> None:
    """Each replica's one SGD step, averaged by the plain outer step (lr 1, no momentum), is the
    step on the averaged gradient: the curve is one process's (losses: DiLoCo reports no global
    gradient norm)."""
    sgd = ["--model-dir", tied_llama, *BASE, "--optimizer", "sgd", "--grad-clip", "0"]
    reference = _one_process(sgd)
    proc, records = run_train([*sgd, "--dp", "2", "--strategy", "diloco", "--inner-steps", "1",
                               "--outer-lr", "1", "--outer-momentum", "0", "--exit-after", "4"],
                              tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["loss"] for r in steps(records)]
    assert len(losses) == 4 and all(r["outer"] for r in steps(records)), steps(records)
    failures = step_differences(reference, [(loss, want[1]) for loss, want in zip(losses, reference)],
                                "tied Llama --strategy diloco --inner-steps 1")
    assert not failures, "\n".join(failures)
