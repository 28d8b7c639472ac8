"""DDP internals in real processes: gradients equal the single-process gradients, buckets
overlap backward, accumulation reduces once, unused parameters are named, and a planted
gradient-scale bug is caught by the equivalence check (one launch for all of it)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tolerances import FP32_EPS, LOSS_ABS, NORM_REL, fp32_atol, scale_of
from torch import nn

from trainmesh import Engine, ParallelConfig, ParallelMesh
from trainmesh.data.corpus import SyntheticCorpus, dp_slice
from trainmesh.models.gpt import GPT, GPTConfig
from trainmesh.testing import run_distributed

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)
GLOBAL_BATCH = 8


def loss_fn(model, batch):
    return model(**batch)


def _sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def reference_grads(batch) -> dict[str, torch.Tensor]:
    """One process's gradients in float64: the exact value the float32 runs round."""
    model = GPT(CFG, seed=0).double()
    loss_sum, count = model(**batch)
    (loss_sum / count).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _grads_and_buckets(microbatches: int) -> dict:
    rank, dp = dist.get_rank(), dist.get_world_size()
    batch = SyntheticCorpus(64, 16).batch(0, 1, GLOBAL_BATCH)
    model = GPT(CFG, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = Engine(model, _sgd, loss_fn, ParallelConfig(dp=dp, microbatches=microbatches, bucket_mb=0.01))
    engine.train_step(dp_slice(batch, rank, dp))
    grads = {n: before[n] - p.detach() for n, p in model.named_parameters()}   # SGD lr=1: -dp
    ref = reference_grads(batch)
    err = max((grads[n].double() - ref[n]).abs().max().item() for n in ref)
    # float32 rounding of sums over the batch's tokens, plus the SGD update's own rounding
    # (the gradient is read back as before - after: one ulp of the weight)
    tol = fp32_atol(scale_of(ref.values()), GLOBAL_BATCH * CFG.seq_len) + \
        FP32_EPS * scale_of(before.values())
    buckets = engine.grad_sync.buckets
    return {"err": err, "tol": tol, "n_buckets": len(buckets), "n_params": len(engine.grad_sync.named_params),
            "first_launch_ready": buckets[0].ready_when_launched,
            "dp_bytes": engine.comm.ledger.bytes_per_step()["dp"],
            "grad_is_view": all(p.grad.untyped_storage().data_ptr() == engine.grad_sync.buffer.untyped_storage().data_ptr()
                                for p in model.parameters()),
            "psi": sum(p.numel() for p in model.parameters())}


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x).pow(2).mean()


def _unused_check() -> dict:
    out = {}
    for find in (False, True):
        torch.manual_seed(0)
        engine = Engine(WithUnused(), _sgd, lambda m, b: m(b), ParallelConfig(dp=2, find_unused_parameters=find))
        try:
            engine.train_step(torch.randn(3, 4))
            out[find] = "ok"
        except RuntimeError as exc:
            out[find] = str(exc)
    return out


def _planted_bug(plant: bool) -> dict:
    """20 AdamW steps at dp=2 and the single-process reference in the same process."""
    rank, dp = dist.get_rank(), dist.get_world_size()
    data = SyntheticCorpus(64, 16)
    adam = lambda ps: torch.optim.AdamW(ps, lr=3e-3)   # noqa: E731
    ref = Engine(GPT(CFG, seed=0), adam, loss_fn, ParallelConfig(), mesh=ParallelMesh(local=True))
    run = Engine(GPT(CFG, seed=0), adam, loss_fn, ParallelConfig(dp=dp))
    if plant:  # the classic bug: sum gradients over DP instead of averaging them
        finish = run.grad_sync.finish
        run.grad_sync.finish = lambda scale: finish(scale * dp)
    rows = []
    for step in range(1, 21):
        batch = data.batch(0, step, GLOBAL_BATCH)
        a = ref.train_step(batch)
        b = run.train_step(dp_slice(batch, rank, dp))
        rows.append((a, ref.last["grad_norm"], b, run.last["grad_norm"]))
    return rows


def equivalent(rows) -> bool:
    return all(abs(a - b) <= LOSS_ABS and abs(na - nb) <= NORM_REL * na for a, na, b, nb in rows)


def _world2() -> dict:
    """Everything this module checks, in one launch of 2 processes (a launch costs ~5 s here);
    the unused-parameter error last, since it leaves a step unfinished."""
    return {"grads": {m: _grads_and_buckets(m) for m in (1, 2)},
            "good": _planted_bug(False), "bad": _planted_bug(True), "unused": _unused_check()}


@pytest.fixture(scope="module")
def world2() -> dict:
    return run_distributed(_world2, 2, timeout_s=120)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_gradients_buckets_and_accumulation(world2):
    for rank in world2.values():
        for microbatches, out in rank["grads"].items():
            assert out["err"] <= out["tol"], \
                f"m={microbatches}: gradients differ from one process by {out['err']} > {out['tol']}"
            assert out["grad_is_view"], "param.grad must be views into the flat buffer"
            assert out["n_buckets"] > 3
            # the first bucket went out while most gradients were still to come: overlap
            assert out["first_launch_ready"] < out["n_params"] // 2, out
            # one all-reduce of every gradient per step, whatever the microbatch count
            assert out["dp_bytes"] == {"all_reduce": 4 * out["psi"]}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_unused_parameters_are_named(world2):
    for rank in world2.values():
        out = rank["unused"]
        assert "unused.weight" in out[False] and "unused.bias" in out[False]
        assert out[True] == "ok"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_equivalence_check_catches_a_planted_scale_bug(world2):
    assert all(equivalent(rank["good"]) for rank in world2.values())
    assert not any(equivalent(rank["bad"]) for rank in world2.values())
