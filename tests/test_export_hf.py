"""From trainmesh back to Hugging Face: tied aliases in full weights, ``checkpoint export-hf``.

- (A ``--model-dir`` Qwen2 at dp 2 ZeRO-3 and a tied GPT-2 at tp 2, their consolidation and
  export: in test_hf_families' launch.)
- The built-in GPT exports as GPT-2 and gives the same logits; a model of one's own is refused.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, SEQ = 64, 16
LOGITS_ABS = 1e-4
"""The exported model's logits vs the same weights in the model that wrote them: identical
arithmetic up to kernel choice (the GPT's fused SDPA vs GPT-2's eager attention, Conv1D's addmm
vs F.linear): float32 rounding of sums of ~32-64 terms of magnitude ~1 is ~1e-6, x100 headroom.
A mis-transposed or mis-fused projection changes logits by ~1e-1."""


def _loaded(directory: str):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    return model.eval(), {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys")}


def _ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


def test_builtin_gpt_exports_as_gpt2_and_others_are_refused(tmp_path):
    import trainmesh as tm
    from trainmesh import ConfigError, ParallelMesh
    from trainmesh.checkpoint.export_hf import export_hf
    from trainmesh.models.gpt import GPT, GPTConfig
    gcfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layers=2, n_heads=4)
    engine = tm.Engine(GPT(gcfg, seed=0), lambda ps: torch.optim.SGD(ps, lr=0.5),
                       lambda m, b: m(b["input_ids"], b["labels"]), tm.ParallelConfig(),
                       mesh=ParallelMesh(local=True))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():       # weights of size ~0.3, not ~0.02: attention far from uniform,
        for p in engine.module.parameters():          # so a swapped q/k shows in the logits
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ids = _ids()
    engine.train_step({"input_ids": ids, "labels": ids})
    engine.save(str(tmp_path / "ckpt"), {"run": {"heads": gcfg.n_heads}})
    model, info = _loaded(str(export_hf(tmp_path / "ckpt", tmp_path / "hf")))
    assert info == {"missing_keys": [], "unexpected_keys": []}, info
    with torch.no_grad():
        want = engine.module(ids)                                   # (b, s, vocab) logits
        assert float((model(ids).logits - want).abs().max()) <= LOGITS_ABS
    own = tm.Engine(torch.nn.Linear(4, 4), lambda ps: torch.optim.SGD(ps, lr=0.1),
                    lambda m, b: m(b).sum(), tm.ParallelConfig(), mesh=ParallelMesh(local=True))
    own.save(str(tmp_path / "own"))
    with pytest.raises(ConfigError, match="not a Hugging Face model") as err:
        export_hf(tmp_path / "own", tmp_path / "own-hf")
    assert err.value.field == "DIR"
    assert not Path(tmp_path / "own-hf").exists()


def test_export_hf_bad_input_exits_2(tmp_path, capsys):
    from trainmesh.cli import main
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("taken")
    for args, field in (([str(tmp_path / "none"), str(tmp_path / "out")], "DIR"),
                        ([str(tmp_path), str(tmp_path / "full")], "OUTDIR")):
        assert main(["checkpoint", "export-hf", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{field}:" in err[0] and "Traceback" not in err[0], err
