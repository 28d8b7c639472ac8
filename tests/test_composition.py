"""3D composition: dp x pp x tp (+ZeRO) on one mesh equals the single process (README.md).

Each world is one launch running its layouts one after another, AdamW and SGD, against the
single process on rank 0. dp x pp x tp x ZeRO-1 keeps a 20-step AdamW curve (the README's
promise); its SGD curve and the world-4 compositions take SHORT steps: a wrong reduction or a
stale parameter moves the loss past 1e-3 within 2 steps (planted: ZeRO-1's all-gather of the
updated shards skipped, 0.03 off at step 2). Four layers give each of two stages two blocks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tolerances import LOSS_ABS, NORM_REL

from trainmesh import Engine, ParallelConfig, ParallelMesh
from trainmesh.data.corpus import SyntheticCorpus, dp_slice
from trainmesh.models.gpt import GPT, GPTConfig
from trainmesh.testing import run_distributed

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=4)
GLOBAL_BATCH, STEPS = 8, 20
SHORT = 6
"""Steps of the world-4 compositions (each also checked elsewhere) and of dp x pp x tp's SGD
curve; its AdamW curve runs STEPS."""


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


def _layouts(layouts: list[dict], steps: dict[str, int]) -> dict:
    """Every layout and optimizer on this world (one mesh after another in the same processes),
    ``steps[optimizer]`` steps each, plus the single-process reference on rank 0."""
    out = {}
    for optimizer, n in steps.items():
        for kw in layouts:
            out[optimizer, str(kw)] = _curve(ParallelConfig(grad_clip=1.0, **kw), optimizer, n)
        if dist.get_rank() == 0:
            out[optimizer, "reference"] = _curve(ParallelConfig(grad_clip=1.0), optimizer, n,
                                                 ParallelMesh(local=True))
    return out


def _assert_same(ref, run, what):
    for step, ((a, na), (b, nb)) in enumerate(zip(ref, run), 1):
        assert abs(a - b) <= LOSS_ABS, f"{what} step {step}: loss {a} vs {b}"
        assert abs(na - nb) <= NORM_REL * na, f"{what} step {step}: grad_norm {na} vs {nb}"


def _check(world: int, layouts: list[dict], steps: dict[str, int]) -> None:
    res = run_distributed(_layouts, world, layouts, steps, timeout_s=120)
    for optimizer, n in steps.items():
        ref = res[0][optimizer, "reference"]
        for rank, out in res.items():
            for kw in layouts:
                assert len(out[optimizer, str(kw)]) == len(ref) == n
                _assert_same(ref, out[optimizer, str(kw)], f"{optimizer} rank {rank} {kw}")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_dp2_pp2_tp2_zero1():
    _check(8, [dict(dp=2, pp=2, tp=2, zero=1, microbatches=2)], {"adamw": STEPS, "sgd": SHORT})


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_world4_compositions():
    _check(4, [dict(dp=2, tp=2, zero=3), dict(pp=2, tp=2, microbatches=2),
               dict(pp=2, tp=2, microbatches=2, sequence_parallel=True)], {"adamw": SHORT, "sgd": SHORT})
