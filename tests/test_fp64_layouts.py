"""A float64 model stays float64 on every layout's path: its loss, its gradients' reduction
(DDP, ZeRO), the vocab-parallel loss under tp and the gradient norm the step clips by. So its
layouts equal one process to float64 rounding, not float32's: one step of the float64 GPT
under dp 2 (DDP, ZeRO-1, ZeRO-3), tp 2 (+ SP), pp 2 and cp 2, clipped by the norm, moves every
weight as one process does within fp64_atol.

Where one of them ran in float32 (the default reduce dtype, float32 under fp32 precision, cast
a float64 model's gradients to float32 for the all-reduce and back; both cross-entropies cast
the logits to float32) the layouts differed from one process by ~1e-7 of a step, which an
optimizer that normalises its update (Adam, a normalised SGD) shows as it is.

In process: DiLoCo's outer step and replica norm, the parameter server's push, shard and
pull, and the router statistics of a mixture of experts keep float64 too.
"""
from __future__ import annotations

import pytest
import torch
from tolerances import fp64_atol

SHAPE = {"n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 16, "vocab_size": 64}
BATCH = 8
LAYOUTS = {"dp2": {"dp": 2}, "dp2-zero1": {"dp": 2, "zero": 1}, "dp2-zero3": {"dp": 2, "zero": 3},
           "tp2": {"tp": 2}, "tp2-sp": {"tp": 2, "sequence_parallel": True},
           "pp2": {"pp": 2, "microbatches": 2}, "cp2": {"cp": 2}}
CLIP = 1.0
"""Below the step's gradient norm (1.6): the update is g * CLIP / norm, so the norm counts."""


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)    # the update is the (clipped) gradient itself


def _one_step() -> dict:
    """Both ranks: one clipped SGD step of the float64 GPT in one process and under each
    layout. Returns {layout: (largest weight difference from one process over the parameters
    this rank holds, |loss difference|, |grad-norm difference|)} and the one process's
    (largest update, loss, grad norm, parameter count, the float64 norm of a plain backward's
    gradients) under "one"."""
    from trainmesh import Engine, ParallelConfig, ParallelMesh
    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.models.gpt import GPT, GPTConfig
    rank = torch.distributed.get_rank()
    batch = SyntheticCorpus(64, 16).batch(5, 0, BATCH)

    def step(fields: dict | None):
        model = GPT(GPTConfig(**SHAPE), seed=0).double()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        cfg = ParallelConfig(**(fields or {}), grad_clip=CLIP)
        engine = Engine(model, _sgd, lambda m, b: m(**b), cfg,
                        mesh=ParallelMesh(local=True) if fields is None else None)
        mine = batch
        if cfg.dp == 2:
            mine = {k: v[rank * BATCH // 2 : (rank + 1) * BATCH // 2] for k, v in batch.items()}
        report = engine.step(mine)
        after = engine.full_state_dict()      # collective; a pipeline stage's own parameters
        return {k: after[k] - before[k] for k in before if k in after}, report.loss, report.grad_norm

    plain = GPT(GPTConfig(**SHAPE), seed=0).double()   # the norm by hand, in float64
    loss_sum, count = plain(**batch)
    (loss_sum / count).backward()
    exact = sum(float(p.grad.pow(2).sum()) for p in plain.parameters()) ** 0.5
    ref, loss, norm = step(None)
    out = {"one": (max(float(u.abs().max()) for u in ref.values()), loss, norm,
                   sum(u.numel() for u in ref.values()), exact)}
    for name, fields in LAYOUTS.items():
        got, got_loss, got_norm = step(fields)
        assert got, (name, "no parameters")
        out[name] = (max(float((got[k] - ref[k]).abs().max()) for k in got),
                     abs(got_loss - loss), abs(got_norm - norm))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_float64_layouts_equal_one_process_to_float64_rounding():
    """Each update is a gradient (sums over the batch's 128 tokens of products through inner
    sums at most 4 * d_model = 128 wide: 128 * 128 terms) of magnitude <= the largest update
    of one process, times CLIP / norm; the loss a sum over 128 tokens; the norm a sum of the
    model's 30k squares. fp64_atol of those: ~3e-13 for the updates. Any float32 link in the
    chain errs by float32 rounding, ~1e-8 of the update (seen: 4e-10 and more), 1000x above."""
    from trainmesh.testing import run_distributed
    ranks = run_distributed(_one_step, 2, timeout_s=280)
    scale, loss, norm, params, exact = ranks[0]["one"]
    assert abs(norm - exact) <= fp64_atol(exact, params), ("one process's grad norm", norm, exact)
    terms = BATCH * SHAPE["seq_len"] * 4 * SHAPE["d_model"]
    for name in LAYOUTS:
        for rank, res in ranks.items():
            weights, dloss, dnorm = res[name]
            assert weights <= fp64_atol(scale, terms), (name, rank, "weights", weights, scale)
            assert dloss <= fp64_atol(loss, BATCH * SHAPE["seq_len"]), (name, rank, "loss", dloss)
            assert dnorm <= fp64_atol(norm, max(params, terms)), (name, rank, "grad norm", dnorm)


def test_a_float64_models_loss_is_float64():
    """The loss of a float64 GPT is computed in float64 (16-bit logits are widened to float32,
    float64 ones kept): the cross-entropy of its float64 logits, to float64 rounding."""
    import torch.nn.functional as F

    from trainmesh.models.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(**SHAPE), seed=0).double()
    ids = torch.arange(2 * 16).reshape(2, 16) % 64
    with torch.no_grad():
        loss, count = model(input_ids=ids, labels=ids.roll(-1, 1))
        logits = model(input_ids=ids)
    assert loss.dtype == torch.float64, loss.dtype
    want = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten(), reduction="sum")
    assert abs(float(loss) - float(want)) <= fp64_atol(float(want), int(count)), (loss, want)


def test_gradients_are_reduced_in_their_own_dtype_under_fp32():
    """Under fp32 precision the default reduce dtype is the gradients' own (None: a float64
    model's are not cast to float32 for the reduction); bf16 and fp16 reduce in their compute
    dtype, and --reduce-dtype fp32 in float32."""
    from trainmesh import ParallelConfig
    from trainmesh.engine.precision import Precision
    cpu = torch.device("cpu")
    assert Precision(ParallelConfig(), cpu).reduce_dtype is None
    assert Precision(ParallelConfig(reduce_dtype="fp32"), cpu).reduce_dtype == torch.float32
    assert Precision(ParallelConfig(precision="bf16"), cpu).reduce_dtype == torch.bfloat16
    assert Precision(ParallelConfig(precision="bf16", reduce_dtype="fp32"), cpu).reduce_dtype == torch.float32


def test_a_float64_hub_models_loss_is_float64():
    """The same for a Hugging Face causal LM through ``tm.causal_lm_loss``."""
    import torch.nn.functional as F
    transformers = pytest.importorskip("transformers")

    import trainmesh as tm
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)).double()
    ids = torch.arange(2 * 16).reshape(2, 16) % 64
    with torch.no_grad():
        loss, count = tm.causal_lm_loss(model, {"input_ids": ids, "labels": ids.roll(-1, 1)})
        logits = model(input_ids=ids).logits
    assert loss.dtype == torch.float64, loss.dtype
    want = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten(), reduction="sum")
    assert abs(float(loss) - float(want)) <= fp64_atol(float(want), int(count)), (loss, want)


def _step_in_process(model: torch.nn.Module, batch: dict, **fields) -> dict:
    """One clipped SGD step of ``model`` in this process under ``fields``; its state after."""
    from trainmesh import Engine, ParallelConfig, ParallelMesh
    engine = Engine(model, _sgd, lambda m, b: m(**b), ParallelConfig(**fields, grad_clip=CLIP),
                    mesh=ParallelMesh(local=True))
    engine.step(batch)
    return engine.full_state_dict()


def test_diloco_keeps_a_float64_model_in_float64():
    """DiLoCo with one inner step, outer lr 1 and no momentum is plain DP (θ <- θ - (θ - θ_r)):
    one replica's clipped step of the float64 GPT equals one process's within fp64_atol. The
    replica's squared norm (what it clips by) in float32 errs by 2.4e-9, θ and Δ in float32 by
    6e-8: 1e4x above."""
    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.models.gpt import GPT, GPTConfig
    batch = SyntheticCorpus(64, 16).batch(5, 0, BATCH)
    ref = _step_in_process(GPT(GPTConfig(**SHAPE), seed=0).double(), batch)
    got = _step_in_process(GPT(GPTConfig(**SHAPE), seed=0).double(), batch, strategy="diloco",
                           inner_steps=1, outer_lr=1.0, outer_momentum=0.0)
    before = GPT(GPTConfig(**SHAPE), seed=0).double().state_dict()
    scale = max(float((ref[k] - before[k]).abs().max()) for k in ref)
    terms = BATCH * SHAPE["seq_len"] * 4 * SHAPE["d_model"]
    worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    assert worst <= fp64_atol(scale, terms), ("weights", worst, scale)


class _Here:
    """An RRef to a server in this process (what its RPC entry points ask of one)."""

    def __init__(self, server) -> None:
        self.server = server

    def local_value(self):
        return self.server


def test_the_parameter_server_keeps_a_float64_model_in_float64():
    """A trainer's flat gradient, the server's shard, its sync step and the shard it answers
    with keep float64: one trainer's step is p - g / tokens exactly as float64 computes it.
    Each value differs from its float32 rounding by up to 2^-24 of itself (they were sent and
    held as float32): any float32 link breaks the equality."""
    from trainmesh.comm.ledger import Ledger
    from trainmesh.parameter_server import ParameterServer, PSClient
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    bias = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    weight.grad, bias.grad = torch.randn_like(weight), torch.randn_like(bias)
    named = [("weight", weight), ("bias", bias)]
    client = PSClient(named, [], [["weight", "bias"]], Ledger(), first_server_rank=1)
    grads = client._flat_grads(0)
    assert torch.equal(grads, torch.cat([weight.grad.reshape(-1), bias.grad])), "pushed gradients"
    server = ParameterServer(n_trainers=1, mode="sync", optimizer=_sgd)
    here = _Here(server)
    held = ParameterServer.load(here, [(n, p.detach()) for n, p in named])
    tokens = 3.0
    sq, _, _ = ParameterServer.push(here, 1, grads, 0.0, tokens).wait()
    flat, _ = ParameterServer.update_and_pull(here, 1, 1.0)
    want = torch.cat([weight.reshape(-1), bias]).detach() - grads / tokens
    assert flat.dtype == torch.float64 and torch.equal(flat, want), (flat - want).abs().max()
    assert abs(sq - float(grads.div(tokens).pow(2).sum())) <= fp64_atol(sq, 15), sq
    assert held == 15 * 8, ("bytes held", held)


def test_a_float64_routers_statistics_are_float64():
    """The per-sequence router statistics of float64 router logits (what the aux loss is made
    of) are float64: each sequence's probability sums equal float64's own softmax and sum of
    them exactly (they were float32: off by ~1e-8 of each sum)."""
    from trainmesh.core.hf_routing import layers_routing
    logits = torch.randn(2 * 16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    routing = layers_routing([logits, 2 * logits], [0, 1], 2, 2, None)        # 2 sequences of 16
    want = sum(x.softmax(-1).view(2, 16, 4).sum(1) for x in (logits, 2 * logits))
    assert routing.probs.dtype == routing.rows.dtype == torch.float64, routing.probs.dtype
    assert torch.equal(routing.probs, want), (routing.probs - want).abs().max()
    assert routing.slots.sum() == 2 * 2 * 16 * 2 and routing.rows.tolist() == [32.0, 32.0]
