"""3D composition: dp x pp x tp (+ZeRO) on one mesh equals the single process (CONTRACT.md)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from trainmesh import Engine, ParallelConfig, ParallelMesh
from trainmesh.data import SyntheticCorpus, dp_slice
from trainmesh.models.gpt import GPT, GPTConfig
from trainmesh.testing import run_distributed

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=8, n_heads=4)
GLOBAL_BATCH, STEPS = 8, 20


def _optimizer(name: str):
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.3)
    return lambda ps: torch.optim.AdamW(ps, lr=3e-3)


def _curve(cfg: ParallelConfig, optimizer: str, mesh: ParallelMesh | None = None) -> list[tuple[float, float]]:
    engine = Engine(GPT(CFG, seed=0), _optimizer(optimizer), lambda m, b: m(**b), cfg, mesh=mesh,
                    broadcast_init=False)
    data, out = SyntheticCorpus(CFG.vocab_size, CFG.seq_len), []
    for step in range(1, STEPS + 1):
        batch = dp_slice(data.batch(0, step, GLOBAL_BATCH), engine.mesh.index("dp"), cfg.dp)
        loss = engine.train_step(batch)
        out.append((loss, engine.last["grad_norm"]))
    return out


def _layouts(layouts: list[dict], optimizer: str) -> dict:
    """Every layout on this world (one mesh after another in the same processes) + the reference."""
    out = {}
    for kw in layouts:
        out[str(kw)] = _curve(ParallelConfig(grad_clip=1.0, **kw), optimizer)
    if dist.get_rank() == 0:
        out["reference"] = _curve(ParallelConfig(grad_clip=1.0), optimizer, ParallelMesh(local=True))
    return out


def _assert_same(ref, run, what):
    for step, ((a, na), (b, nb)) in enumerate(zip(ref, run), 1):
        assert abs(a - b) <= 1e-3, f"{what} step {step}: loss {a} vs {b}"
        assert abs(na - nb) <= 1e-3 * na, f"{what} step {step}: grad_norm {na} vs {nb}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_dp2_pp2_tp2_zero1(optimizer):
    layout = dict(dp=2, pp=2, tp=2, zero=1, microbatches=2)
    res = run_distributed(_layouts, 8, [layout], optimizer, timeout_s=120)
    for rank, out in res.items():
        _assert_same(res[0]["reference"], out[str(layout)], f"rank {rank} {layout}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_world4_compositions(optimizer):
    layouts = [dict(dp=2, tp=2, zero=3), dict(pp=2, tp=2, microbatches=2),
               dict(pp=2, tp=2, microbatches=2, sequence_parallel=True)]
    res = run_distributed(_layouts, 4, layouts, optimizer, timeout_s=120)
    for rank, out in res.items():
        for kw in layouts:
            _assert_same(res[0]["reference"], out[str(kw)], f"rank {rank} {kw}")
