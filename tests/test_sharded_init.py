"""Sharded initialisation: any slice of a parameter's initial value is built alone and equals
the slice of the whole; every layout's shards (TP slices, PP stages, ZeRO-3 flat shards) equal
the one-process model's; pretrained weights load slice by slice from safetensors into any
layout; a file of another shape is refused naming --init-from; and, end to end, no rank's
set-up peak comes near the whole model."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import run_train, steps, summary
from safetensors.torch import save_file

from trainmesh import Engine, ParallelConfig
from trainmesh.data.corpus import SyntheticCorpus, dp_slice
from trainmesh.engine.materialize import safetensors_init, slice_of
from trainmesh.models.gpt import GPT, GPTConfig
from trainmesh.models.init import init_value
from trainmesh.testing import run_distributed

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)


@pytest.mark.parametrize("name,shape,index", [
    ("blocks.0.mlp.fc.weight", (128, 32), (slice(64, 128),)),                 # TP colwise rows
    ("blocks.1.attn.proj.weight", (32, 32), (slice(None), slice(16, 32))),     # TP rowwise cols
    ("embed.wte.weight", (64, 32), (slice(5, 9), slice(3, 30))),
    ("blocks.0.ln1.weight", (32,), (slice(8, 24),)),
])
def test_a_slice_is_the_slice_of_the_whole(name, shape, index):
    whole = init_value(name, shape, seed=7, n_layers=2)
    part = init_value(name, shape, seed=7, n_layers=2, index=index)
    assert torch.equal(part, whole[index])
    assert not torch.equal(whole, init_value(name, shape, seed=8, n_layers=2)) or "ln" in name


def _shards_and_losses(layouts: list[dict], path: str) -> dict:
    """Per layout: each parameter this rank holds against the slice of the one-process model's
    (max |difference|), and three steps' losses, from the GPT's init and from ``path``."""
    rank = dist.get_rank()
    data = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    reference = dict(GPT(CFG, seed=3).named_parameters())
    out = {}
    for kw in layouts:
        for source in ("seed", "file"):
            init = safetensors_init(path) if source == "file" else None
            e = Engine(GPT(CFG, seed=3 if source == "seed" else 99, device="meta"),
                       lambda ps: torch.optim.SGD(ps, lr=0.1), lambda m, b: m(**b),
                       ParallelConfig(**kw), init_fn=init, device="cpu")
            err = 0.0
            if kw.get("zero") == 3:      # the consolidated flat shards
                whole = e.full_state_dict()
                err = max((whole[n] - reference[n]).abs().max().item() for n in reference)
            else:
                for name, p in e.module.named_parameters():
                    _, index = slice_of(p, e.placements.get(name))
                    err = max(err, (p.detach() - reference[name][index]).abs().max().item())
            dp = e.mesh.size("dp")
            losses = [e.train_step(dp_slice(data.batch(0, s, 8), e.mesh.index("dp"), dp))
                      for s in range(3)]
            out[str(kw), source] = {"err": err, "losses": losses, "rank": rank}
    return out


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_every_layout_starts_from_the_slices_of_one_process(tmp_path):
    path = str(tmp_path / "model.safetensors")
    save_file({n: p.detach().contiguous() for n, p in GPT(CFG, seed=3).named_parameters()}, path)
    one = _one_process_losses()
    layouts = [dict(tp=2), dict(pp=2, microbatches=2), dict(dp=2, zero=3), dict(dp=2, zero=1)]
    res = run_distributed(_shards_and_losses, 2, layouts, path, timeout_s=140)
    for rank, runs in res.items():
        for (layout, source), r in runs.items():
            assert r["err"] == 0.0, f"rank {rank} {layout} {source}: shard differs by {r['err']}"
            gap = max(abs(a - b) for a, b in zip(one, r["losses"]))
            assert gap <= 1e-3, f"rank {rank} {layout} {source}: losses {r['losses']} vs {one}"


def _one_process_losses() -> list[float]:
    from trainmesh import ParallelMesh
    data = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    e = Engine(GPT(CFG, seed=3), lambda ps: torch.optim.SGD(ps, lr=0.1), lambda m, b: m(**b),
               ParallelConfig(), mesh=ParallelMesh(local=True))
    return [e.train_step(data.batch(0, s, 8)) for s in range(3)]


def test_a_pretrained_file_of_another_shape_exits_2_naming_init_from(tmp_path, capsys):
    from trainmesh.cli import main
    small = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)
    path = str(tmp_path / "model.safetensors")
    save_file({n: p.detach().contiguous() for n, p in GPT(small).named_parameters()}, path)
    args = ["train", "--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "16",
            "--global-batch", "8", "--steps", "1"]
    assert main([*args, "--vocab-size", "128", "--init-from", path]) == 2
    line = capsys.readouterr().err.strip()
    assert "--init-from" in line and "embed.wte.weight" in line and len(line.splitlines()) == 1


# ---------------------------------------------------------------- set-up memory, end to end
# The same assertion as benchmarks/bench_init.py (the 200M-parameter GPT), on a ~26M model.
MODEL = ["--d-model", "512", "--heads", "8", "--seq-len", "16", "--vocab-size", "512",
         "--optimizer", "sgd", "--global-batch", "4", "--steps", "1", "--warmup-steps", "0",
         "--force"]
LAYERS = 8


RUNS = {"base": ["--layers", "1"], "one": [], "zero3": ["--dp", "4", "--zero", "3"],
        "tp2": ["--tp", "2"], "pp2": ["--pp", "2"]}


def init_peaks(tmp_path) -> dict:
    """{name: (init_peak_mem_bytes per rank, losses, params, planner's problems with the set-up
    peak)} of a 1-layer one-process run (the base footprint), the whole model in one process,
    and dp 4 zero 3, tp 2, pp 2."""
    from trainmesh.cli import build_parser
    from trainmesh.cli.train import collect
    from trainmesh.config.train import build_train_config
    from trainmesh.planner.predict import compare, predict_run
    out = {}
    for name, extra in RUNS.items():
        args = [*MODEL, "--layers", str(LAYERS), *extra]
        proc, records = run_train(args, tmp_path, name=name, timeout=170)
        assert proc.returncode == 0, proc.stderr
        s = summary(records)
        cfg = build_train_config(collect(build_parser().parse_args(["train", *args]), True))
        planned = [p for p in compare(predict_run(cfg), s) if "init_peak" in p]
        out[name] = ([r["init_peak_mem_bytes"] for r in s["ranks"]], [x["loss"] for x in steps(records)],
                     s["params"], planned)
    return out


def check_init_peaks(res: dict) -> None:
    """Every sharded rank's set-up peak < base footprint + 0.75 x the full fp32 model; the
    losses equal the one process's."""
    base = res["base"][0][0]
    full_model = 4 * res["one"][2]
    print({k: [f"{p / 1e6:.0f} MB" for p in v[0]] for k, v in res.items()})
    assert res["one"][0][0] >= base + 0.75 * full_model, "the unsharded run exceeds the bound"
    for name, (*_, planned) in res.items():
        assert not planned, planned     # `trainmesh plan` predicted each set-up peak (20%)
    for name in ("zero3", "tp2", "pp2"):
        peaks, losses, *_ = res[name]
        for rank, peak in enumerate(peaks):
            assert peak < base + 0.75 * full_model, \
                f"{name} rank {rank}: set-up peak {peak / 1e6:.0f} MB >= base {base / 1e6:.0f} MB " \
                f"+ 0.75 x {full_model / 1e6:.0f} MB"
        assert max(abs(a - b) for a, b in zip(losses, res["one"][1])) <= 1e-3, (name, losses)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_no_rank_materialises_the_whole_model(tmp_path):
    check_init_peaks(init_peaks(tmp_path))
