"""Hub families whose plans needed more than reading: each against one process, from its
directory as ``trainmesh train --model-dir`` builds it (``from_pretrained``: the plans it
declares, those inferred where it declares none).

One world-2 launch of the Python API runs every case below for STEPS AdamW steps against the one
process run in the pytest process (loss within LOSS_ABS, grad norm within NORM_REL):

- OLMo 2 and OLMo 3 under ``tp 2`` with sequence parallelism: their plan gathers q, k and v whole
  (``colwise_gather_output``, for their norms over every head), so the attention's input is
  gathered along the sequence before its own code reads the shape.
- Ernie 4.5 (MoE) under ``dp 2 x ep 2``: its config.json counts its experts as
  ``moe_num_experts``; its declared expert plan (``grouped_gemm``, ``ep_dispatch_experts``).

Planted bugs this module catches (each seen failing with an assertion): the gathered attention
not entered as one region under SP (the rank reports the rotary embedding's size mismatch).
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
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
              bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
CASES = {"olmo2 tp2-sp": ("olmo2", {"tp": 2, "sequence_parallel": True}),
         "olmo3 tp2-sp": ("olmo3", {"tp": 2, "sequence_parallel": True}),
         "ernie4_5_moe dp2-ep2": ("ernie4_5_moe", {"dp": 2, "ep": 2})}


def family_model(kind: str) -> torch.nn.Module:
    """A tiny random ``kind`` (matrices at std 0.2: attention far from uniform)."""
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
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hubfamilies")
    out = {}
    for kind in sorted({kind for kind, _ in CASES.values()}):
        family_model(kind).save_pretrained(str(root / kind))
        out[kind] = str(root / kind)
    return out


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
    flags = {"tp": ["--tp", "2"], "sequence_parallel": ["--sequence-parallel"],
             "dp": ["--dp", "2"], "ep": ["--ep", "2"]}
    for name, (kind, layout) in CASES.items():
        args = ["train", "--model-dir", dirs[kind], "--seq-len", str(SEQ), "--global-batch", "4",
                "--steps", "2", *[f for key in layout for f in flags[key]]]
        assert main(args) == LAUNCHED, (name, capsys.readouterr().err)
    assert len(no_launch) == len(CASES)
