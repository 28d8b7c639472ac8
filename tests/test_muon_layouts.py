"""--optimizer muon through `trainmesh train` where matrices are cut, against one process by
loss, grad norm and the weights after 20 steps: ZeRO-3 with gradient accumulation, and a
checkpoint of ZeRO-3 x tp 2 resumed under pp 2 x dp 2. The other layouts: test_layout_matrix.py,
whose dense rows and whole mesh run Muon. lr 0.002 as there (why: its MUON).

The weights' bound. Every layout feeds the iteration a momentum that differs from one
process's by reduction-order rounding (~1e-7 relative); the iteration casts it to bf16, so where
that rounding flips an element moves by one bf16 step, 2^-8 of itself, and the iteration's
output by at most about as much (relative). A step's update is lr_t x factor x NS(u), whose
entries are at most its spectral norm, below 1.5 for torch's quintic coefficients, times the
learning-rate factor (here at most 2: sqrt(128 / 32)). So after T steps a weight is within
2^-8 x 1.5 x 2 x sum_t lr_t of one process's (AdamW's parameters follow through the loss; their
own update is at most lr_t per element). Each planted bug moves an update by its whole size,
far past this (seen: 1e-2 and more).

Planted bugs caught here (each seen failing with an assertion): the iteration run on a rank's
shard instead of the whole matrix (install() leaving ZeRO's hook local); the owner's result not
returned to one holder (rank 1 keeping its stretches of the update zero).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from helpers import SMALL, assert_equivalent, run_train, steps
from tolerances import LOSS_ABS, NORM_REL, fp64_atol

SHAPE = {"n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 16, "vocab_size": 64}
MUON = ["--optimizer", "muon", "--lr", "0.002"]


def _weights(step_dir) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    from trainmesh.models.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(**SHAPE), seed=0)
    state = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    with warnings.catch_warnings():   # one process, no process group: as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    return state["model"]


def _bound(records: list[dict]) -> float:
    return 2**-8 * 1.5 * 2 * sum(r["lr"] for r in steps(records))


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> tuple[list[dict], Path]:
    """The uninterrupted one-process run: (its records, its checkpoint directory)."""
    tmp = tmp_path_factory.mktemp("one")
    proc, records = run_train([*SMALL, *MUON, "--save-dir", str(tmp / "ck")], tmp, name="one")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return records, tmp / "ck"


def _assert_weights_near(ref_dir: Path, run_dir: Path, records: list[dict]) -> None:
    a, b = _weights(ref_dir / "step-00000020"), _weights(run_dir / "step-00000020")
    bound = _bound(records)
    worst = max(((a[k] - b[k]).abs().max().item(), k) for k in a)
    assert worst[0] <= bound, f"{worst[1]} off one process by {worst[0]:.2e} > {bound:.2e}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero3_with_accumulation_equals_one_process(one, tmp_path):
    ref, ref_dir = one
    proc, run = run_train([*SMALL, *MUON, "--dp", "2", "--zero", "3", "--microbatches", "2",
                           "--save-dir", str(tmp_path / "ck")], tmp_path, name="zero3", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "optimizer: Muon on 12 hidden weight tensors" in proc.stdout + proc.stderr
    assert_equivalent(ref, run)
    _assert_weights_near(ref_dir, tmp_path / "ck", ref)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_checkpoint_of_zero3_tp2_resumes_under_pp2_dp2(one, tmp_path):
    """Saved at step 10 by ZeRO-3 x tp 2 (momentum in flat shards of tp shards), resumed by
    pp 2 x dp 2 (whole stage-local matrices): steps 11-20 as the uninterrupted one process."""
    ref, ref_dir = one
    ck = tmp_path / "ck"
    proc, _ = run_train([*SMALL, *MUON, "--dp", "2", "--zero", "3", "--tp", "2", "--save-dir", str(ck),
                         "--exit-after", "10"], tmp_path, name="first", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, run = run_train([*SMALL, *MUON, "--pp", "2", "--dp", "2", "--microbatches", "2",
                           "--save-dir", str(ck), "--resume"], tmp_path, name="second", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in steps(run)] == list(range(11, 21))
    for a, b in zip(steps(ref)[10:], steps(run)):
        assert abs(a["loss"] - b["loss"]) <= LOSS_ABS, (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= NORM_REL * a["grad_norm"], (a, b)
    _assert_weights_near(ref_dir, ck, ref)


class NormalizedSGD(torch.optim.Optimizer):
    """A user's optimizer that needs whole parameters: each step moves a parameter by lr along
    its gradient over the gradient's whole norm (a norm of a shard would differ); a gradient
    below 1e-3 (attention's key bias, zero but for rounding) is not blown up to a unit step."""

    needs_whole_params = True

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm().clamp_min(1e-3), alpha=-group["lr"])


WHOLE_LAYOUTS = {"zero1": {"dp": 2, "zero": 1}, "zero3": {"dp": 2, "zero": 3}, "tp2": {"tp": 2}}
WHOLE_STEPS = 3


def _whole_param_runs() -> dict:
    """Rank 0 and 1 train the float64 GPT WHOLE_STEPS steps with NormalizedSGD under each
    layout (its class declaring needs_whole_params; ZeRO-3 also through tm.whole_params); rank
    0 also in one process. Returns each layout's weights' largest difference from one process
    and, under "norm", the one process's largest gradient norm."""
    import trainmesh as tm
    from trainmesh import Engine, ParallelConfig, ParallelMesh
    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.models.gpt import GPT, GPTConfig
    rank = torch.distributed.get_rank()
    corpus = SyntheticCorpus(64, 16)

    norms = []

    def train(cfg: ParallelConfig | None, factory) -> dict[str, torch.Tensor]:
        mesh = ParallelMesh(local=True) if cfg is None else None
        engine = Engine(GPT(GPTConfig(**SHAPE), seed=0).double(), factory, lambda m, b: m(**b),
                        cfg or ParallelConfig(), mesh=mesh)
        for k in range(WHOLE_STEPS):
            batch = corpus.batch(5, k, 8)
            if cfg is not None and cfg.dp == 2:
                batch = {key: v[4 * rank : 4 * rank + 4] for key, v in batch.items()}
            norms.append(engine.step(batch).grad_norm)
        return engine.full_state_dict()      # collective: every rank of the run

    ref = train(None, NormalizedSGD) if rank == 0 else None
    out = {"norm": max(norms)} if rank == 0 else {}
    for name, fields in WHOLE_LAYOUTS.items():
        for how, factory in (("declared", NormalizedSGD), ("wrapped", tm.whole_params(NormalizedSGD))):
            if how == "wrapped" and name != "zero3":
                continue
            got = train(ParallelConfig(**fields), factory)
            if rank == 0:
                out[f"{name}-{how}"] = max(((got[k] - ref[k]).abs().max().item(), k) for k in ref)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_optimizer_needing_whole_parameters_gets_them_under_every_sharding():
    """Float64 end to end (test_fp64_layouts), so each layout's gradients equal one
    process's within fp64_atol(||g||, terms) (sums over 128 tokens of products through inner
    sums up to 4 * d_model wide) and so within that in norm too. The step g / max(||g||, 1e-3)
    moves by at most 2 x that / 1e-3 of lr (the clamp: attention's key bias, zero but for
    rounding), each step; the key bias's gradient stays zero in exact arithmetic whatever the
    weights, so no step's difference grows through the next's gradient beyond that. A shard's
    own norm moves a weight by a large part of a step (0.05); float32 anywhere in the path
    (the reduction, the loss, the norm) moved one by 2.3e-9, above the bound."""
    from trainmesh.testing import run_distributed
    res = run_distributed(_whole_param_runs, 2, timeout_s=280)[0]
    norm = res.pop("norm")
    assert set(res) == {"zero1-declared", "zero3-declared", "zero3-wrapped", "tp2-declared"}, res
    terms = 8 * SHAPE["seq_len"] * 4 * SHAPE["d_model"]
    bound = WHOLE_STEPS * 0.05 * 2 * fp64_atol(norm, terms) / 1e-3
    for name, worst in res.items():
        assert worst[0] <= bound, (name, worst, bound)


TP_STEPS = 2


def _muon_tp_runs() -> dict:
    """Rank 0 and 1 train the float64 GPT TP_STEPS Muon steps at tp 2, with the tp owners
    (each cut matrix iterated at one tp rank; all matrices in one bucket, and in buckets of
    4096 values: 2-3 matrices each) and with every tp rank iterating every matrix on the
    gathered whole (the path a user's optimizer takes, :class:`ByName`). Returns this rank's
    iteration FLOPs and its weights' largest difference between the paths, and the FLOPs of
    each matrix once (what one TP group must iterate in all)."""
    from trainmesh import Engine, ParallelConfig
    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.data_parallel import muon_owners, whole_maps
    from trainmesh.data_parallel.muon import MuonAdamW, is_hidden_matrix, muon_options, ns_flops
    from trainmesh.models.gpt import GPT, GPTConfig
    corpus = SyntheticCorpus(64, 16)

    def train(owned: bool, bucket: int = 1 << 25) -> tuple[dict[str, torch.Tensor], int, int]:
        model = GPT(GPTConfig(**SHAPE), seed=0).double()
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        once = sum(ns_flops(s) for n, s in shapes.items() if is_hidden_matrix(n, s)) * TP_STEPS
        chosen = whole_maps.TensorParallelOwners      # the map install() gives Muon at tp
        if not owned:
            whole_maps.TensorParallelOwners = muon_owners.ByName
        try:
            engine = Engine(model, lambda ps: MuonAdamW(ps, lr=0.01), lambda m, b: m(**b),
                            ParallelConfig(tp=2), param_groups=muon_options(shapes, lambda n: {}))
        finally:
            whole_maps.TensorParallelOwners = chosen
        engine.optimizer.bucket_values = bucket
        for k in range(TP_STEPS):
            engine.step(corpus.batch(5, k, 8))
        return engine.full_state_dict(), engine.optimizer.flops_run, once

    owned, flops, once = train(True)
    buckets, bucket_flops, _ = train(True, 4096)
    every, every_flops, _ = train(False)
    return {"flops": flops, "bucket_flops": bucket_flops, "every_flops": every_flops, "once": once,
            "diff": max(((owned[k] - every[k]).abs().max().item(), k) for k in owned),
            "bucket_diff": max(((buckets[k] - every[k]).abs().max().item(), k) for k in owned)}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_tp_owners_iterate_each_matrix_once_and_equal_every_rank_iterating():
    """At tp 2 the two ranks' iteration FLOPs sum to each matrix's once and neither runs more
    than 1.25x the mean (the owners' greedy table; both run everything, 2x the mean, where each
    rank iterates every matrix). The weights equal those of every rank iterating the gathered
    whole exactly: the owner iterates the same gathered matrix (gathers copy), so the same
    bf16 ops on the same input; the scatter copies its result (fp32 to the float64 weights:
    exact, as the update's own cast)."""
    from trainmesh.testing import run_distributed
    res = run_distributed(_muon_tp_runs, 2, timeout_s=180)
    once = res[0]["once"]
    flops = [res[r]["flops"] for r in (0, 1)]
    assert [res[r]["every_flops"] for r in (0, 1)] == [once, once], res
    assert max(flops) <= 1.25 * once / 2, (flops, once)
    assert sum(flops) == once, (flops, once)
    assert [res[r]["bucket_flops"] for r in (0, 1)] == flops, res
    for r in (0, 1):
        assert res[r]["diff"][0] == 0.0 and res[r]["bucket_diff"][0] == 0.0, (r, res[r])
