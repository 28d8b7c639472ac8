"""OLMoE, DeepSeek-V3 and GPT-OSS mixtures of experts under ep and tp, from their declared plans.

One world-2 launch of the Python API runs each family twice — ``dp 2 x ep 2`` (their
``base_model_ep_plan``: stacked experts split on the expert dimension, tokens dispatched by
all-to-all) and ``tp 2`` (their ``base_model_tp_plan``) — for STEPS AdamW steps, against the one
process run in the pytest process (loss within LOSS_ABS, grad norm within NORM_REL, and the
router aux loss, where the config asks for it, within LOSS_ABS). What each family brings:
OLMoE attention whose q/k norms need the whole projection (``colwise_gather_output``, its
q_proj as wide as two expert halves: hidden = 2 x intermediate, as the published model);
DeepSeek-V3 a first dense layer, shared experts (dense under ep, split by their own colwise /
rowwise styles under tp) and grouped sigmoid routing with a correction bias; GPT-OSS expert
biases (``grouped_gemm`` too), attention sinks, transposed experts with interleaved gate/up, and
a plan that splits only the embedding under tp. OLMoE and GPT-OSS train with their router's aux
loss (``output_router_logits``).

Planted bugs this module catches (each seen failing with an assertion): OLMoE's q_proj read as
a fused gate/up pair under tp (the rank reports its error); DeepSeek-V3's MoE block given
``parallel_input`` because it holds split shared experts, so its router's input gradient is
summed tp times (tp 2: grad norm 3.823 vs 3.811 at step 1); DeepSeek-V3's shared experts placed
as routed experts, reduced over edp (ep: loss off by 6.4e-3 at step 2).
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

STEPS, GLOBAL_BATCH, VOCAB, SEQ = 3, 4, 64, 16
KINDS = ("olmoe", "deepseek_v3", "gpt_oss")
LAYOUTS = {"dp2 ep2": {"dp": 2, "ep": 2}, "tp2": {"tp": 2}}
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
              pad_token_id=0, tie_word_embeddings=False, num_experts_per_tok=2)
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.05)


def family_model(kind: str) -> torch.nn.Module:
    """A tiny random ``kind``, the same on every rank; matrices at std 0.2 so that each
    expert's output shows in the loss."""
    from helpers import widened       # here: the workers import this module, not helpers
    torch.manual_seed(0)
    if kind == "olmoe":
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **COMMON, **AUX, intermediate_size=16, num_experts=4))
    elif kind == "deepseek_v3":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **COMMON, intermediate_size=48, moe_intermediate_size=8, n_routed_experts=4,
            n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8))
        with torch.no_grad():                          # a correction bias that changes the choice
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    else:
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **COMMON, **AUX, intermediate_size=16, num_local_experts=4, head_dim=8,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"]))
    return widened(model)


def _batch(step: int, dp_rank: int = 0, dp: int = 1) -> dict[str, torch.Tensor]:
    from trainmesh.data.corpus import SyntheticCorpus, dp_slice
    return dp_slice(SyntheticCorpus(VOCAB, SEQ).batch(0, step, GLOBAL_BATCH), dp_rank, dp)


def _train(kind: str, layout: dict, mesh=None) -> dict[str, list]:
    import trainmesh as tm
    engine = tm.Engine(family_model(kind), lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                       tm.causal_lm_loss, tm.ParallelConfig(**layout), mesh=mesh)
    dp_rank, dp = engine.mesh.index("dp"), engine.mesh.size("dp")
    out: dict[str, list] = {"loss": [], "grad_norm": [], "aux": []}
    for k in range(STEPS):
        out["loss"].append(engine.train_step(_batch(k, dp_rank, dp)))
        out["grad_norm"].append(engine.last["grad_norm"])
        out["aux"].append(engine.last.get("moe", {}).get("aux_loss"))
    return out


def _rank() -> dict[str, Any]:
    out = {}
    for kind in KINDS:
        for name, layout in LAYOUTS.items():
            try:
                out[f"{kind} {name}"] = _train(kind, layout)
            except Exception:
                out[f"{kind} {name}"] = "FAILED\n" + traceback.format_exc()
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_moe_families_under_ep_and_tp_equal_one_process():
    from trainmesh import ParallelMesh
    results = run_distributed(_rank, 2, timeout_s=300)
    for kind in KINDS:
        want = _train(kind, {}, mesh=ParallelMesh(local=True))
        assert want["loss"][0] - want["loss"][-1] > 0.05, f"{kind}: the reference does not learn"
        assert (want["aux"][0] is not None) == (kind != "deepseek_v3"), want["aux"]
        for rank, res in results.items():
            for name in LAYOUTS:
                run = res[f"{kind} {name}"]
                assert not isinstance(run, str), f"rank {rank} {kind} {name}: {run}"
                for k in range(STEPS):
                    what = f"rank {rank} {kind} {name} step {k + 1}"
                    assert abs(run["loss"][k] - want["loss"][k]) <= LOSS_ABS, \
                        f"{what}: loss {run['loss'][k]} vs one process {want['loss'][k]}"
                    assert abs(run["grad_norm"][k] - want["grad_norm"][k]) <= NORM_REL * want["grad_norm"][k], \
                        f"{what}: grad_norm {run['grad_norm'][k]} vs one process {want['grad_norm'][k]}"
                    if want["aux"][k] is not None:
                        assert abs(run["aux"][k] - want["aux"][k]) <= LOSS_ABS, \
                            f"{what}: router aux {run['aux'][k]} vs one process {want['aux'][k]}"
