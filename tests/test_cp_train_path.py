"""Context parallelism on the path `trainmesh train` runs, against one process.

Engines are built as `trainmesh train` builds them (flags -> TrainConfig -> the GPT on the meta
device -> sharded initialisation -> the CLI's optimizer and LR schedule) and fed the trainer's
batches; one launch per world size runs every layout of :data:`MATRIX` one after another. The
cp-2 run saves a checkpoint that a cp-1 engine (here) and a cp-4 engine (the world-4 launch)
resume from. One real `trainmesh train --cp 2` launch checks the CLI's own path and that the
metrics file's ``comm_bytes_per_step.cp`` equals the documented formula exactly. Every run must
match the single process: loss within LOSS_ABS, grad norm within NORM_REL, every step.

Planted bugs this module catches (each seen failing with an assertion): the gradients reduced
over dp only (cp ranks' gradients never summed: grad norm 11% low at step 1); positions left
local (0..s/cp-1 on every rank: loss and grad norm off at step 1); the initial broadcast over
dp only (CP ranks of a model built per rank start apart). Batches not split over cp fail
louder: the ranks' zigzag positions run past the position table (IndexError).
"""
from __future__ import annotations

import pytest
import torch
from helpers import check_prediction, run_train, step_differences, steps, summary, train_config

from trainmesh.testing import run_distributed

STEPS = 6
LAYERS, D, SEQ, BATCH = 2, 32, 16, 8
BASE = ["--layers", str(LAYERS), "--d-model", str(D), "--heads", "4", "--seq-len", str(SEQ),
        "--vocab-size", "64", "--global-batch", str(BATCH), "--seed", "11", "--warmup-steps", "1",
        "--grad-clip", "1.0", "--steps", str(STEPS + 1)]
OPTIMIZER_FLAGS = {"adamw": ["--optimizer", "adamw", "--lr", "0.003"],
                   "sgd": ["--optimizer", "sgd", "--lr", "0.3"]}
# label: (world size, flags, optimizer)
MATRIX: dict[str, tuple[int, list[str], str]] = {
    "cp2": (2, ["--cp", "2"], "adamw"),
    "cp2-sgd": (2, ["--cp", "2"], "sgd"),
    "cp2-allgather": (2, ["--cp", "2", "--cp-comm", "allgather"], "adamw"),
    "cp2-zero3": (2, ["--cp", "2", "--zero", "3"], "sgd"),
    "cp2-recompute-selective": (2, ["--cp", "2", "--recompute", "selective", "--microbatches", "2"],
                                "adamw"),
    "cp4": (4, ["--cp", "4"], "adamw"),
    "dp2-cp2": (4, ["--dp", "2", "--cp", "2", "--zero", "1"], "sgd"),
    "cp2-tp2": (4, ["--cp", "2", "--tp", "2"], "adamw"),
    "cp2-tp2-sp": (4, ["--cp", "2", "--tp", "2", "--sequence-parallel"], "sgd"),
    "cp2-pp2": (4, ["--cp", "2", "--pp", "2", "--microbatches", "2"], "adamw"),
}


def _config(flags: list[str], optimizer: str):
    return train_config([*BASE, *flags, *OPTIMIZER_FLAGS[optimizer]])


def _engine(flags: list[str], optimizer: str, mesh=None):
    from trainmesh.data.corpus import make_datasets
    from trainmesh.run.trainer import build_engine
    cfg = _config(flags, optimizer)
    mesh = mesh or cfg.parallel.build_mesh()
    gpt = cfg.gpt_config()
    data, _ = make_datasets(cfg.data, vocab_size=gpt.vocab_size, seq_len=gpt.seq_len, held_out=False)
    return cfg, mesh, build_engine(cfg, torch.device("cpu"), mesh), data


def _curve(flags: list[str], optimizer: str, *, mesh=None, first: int = 1, last: int = STEPS,
           save: str | None = None, load: str | None = None) -> list[tuple[float, float]]:
    """`trainmesh train`'s engine and batches, steps ``first``..``last``: [(loss, grad_norm)],
    then (the evaluation loss of two batches after training, 0)."""
    from trainmesh.data.corpus import dp_slice
    cfg, mesh, engine, data = _engine(flags, optimizer, mesh)
    if load:
        engine.load(load)
    curve = []
    for step in range(first, last + 1):
        batch = dp_slice(data.batch(cfg.seed, step, cfg.global_batch), mesh.index("dp"), cfg.parallel.dp)
        curve.append((engine.train_step(batch), engine.last["grad_norm"]))
    if save:
        engine.save(save)
    held = [dp_slice(data.batch(cfg.seed + 1, k, cfg.global_batch), mesh.index("dp"), cfg.parallel.dp)
            for k in (1, 2)]
    return [*curve, (engine.evaluate(held), 0.0)]


def _start_checksum(cp: int) -> float:
    """The Python API on a model each rank built with its own seed: the engine's initial
    broadcast must give every CP rank the same weights (a checksum of them)."""
    import torch.distributed as dist

    import trainmesh as tm
    from trainmesh.models import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=64, seq_len=SEQ, d_model=D, n_layers=1, n_heads=4),
                seed=dist.get_rank())
    engine = tm.Engine(model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                       loss_fn=lambda m, b: m(**b), config=tm.ParallelConfig(cp=cp))
    return float(sum(p.double().sum() for p in engine.module.parameters()))


def _world(labels: list[str], save: str | None, load: str | None) -> dict:
    out = {label: _curve(MATRIX[label][1], MATRIX[label][2], save=save if label == "cp2" else None)
           for label in labels}
    if save:
        out["start"] = _start_checksum(2)
    if load:   # a cp-2 checkpoint resumed at cp 4
        out["resumed-cp4"] = _curve(["--cp", "4"], "adamw", first=STEPS + 1, last=STEPS + 1, load=load)
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, list[tuple[float, float]]]:
    """The single process, per optimizer: STEPS steps and the evaluation, and one step more
    (what the resumed runs are compared with)."""
    from trainmesh.core.mesh import ParallelMesh
    out = {opt: _curve([], opt, mesh=ParallelMesh(local=True)) for opt in ("adamw", "sgd")}
    out["adamw-longer"] = _curve([], "adamw", mesh=ParallelMesh(local=True), last=STEPS + 1)
    return out


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cp-ckpt"))


def _check_world(reference, res: dict, labels: list[str]) -> list[str]:
    failures = []
    for rank, out in res.items():
        for label in labels:
            failures += step_differences(reference[MATRIX[label][2]], out[label], f"{label} rank {rank}")
        if "resumed-cp4" in out:
            failures += step_differences(reference["adamw-longer"], out["resumed-cp4"][:1],
                                     f"cp2 checkpoint resumed at cp4, rank {rank}", first=STEPS + 1)
    return failures


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_world2_layouts_match_one_process_and_resume_at_cp1(reference, checkpoint_dir):
    labels = [label for label, (world, _, _) in MATRIX.items() if world == 2]
    res = run_distributed(_world, 2, labels, checkpoint_dir, None, timeout_s=380)
    failures = _check_world(reference, res, labels)
    starts = {rank: out["start"] for rank, out in res.items()}
    if len(set(starts.values())) != 1:
        failures.append(f"CP ranks start from different weights: checksums {starts}")
    from trainmesh.core.mesh import ParallelMesh
    resumed = _curve([], "adamw", mesh=ParallelMesh(local=True), first=STEPS + 1, last=STEPS + 1,
                     load=checkpoint_dir)
    failures += step_differences(reference["adamw-longer"], resumed[:1], "cp2 checkpoint resumed at cp1",
                             STEPS + 1)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_world4_layouts_match_one_process_and_resume_at_cp4(reference, checkpoint_dir):
    from pathlib import Path
    if not any(Path(checkpoint_dir).glob("step-*")):
        pytest.skip("needs the cp-2 checkpoint of the world-2 test")
    labels = [label for label, (world, _, _) in MATRIX.items() if world == 4]
    res = run_distributed(_world, 4, labels, None, checkpoint_dir, timeout_s=380)
    failures = _check_world(reference, res, labels)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_cp2_matches_one_process_and_its_traffic_formula(reference, tmp_path):
    """`python -m trainmesh train --cp 2 --microbatches 2`: the curve; per rank
    ``comm_bytes_per_step.cp`` = layers x microbatches x the formula of docs/CONTEXT_PARALLEL.md;
    and `trainmesh plan`'s prediction of the run's bytes held and sent, and its peak memory."""
    from trainmesh.context_parallel import cp_bytes_per_layer
    args = [*BASE, "--cp", "2", "--microbatches", "2", *OPTIMIZER_FLAGS["adamw"],
            "--exit-after", str(STEPS)]   # the reference's LR schedule (--steps STEPS + 1)
    proc, records = run_train(args, tmp_path, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = [(r["loss"], r["grad_norm"]) for r in steps(records)]
    failures = step_differences(reference["adamw"][:STEPS], run, "trainmesh train --cp 2")
    assert not failures, "\n".join(failures)
    done = summary(records)
    assert done["layout"]["cp"] == 2
    per_layer = cp_bytes_per_layer(cp=2, micro_batch=BATCH // 2, seq_len=SEQ, d_model=D)
    want = {op: LAYERS * 2 * b for op, b in per_layer.items()}
    for rank in done["ranks"]:
        assert rank["comm_bytes_per_step"]["cp"] == want, (rank["rank"], rank["comm_bytes_per_step"])
        assert rank["coords"]["cp"] == rank["rank"]
        assert "all_reduce" in rank["comm_bytes_per_step"]["dp_cp"]   # gradients over dp x cp
    check_prediction(args, done)


def test_seq_len_not_divisible_by_2cp_exits_2(capsys):
    from helpers import assert_refused
    assert_refused(capsys, ["train", *BASE[:6], "--seq-len", "12", "--cp", "4"], "--seq-len")


def test_cp_engine_refuses_a_model_without_an_attention_core():
    """The Python API: a model with no swappable attention core under cp names --cp."""
    from trainmesh.comm import Comm
    from trainmesh.context_parallel import apply_context_parallel
    from trainmesh.core.errors import ConfigError
    from trainmesh.core.mesh import ParallelMesh
    mesh = ParallelMesh(local=True)
    with pytest.raises(ConfigError, match="--cp"):
        apply_context_parallel(torch.nn.Linear(2, 2), mesh, Comm(mesh))


def test_sequence_parallel_needs_the_cp_share_divisible_by_tp(capsys):
    from helpers import assert_refused
    line = assert_refused(capsys, ["train", "--layers", "2", "--d-model", "32", "--heads", "8",
                                   "--vocab-size", "64", "--seq-len", "8", "--cp", "2", "--tp", "8",
                                   "--sequence-parallel"], "--seq-len")
    assert "--tp 8" in line
