"""3D composition: dp x pp x tp (+ZeRO) on one mesh equals the single process (README.md)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tolerances import LOSS_ABS, NORM_REL

from trainmesh import Engine, ParallelConfig, ParallelMesh
from trainmesh.data.corpus import SyntheticCorpus, dp_slice
from trainmesh.models.gpt import GPT, GPTConfig
from trainmesh.testing import run_distributed

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=8, n_heads=4)
GLOBAL_BATCH, STEPS = 8, 20
SHORT = 6
"""Steps of the world-4 compositions (each also checked elsewhere); dp x pp x tp runs 20."""


def _optimizer(name: str):
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.3)
    return lambda ps: torch.optim.AdamW(ps, lr=3e-3)


def _curve(cfg: ParallelConfig, optimizer: str, steps: int,
           mesh: ParallelMesh | None = None) -> list[tuple[float, float]]:
    engine = Engine(GPT(CFG, seed=0), _optimizer(optimizer), lambda m, b: m(**b), cfg, mesh=mesh,
                    broadcast_init=False)
    data, out = SyntheticCorpus(CFG.vocab_size, CFG.seq_len), []
    for step in range(1, steps + 1):
        batch = dp_slice(data.batch(0, step, GLOBAL_BATCH), engine.mesh.index("dp"), cfg.dp)
        loss = engine.train_step(batch)
        out.append((loss, engine.last["grad_norm"]))
    return out


def _layouts(layouts: list[dict], steps: int) -> dict:
    """Every layout and optimizer on this world (one mesh after another in the same processes),
    plus the single-process reference on rank 0."""
    out = {}
    for optimizer in ("adamw", "sgd"):
        for kw in layouts:
            out[optimizer, str(kw)] = _curve(ParallelConfig(grad_clip=1.0, **kw), optimizer, steps)
        if dist.get_rank() == 0:
            out[optimizer, "reference"] = _curve(ParallelConfig(grad_clip=1.0), optimizer, steps,
                                                 ParallelMesh(local=True))
    return out


def _assert_same(ref, run, what):
    for step, ((a, na), (b, nb)) in enumerate(zip(ref, run), 1):
        assert abs(a - b) <= LOSS_ABS, f"{what} step {step}: loss {a} vs {b}"
        assert abs(na - nb) <= NORM_REL * na, f"{what} step {step}: grad_norm {na} vs {nb}"


def _check(world: int, layouts: list[dict], steps: int) -> None:
    res = run_distributed(_layouts, world, layouts, steps, timeout_s=120)
    for optimizer in ("adamw", "sgd"):
        ref = res[0][optimizer, "reference"]
        for rank, out in res.items():
            for kw in layouts:
                assert len(out[optimizer, str(kw)]) == len(ref) == steps
                _assert_same(ref, out[optimizer, str(kw)], f"{optimizer} rank {rank} {kw}")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_dp2_pp2_tp2_zero1():
    _check(8, [dict(dp=2, pp=2, tp=2, zero=1, microbatches=2)], STEPS)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_world4_compositions():
    _check(4, [dict(dp=2, tp=2, zero=3), dict(pp=2, tp=2, microbatches=2),
               dict(pp=2, tp=2, microbatches=2, sequence_parallel=True)], SHORT)
