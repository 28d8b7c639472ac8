"""A weight tied across pipeline stages (the head's weight is the embedding's) composed with the
other axes, against one process, in one world-4 launch.

The pipeline sums the tied gradient over the stages that share it (same dp, cp and tp
coordinates) before the DP strategy reduces it, which holds that gradient back until then. So
with dp 2 under ZeRO 0 and 1, and with cp 2, the curve is one process's, and the two stages'
copies of the weight stay bitwise equal. ZeRO-2 and 3, which reduce gradients before the
stages' sum could be taken, are refused naming ``--zero`` (the table's rule, when the engine
cuts the model).
A Hugging Face model with tied embeddings through ``trainmesh train``: tests/test_hub_compose.py.
"""
from __future__ import annotations

import pytest
import torch
from tolerances import LOSS_ABS, NORM_REL

from trainmesh.core.errors import ConfigError
from trainmesh.testing import run_distributed

GPT_KW = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=4)
GLOBAL_BATCH = 8
OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=0.3)}
# (name, layout, optimizer, steps): a 20-step run with each ZeRO stage that composes; cp's
# shorter (a tie group missing the cp coordinate fails at build, a wrong sum within 2 steps)
RUNS = [("dp2-pp2-zero0", dict(dp=2, pp=2, microbatches=2), "sgd", 20),
        ("dp2-pp2-zero1", dict(dp=2, pp=2, zero=1, microbatches=2), "adamw", 20),
        ("cp2-pp2", dict(cp=2, pp=2, microbatches=4), "sgd", 6)]


def _engine(opt: str, **cfg):
    import trainmesh as tm
    from trainmesh.models.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(**GPT_KW), seed=0)
    model.head.out.weight = model.embed.wte.weight      # tied: both (vocab, d)
    return tm.Engine(model, optimizer=OPTIMIZERS[opt], loss_fn=lambda m, b: m(**b),
                     config=tm.ParallelConfig(timeout_s=30, **cfg), broadcast_init=False)


def _train(engine, steps: int) -> list[tuple[float, float]]:
    from trainmesh.data.corpus import SyntheticCorpus, dp_slice
    data, out = SyntheticCorpus(GPT_KW["vocab_size"], GPT_KW["seq_len"]), []
    for step in range(steps):
        engine.train_step(dp_slice(data.batch(0, step, GLOBAL_BATCH), engine.mesh.index("dp"),
                                   engine.config.dp))
        out.append((engine.last["loss"], engine.last["grad_norm"]))
    return out


def _tied_weight(engine) -> list[float] | None:
    """This rank's copy of the tied weight (as a list), if its stage holds one."""
    params = dict(engine.module.named_parameters(remove_duplicate=False))
    for name in ("embed.wte.weight", "head.out.weight"):
        if name in params:
            return params[name].detach().reshape(-1).tolist()
    return None


def world4_worker() -> dict:
    import torch.distributed as dist
    out = {}
    for name, cfg, opt, steps in RUNS:
        engine = _engine(opt, **cfg)
        out[name] = {"curve": _train(engine, steps), "weight": _tied_weight(engine),
                     "dp": engine.mesh.index("dp"), "cp": engine.mesh.index("cp")}
        dist.barrier()
    try:
        _train(_engine("sgd", dp=2, pp=2, zero=2, microbatches=2), 1)
        out["zero2"] = "trained"
    except ConfigError as e:
        out["zero2"] = e.field
    return out


@pytest.fixture(scope="module")
def world4() -> dict:
    return run_distributed(world4_worker, 4, timeout_s=150)


@pytest.fixture(scope="module")
def reference() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    for opt, steps in {(opt, steps) for _, _, opt, steps in RUNS}:
        out[opt, steps] = _train(_engine(opt), steps)
    torch.set_num_threads(threads)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tied_weights_compose_with_dp_zero1_and_cp(world4, reference) -> None:
    for name, _, opt, steps in RUNS:
        curve = reference[opt, steps]
        copies = {}
        for rank, res in world4.items():
            got = res[name]
            assert len(got["curve"]) == steps
            for step, ((loss, norm), (rloss, rnorm)) in enumerate(zip(got["curve"], curve), 1):
                assert abs(loss - rloss) <= LOSS_ABS, f"{name} rank {rank} step {step}: loss {loss} vs {rloss}"
                assert abs(norm - rnorm) <= NORM_REL * rnorm, \
                    f"{name} rank {rank} step {step}: grad norm {norm} vs {rnorm}"
            copies.setdefault((got["dp"], got["cp"]), []).append(got["weight"])
        for where, held in copies.items():   # both stages' copies: one weight, bitwise
            assert len(held) == 2 and held[0] == held[1], f"{name} {where}: the stages' copies differ"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_zero2_with_tied_stages_is_refused_naming_zero(world4) -> None:
    assert {res["zero2"] for res in world4.values()} == {"--zero"}   # the table's rule

