"""Hub families on every axis, each against one process, from its directory as ``trainmesh
train --model-dir`` builds it (``from_pretrained``: the plans it declares, those inferred where
it declares none).

One world-2 launch of the Python API runs every case below for STEPS AdamW steps against the one
process run in the pytest process (loss within LOSS_ABS, grad norm within NORM_REL):

- the dense families (OLMo 2, OLMo 3, StableLM, Gemma 3, Cohere, GLM-4, Starcoder2, Seed-OSS)
  under ``tp 2``, ``tp 2`` + SP, ``pp 2`` (2 microbatches), ``cp 2`` and ``dp 2`` ZeRO-3 with
  selective recomputation;
- the mixtures of experts (Ernie 4.5, GraniteMoE, Llama 4, dots.llm1, PhiMoE, GLM-4-MoE) under
  ``dp 2 x ep 2``, ``tp 2``, ``tp 2`` + SP, ``pp 2``, ``cp 2`` and ``dp 2`` ZeRO-3; OLMoE
  under ``pp 2`` and ``tp 2`` + SP.

What these cover that needed more than reading a plan: OLMo 2/3's and OLMoE's q/k/v gathered
whole for their norms (``colwise_gather_output``: the attention's input gathered along the
sequence before its own code reads the shape); Ernie 4.5's experts counted as
``moe_num_experts``, and its shared experts called on the flattened tokens (under SP their
column layer gathers rows), its router's correction bias a part of the router; StableLM's tp
and pp plans, Llama 4's pp and ep plans and GraniteMoE's, PhiMoE's and OLMoE's layer lists
inferred; Llama 4's plan read under its base model (``model``, though its
``base_model_prefix`` says ``language_model``), its experts' ``packed_rowwise`` gate/up (stored
``(E, in, out)``: dimension 2 split per half), and its experts taking the tokens in
expert-major blocks: dispatched over ep by their non-zero rows, gathered block by block under
SP, its router (which transformers does not record) per token there. Router jitter and attention
dropout are 0 here (test_randomness draws them).

Planted bugs this module catches (each seen failing with an assertion): the gathered attention
not entered as one region under SP (the rank reports the rotary embedding's size mismatch);
``packed_rowwise`` mapped to dimension 1 (Llama 4 tp 2: the rank reports the shape mismatch);
Llama 4's chosen rows sent in token order instead of expert order (dp 2 x ep 2 differs; the
fast block test: every output element); its rows padded at the wrong block offsets (the fast
block test); its blocks gathered by rows under SP (tp 2 + SP differs).

The gaps seen are float32 rounding, not a layout's error: Ernie 4.5 in float64 (experts run
eagerly: grouped_mm takes no float64) under tp 2 equals one process exactly over 10 steps of
this AdamW, its step-1 gradients included, and under cp 2 within 3.5e-8 in the loss (its router
is float32 by transformers' own code, so its gradient is a float32 sum over each rank's tokens).
In float32, AdamW's first step moves each element by lr g / (|g| + 1e-8): one element of layer
1's k_proj has a gradient of -8.8e-9 on the first batch (float64; the next smallest: 7.7e-5),
below float32's rounding of its sum, so its float32 value is rounding in size and sign and its
first step differs from one process's by 7.7e-3 under tp 2 (5.2e-3 under cp 2), every other
element by at most 3e-8; the loss then differs by 5e-5 at step 2 and at most 2.9e-4 over 10
steps, within LOSS_ABS.

The fast test beside: Llama 4's MoE block with its experts run by the block dispatch equals
transformers' block, forward and gradients, in float64.
"""
from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
from tolerances import LOSS_ABS, NORM_REL

from trainmesh.testing import run_distributed

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

STEPS, GLOBAL_BATCH, VOCAB, SEQ = 2, 4, 64, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
              bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
PP2 = {"pp": 2, "microbatches": 2}
DENSE = {"cohere": ("CohereConfig", "CohereForCausalLM"), "glm4": ("Glm4Config", "Glm4ForCausalLM"),
         "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM"),
         "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM"),
         "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
TP2, TP2_SP, CP2 = {"tp": 2}, {"tp": 2, "sequence_parallel": True}, {"cp": 2}
DENSE_AXES = {"tp2": TP2, "tp2-sp": TP2_SP, "pp2": PP2, "cp2": CP2,
              "dp2-zero3-selective": {"dp": 2, "zero": 3, "recompute": "selective"}}
MOE_AXES = {"dp2-ep2": {"dp": 2, "ep": 2}, "tp2": TP2, "tp2-sp": TP2_SP, "pp2": PP2, "cp2": CP2,
            "dp2-zero3": {"dp": 2, "zero": 3}}
DENSE_FAMILIES = ("olmo2", "olmo3", "stablelm", "gemma3_text", "cohere", "glm4", "starcoder2",
                  "seed_oss")
MOE_FAMILIES = ("ernie4_5_moe", "granitemoe", "llama4", "dots1", "phimoe", "glm4_moe")
CASES = {**{f"{kind} {axis}": (kind, layout) for kind in DENSE_FAMILIES
            for axis, layout in DENSE_AXES.items()},
         **{f"{kind} {axis}": (kind, layout) for kind in MOE_FAMILIES
            for axis, layout in MOE_AXES.items()},
         "olmoe pp2": ("olmoe", PP2), "olmoe tp2-sp": ("olmoe", TP2_SP)}


def family_model(kind: str) -> torch.nn.Module:
    """A tiny random ``kind`` (matrices at std 0.2: attention far from uniform)."""
    from helpers import widened       # here: the workers import this module, not helpers
    torch.manual_seed(0)
    if kind == "olmo2":
        model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**COMMON))
    elif kind == "olmo3":
        model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
            **COMMON, sliding_window=8, layer_types=["sliding_attention", "full_attention"]))
    elif kind == "ernie4_5_moe":
        model = transformers.Ernie4_5_MoeForCausalLM(transformers.Ernie4_5_MoeConfig(
            **COMMON, moe_num_experts=4, moe_k=2, moe_intermediate_size=16,
            moe_num_shared_experts=1, moe_layer_start_index=0))
    elif kind == "stablelm":
        model = transformers.StableLmForCausalLM(transformers.StableLmConfig(**COMMON))
    elif kind == "granitemoe":
        model = transformers.GraniteMoeForCausalLM(transformers.GraniteMoeConfig(**COMMON, **MOE))
    elif kind == "phimoe":
        model = transformers.PhimoeForCausalLM(transformers.PhimoeConfig(
            **COMMON, **MOE, router_jitter_noise=0.0))
    elif kind == "llama4":
        model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
            **COMMON, num_local_experts=4, intermediate_size_mlp=64, head_dim=8))
    elif kind == "olmoe":
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **{**COMMON, "intermediate_size": 16}, num_experts=4, num_experts_per_tok=2))
    elif kind in DENSE:
        config_cls, model_cls = DENSE[kind]
        extra = {"attention_dropout": 0.0} if kind == "seed_oss" else {}
        extra |= {"head_dim": 8, "sliding_window": 8} if kind == "gemma3_text" else {}
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra))
    elif kind in ("dots1", "glm4_moe"):
        config_cls, model_cls = {"dots1": ("Dots1Config", "Dots1ForCausalLM"),
                                 "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM")}[kind]
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(
            **COMMON, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1))
    else:
        raise ValueError(kind)
    return widened(model)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    from helpers import saved_models
    kinds = sorted({kind for kind, _ in CASES.values()})
    return saved_models(tmp_path_factory, "hubfamilies", family_model, kinds)


def _batch(step: int, dp_rank: int = 0, dp: int = 1) -> dict[str, torch.Tensor]:
    from trainmesh.data.corpus import SyntheticCorpus, dp_slice
    return dp_slice(SyntheticCorpus(VOCAB, SEQ).batch(0, step, GLOBAL_BATCH), dp_rank, dp)


def _train(directory: str, layout: dict, mesh=None) -> list[tuple[float, float]]:
    import trainmesh as tm
    engine = tm.Engine(tm.from_pretrained(directory), lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                       tm.causal_lm_loss, tm.ParallelConfig(**layout), mesh=mesh)
    dp_rank, dp = engine.mesh.index("dp"), engine.mesh.size("dp")
    return [(engine.train_step(_batch(k, dp_rank, dp)), engine.last["grad_norm"])
            for k in range(STEPS)]


def _rank(dirs: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (kind, layout) in CASES.items():
        try:
            out[name] = _train(dirs[kind], layout)
        except Exception:
            out[name] = "FAILED\n" + traceback.format_exc()
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hub_families_equal_one_process(dirs):
    from trainmesh import ParallelMesh
    results = run_distributed(_rank, 2, dirs, timeout_s=300)
    wants = {kind: _train(dirs[kind], {}, mesh=ParallelMesh(local=True))
             for kind in {kind for kind, _ in CASES.values()}}
    for name, (kind, _) in CASES.items():
        want = wants[kind]
        assert min(norm for _, norm in want) > 0.1, f"{kind}: the reference does not train {want}"
        for rank, res in results.items():
            run = res[name]
            assert not isinstance(run, str), f"rank {rank} {name}: {run[-2500:]}"
            for k, ((loss, norm), (w_loss, w_norm)) in enumerate(zip(run, want)):
                what = f"rank {rank} {name} step {k + 1}"
                assert abs(loss - w_loss) <= LOSS_ABS, f"{what}: loss {loss} vs one process {w_loss}"
                assert abs(norm - w_norm) <= NORM_REL * w_norm, \
                    f"{what}: grad_norm {norm} vs one process {w_norm}"


def test_preflight_lets_the_fixed_families_launch(dirs, no_launch, capsys):
    """`trainmesh train --model-dir` passes each case's layout before any worker (Ernie 4.5's
    experts counted from config.json's moe_num_experts: it was told it has none)."""
    from helpers import LAUNCHED

    from trainmesh.cli import main
    def flags(key: str, value: Any) -> list[str]:
        flag = "--" + key.replace("_", "-")
        return [flag] if value is True else [flag, str(value)]
    for name, (kind, layout) in CASES.items():
        args = ["train", "--model-dir", dirs[kind], "--seq-len", str(SEQ), "--global-batch", "4",
                "--steps", "2", *[f for key, value in layout.items() for f in flags(key, value)]]
        assert main(args) == LAUNCHED, (name, capsys.readouterr().err)
    assert len(no_launch) == len(CASES)


def test_llama4_blocks_are_computed_from_their_chosen_rows():
    """Llama 4's MoE block with its experts run by BlockDispatch (an exchange that keeps every
    expert here) equals the block as transformers runs it, forward and every gradient, float64,
    two experts per token: the zero rows of the experts a token did not choose contribute
    nothing, and the padding to one block width changes no row."""
    from trainmesh.expert_parallel.hf_blocks import BlockDispatch
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                           intermediate_size_mlp=64, head_dim=8)
    block = transformers.models.llama4.modeling_llama4.Llama4TextMoe(config).double()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    x = torch.randn(2, 8, 32, dtype=torch.float64, requires_grad=True)

    def run() -> tuple[torch.Tensor, ...]:
        out = block(x)[0]
        out.pow(2).sum().backward()
        grads = (x.grad.clone(), *(p.grad.clone() for p in block.parameters()))
        x.grad = None
        block.zero_grad(set_to_none=True)
        return (out.detach(), *grads)

    want = run()
    exchange = lambda rows, counts, compute: (compute(rows, counts.tolist()), rows.shape[0])
    block.experts.forward = BlockDispatch(block.experts.forward, exchange, 4, 4, 0, lambda: None)
    for got, expected in zip(run(), want):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
