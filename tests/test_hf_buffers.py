"""A hub model's persistent buffers take the values its weights files hold, as transformers'
``from_pretrained`` gives them.

DeepSeek-V3 (GLM-4-MoE, dots1 alike) saves its router's ``e_score_correction_bias``, a
persistent buffer, with its weights: trained values that choose the experts. The model here is
a tiny DeepSeek-V3 whose bias makes each token's group and experts in the MoE layer other than
its scores alone would (expert 0 and 1 always, by a margin of 1 that no sigmoid score bridges),
saved with ``save_pretrained``. Through ``tm.from_pretrained`` (the Python API) and through the
model ``trainmesh train --model-dir`` builds, the buffer equals the one
``AutoModelForCausalLM.from_pretrained`` loads; the engine's first-step loss (one process)
equals that model's loss on the same batch within LOSS_FP32, while the same model with the
bias at its init (zeros) is further than 10 x LOSS_FP32 from it (so the comparison can fail).
A file whose buffer has another shape is refused before any worker starts, naming
``--model-dir`` and the buffer.
`trainmesh checkpoint export-hf` of a checkpoint taken after a training step (dp 1, in
process) writes the buffer back with the file's value, and the model ``from_pretrained`` loads
from the export gives the trained model's logits. The same of a checkpoint two processes of
``trainmesh train --model-dir`` saved after one step at dp 2 ZeRO-3 and at pp 2 (the buffer on
the second stage only): the bias written with the file's value, no missing or unexpected key.

Planted bugs this module catches (each seen failing with an assertion): the buffers not loaded (the
model keeps its init) fails test_persistent_buffers_take_the_files_values with
"model.layers.1.mlp.gate.e_score_correction_bias: tensor([0., 0., 0., 0.]) vs the file's
tensor([ 1.0000,  0.5000, -1.0000, -0.5000])". The export leaving the buffer out fails
test_export_hf_writes_the_buffers_back with "AssertionError: export-hf wrote no
model.layers.1.mlp.gate.e_score_correction_bias" (and from_pretrained names it missing); the
export writing it at zeros with "(tensor([0., 0., -0., -0.]), tensor([ 1.0000,  0.5000,
-1.0000, -0.5000]))", the logits then 3.9 off. The checkpoint leaving out the persistent
buffers of every pipeline stage but the first fails the pp 2 case of
test_a_multi_process_checkpoint_exports_the_buffers with "AssertionError: export-hf wrote no
model.layers.1.mlp.gate.e_score_correction_bias".
"""
from __future__ import annotations

import pytest
import torch
from tolerances import fp32_atol

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, SEQ, BATCH = 64, 16, 4
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
LOSS_FP32 = 1e-4
"""The engine's forward and a plain forward of the same float32 model on the same batch: the
loss (about ln 64 = 4.2) is a mean of 64 terms, each reduction's rounding at most terms x 2^-24
relative: below 1e-5 per reduction, a few of them in sequence; 1e-4 leaves room."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from helpers import widened
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, intermediate_size=48,
        moe_intermediate_size=8, n_routed_experts=4, n_shared_experts=1, n_group=2,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False))
    widened(model)                          # each expert's output shows in the loss
    with torch.no_grad():
        model.get_buffer(BIAS).copy_(torch.tensor([1.0, 0.5, -1.0, -0.5]))
    path = tmp_path_factory.mktemp("deepseek") / "m"
    model.save_pretrained(path)
    return str(path)


def _batch() -> dict[str, torch.Tensor]:
    from trainmesh.data.corpus import SyntheticCorpus
    return SyntheticCorpus(VOCAB, SEQ).batch(0, 0, BATCH)


def _loss(model: torch.nn.Module) -> float:
    from trainmesh.engine.pretrained import causal_lm_loss
    with torch.no_grad():
        total, tokens = causal_lm_loss(model, _batch())
    return float(total / tokens)


def _first_step_loss(model: torch.nn.Module) -> float:
    import trainmesh as tm
    engine = tm.Engine(model, lambda ps: torch.optim.SGD(ps, lr=0.0), tm.causal_lm_loss,
                       tm.ParallelConfig(), mesh=tm.ParallelMesh(local=True))
    return engine.train_step(_batch())


def test_persistent_buffers_take_the_files_values(model_dir):
    import trainmesh as tm
    from helpers import train_config

    from trainmesh.run.trainer import build_model
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    want = ref.get_buffer(BIAS)
    assert want.abs().min() >= 0.5, want          # the file's, not an init's zeros
    api = tm.from_pretrained(model_dir)
    cli, _, _ = build_model(train_config(["--model-dir", model_dir, "--seq-len", str(SEQ)]))
    for what, model in (("from_pretrained", api), ("--model-dir", cli)):
        for name, b in ref.named_buffers():
            got = model.get_buffer(name)
            assert torch.equal(got, b), f"{what}: {name}: {got} vs the file's {b}"
    ref_loss = _loss(ref)
    with torch.no_grad():
        ref.get_buffer(BIAS).zero_()
    assert abs(_loss(ref) - ref_loss) > 10 * LOSS_FP32, "the bias does not change the loss"
    got = _first_step_loss(api)
    assert abs(got - ref_loss) <= LOSS_FP32, (got, ref_loss)


def test_a_buffer_of_another_shape_is_refused_naming_model_dir(model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from trainmesh.core.errors import ConfigError
    from trainmesh.engine.pretrained import check_model_dir
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    state = load_file(bad / "model.safetensors")
    state[BIAS] = torch.zeros(5)
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError) as err:
        check_model_dir(str(bad))
    assert err.value.field == "--model-dir" and BIAS in err.value.message, err.value
    assert "(5,)" in err.value.message and "(4,)" in err.value.message, err.value


def test_export_hf_writes_the_buffers_back(model_dir, tmp_path):
    """``checkpoint export-hf`` after a step at dp 1: the exported file holds the router's bias
    with the value the weights gave (the optimizer does not move a buffer), and the model
    ``from_pretrained`` loads from it gives the trained model's logits."""
    import trainmesh as tm
    saved = transformers.AutoModelForCausalLM.from_pretrained(model_dir).get_buffer(BIAS)
    engine = tm.Engine(tm.from_pretrained(model_dir), lambda ps: torch.optim.SGD(ps, lr=0.1),
                       tm.causal_lm_loss, tm.ParallelConfig(), mesh=tm.ParallelMesh(local=True))
    engine.train_step(_batch())
    engine.save(str(tmp_path / "ckpt"))
    model = _exported(tmp_path / "ckpt", tmp_path / "hf", saved)
    ids = _batch()["input_ids"]
    with torch.no_grad():
        want = engine.module(input_ids=ids).logits          # (batch, seq, vocab)
        got = model.eval()(input_ids=ids).logits
    # the same modules and weights: only another kernel's rounding of the logits' last sums
    # (hidden 32 terms) could differ; a router bias lost moves tokens to other experts (~1e-1)
    atol = fp32_atol(float(want.abs().max()), 32)
    assert float((got - want).abs().max()) <= atol, (float((got - want).abs().max()), atol)


def _exported(ckpt, out, saved: torch.Tensor) -> torch.nn.Module:
    """``export-hf`` of the checkpoint directory ``ckpt`` into ``out``: its file holds the
    router's bias equal to ``saved``, and ``from_pretrained`` of it reports no missing or
    unexpected key and holds the bias too; returns that model."""
    from safetensors import safe_open

    from trainmesh.checkpoint.export_hf import export_hf
    exported = export_hf(ckpt, out)
    with safe_open(str(exported / "model.safetensors"), "pt") as f:
        assert BIAS in f.keys(), f"export-hf wrote no {BIAS}"
        assert torch.equal(f.get_tensor(BIAS), saved), (f.get_tensor(BIAS), saved)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(exported), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(model.get_buffer(BIAS), saved), (model.get_buffer(BIAS), saved)
    return model


LAYOUTS = {"dp2-zero3": ["--dp", "2", "--zero", "3"], "pp2": ["--pp", "2", "--microbatches", "2"]}


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_multi_process_checkpoint_exports_the_buffers(model_dir, layout, tmp_path):
    """One step of ``trainmesh train --model-dir`` under dp 2 ZeRO-3 (the bias beside the
    parameters' shards, on both ranks) and under pp 2 (the bias on the second stage only: the
    first holds the dense layer 0), saved by both processes: ``export-hf`` of the checkpoint
    writes the bias with the file's value and from_pretrained loads the export whole."""
    from helpers import run_train
    saved = transformers.AutoModelForCausalLM.from_pretrained(model_dir).get_buffer(BIAS)
    ckpt = tmp_path / "ckpt"
    proc, _ = run_train(["--model-dir", model_dir, "--seq-len", str(SEQ), "--global-batch",
                         str(BATCH), "--steps", "1", *LAYOUTS[layout], "--save-dir", str(ckpt)],
                        tmp_path, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _exported(ckpt, tmp_path / "hf", saved)
