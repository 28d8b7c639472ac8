"""A Hugging Face model's dropout drawn by position under the strategies outside the mesh: the
parameter server's trainers (sync) and DiLoCo's replicas each equal one process with the same
seed, as every mesh layout does (test_randomness).

The model: a one-layer Seed-OSS (attention and residual dropout 0.1, its defaults) in float64,
SGD at lr 0.1, 2 steps of 4 sequences, 2 trainers or replicas of 2 rows each. Drawn from each
process's own generator instead, the masks differ from one process's and the weights by
about lr x a gradient (5e-3 seen under DiLoCo).
"""
from __future__ import annotations

import pytest
import torch

STEPS, LR, SEED = 2, 0.1, 3


def _model():
    import transformers
    torch.manual_seed(0)
    config = transformers.SeedOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    model = transformers.SeedOssForCausalLM(config).double()
    assert config.attention_dropout == config.residual_dropout == 0.1
    return model


def _batch(k: int, rows: slice = slice(None)) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(k))[rows]
    return {"input_ids": ids, "labels": ids}


def _loss(m, b):
    return m(**b).loss


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def _diloco() -> dict:
    """DiLoCo with one inner step, outer lr 1 and no momentum: data parallelism (its replica's
    change averaged), here with dropout."""
    import torch.distributed as dist

    from trainmesh import Engine, ParallelConfig
    rank = dist.get_rank()
    cfg = ParallelConfig(dp=2, strategy="diloco", inner_steps=1, outer_lr=1.0, outer_momentum=0.0)
    engine = Engine(_model(), _sgd, _loss, cfg, seed=SEED)
    for k in range(STEPS):
        engine.train_step(_batch(k, slice(2 * rank, 2 * rank + 2)))
    return engine.full_state_dict()


def _ps() -> dict | None:
    """2 trainers and 1 server, sync: the servers average the trainers' gradients."""
    import torch.distributed as dist

    import trainmesh as tm
    engine = tm.PSEngine(_model(), _sgd, _loss, tm.ParallelConfig(strategy="ps", dp=2, ps_servers=1),
                         seed=SEED)
    if engine.is_server:
        engine.serve()
        return None
    rank = dist.get_rank()
    for k in range(STEPS):
        engine.train_step(_batch(k, slice(2 * rank, 2 * rank + 2)))
    engine.close()
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def _one_process() -> dict[str, torch.Tensor]:
    from trainmesh import Engine, ParallelConfig, ParallelMesh
    engine = Engine(_model(), _sgd, _loss, ParallelConfig(), mesh=ParallelMesh(local=True), seed=SEED)
    for k in range(STEPS):
        engine.train_step(_batch(k))
    return {n.removeprefix("model.") if n.startswith("model.lm_head") else n: v
            for n, v in engine.full_state_dict().items()}


def _worst(got: dict, ref: dict, bound) -> list:
    """Tensors further from one process than ``bound(reference tensor)``."""
    return [(n, (got[n] - v).abs().max().item(), bound(v)) for n, v in ref.items()
            if (got[n] - v).abs().max().item() > bound(v)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dropout_under_ps_and_diloco_equals_one_process():
    """Bounds from the arithmetic: both keep the weights in fp32 whatever the model's dtype
    (the servers' flat fp32 shard, docs/PARAMETER_SERVER.md; DiLoCo's fp32 outer model,
    docs/DILOCO.md), while one process steps float64. Each weight is rounded to fp32 at the
    start and at most three times a step (PS: the gradient, its mean, the update; DiLoCo: the
    replica's weight, the change, the new weight), each rounding within half an fp32 ulp of a
    value no larger than the tensor's largest weight (the updates are about 1e-2 of the
    weights): (1 + 3 x STEPS) x 2^-24 x max |w|; the float64 sums themselves are ~1e-16
    relative. Dropout drawn from the process's generator moves weights by ~5e-3."""
    pytest.importorskip("transformers")
    from trainmesh.testing import run_distributed
    ref = _one_process()
    ps = run_distributed(_ps, 3, timeout_s=240)
    bound = lambda v: (1 + 3 * STEPS) * 2.0 ** -24 * v.abs().max().item()   # noqa: E731
    assert ps[2] is None
    for rank in (0, 1):
        got = {n.removeprefix("model.") if n.startswith("model.lm_head") else n: v for n, v in ps[rank].items()}
        assert set(got) == set(ref), sorted(set(got) ^ set(ref))
        assert not _worst(got, ref, bound), ("ps", rank, _worst(got, ref, bound))
    diloco = run_distributed(_diloco, 2, timeout_s=240)[0]
    assert not _worst(diloco, ref, bound), ("diloco", _worst(diloco, ref, bound))
