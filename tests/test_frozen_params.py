"""Frozen parameters (``requires_grad=False``) and buffers of a model built on the meta device:
materialised from the init function on every rank at every ZeRO stage, never synchronised nor
updated, saved in checkpoints and restored from them, and, under tensor parallelism, split like
a trainable weight. One launch at world 2 covers dp 2 with ZeRO 0-3 against plain one-process
PyTorch, a checkpoint round trip, a frozen TP-split GPT weight and the start broadcast of a
materialised model's frozen layer."""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from tolerances import LOSS_ABS, NORM_REL
from torch import nn

from trainmesh import Engine, ParallelConfig
from trainmesh.checkpoint.sharded import consolidate
from trainmesh.data.corpus import SyntheticCorpus
from trainmesh.engine.materialize import slice_of
from trainmesh.models.gpt import GPT, GPTConfig
from trainmesh.testing import run_distributed

STEPS = 4
FROZEN = ("0.weight", "0.bias")
GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)
GPT_FROZEN = "blocks.0.mlp.fc.weight"          # colwise under tp: each rank keeps half the rows


class Scale(nn.Module):
    """A buffer the forward uses (on meta until the init function gives it values)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def build() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(8, 16), Scale(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    model[0].requires_grad_(False)               # a frozen layer
    return model


def init(name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
    """Seeded by name: the same values on every rank and in the reference."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return (1.0 + 0.5 * torch.rand(shape, generator=g) if name.endswith("scale")
            else 0.5 * torch.randn(shape, generator=g))[index]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def loss_fn(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    return ((model(b[0]) - b[1]) ** 2).sum(), b[0].shape[0]


def adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)


def _stage(zero: int, root: str) -> dict:
    """dp 2 at ``zero``: losses, grad norms, the frozen tensors on this rank, the consolidated
    weights; at ZeRO 2 also a checkpoint round trip into an engine built from other values."""
    rank = dist.get_rank()
    with torch.device("meta"):
        model = build()
    e = Engine(model, adamw, loss_fn, ParallelConfig(dp=2, zero=zero), init_fn=init, device="cpu")
    x, y = batch()
    mine = (x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4])
    out: dict = {"losses": [], "norms": []}
    for _ in range(STEPS):
        out["losses"].append(e.train_step(mine))
        out["norms"].append(e.last["grad_norm"])
    named = dict(e.module.named_parameters())
    out["frozen"] = {n: named[n].detach().clone() for n in FROZEN}
    out["scale"] = e.module[1].scale.clone()
    out["full"] = e.full_state_dict()
    if zero == 2:
        e.save(root)
        other = Engine(build(), adamw, loss_fn, ParallelConfig(dp=2, zero=zero), device="cpu")
        other.load(root)
        out["reloaded"] = {n: p.detach().clone() for n, p in other.module.named_parameters()}
        out["next"] = (e.train_step(mine), other.train_step(mine))
    return out


def _gpt_tp2() -> dict:
    """tp 2: the frozen colwise weight is split, its placement recorded, its slice the
    one-process model's; two SGD steps' losses."""
    model = GPT(GPT_CFG, seed=3, device="meta")
    model.get_parameter(GPT_FROZEN).requires_grad_(False)
    e = Engine(model, lambda ps: torch.optim.SGD(ps, lr=0.1), lambda m, b: m(**b),
               ParallelConfig(tp=2), device="cpu")
    p = e.module.get_parameter(GPT_FROZEN)
    placement = e.placements.get(GPT_FROZEN)
    _, index = slice_of(p, placement)
    data = SyntheticCorpus(GPT_CFG.vocab_size, GPT_CFG.seq_len)
    losses = [e.train_step(data.batch(0, s, 4)) for s in range(2)]
    return {"shape": tuple(p.shape), "sharded": placement is not None and placement.sharded,
            "index": index, "value": p.detach().clone(), "losses": losses,
            "full": e.full_state_dict()[GPT_FROZEN]}


def _job(root: str) -> dict:
    out: dict = {}
    for zero in (0, 1, 2, 3):
        try:
            out[zero] = _stage(zero, root)
        except Exception as exc:           # reported as an assertion in the test, not a crash
            out[zero] = {"error": f"{type(exc).__name__}: {exc}"}
    out["tp"] = _gpt_tp2()
    torch.manual_seed(dist.get_rank())        # a materialised model: other values on each rank
    e = Engine(build(), adamw, loss_fn, ParallelConfig(dp=2), device="cpu")
    out["broadcast"] = {n: p.detach().clone() for n, p in e.module.named_parameters()}
    return out


def _reference() -> dict:
    """Plain PyTorch, one process, the whole batch."""
    model = build()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            t.copy_(init(name, tuple(t.shape), tuple(slice(None) for _ in t.shape)))
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    x, y = batch()
    losses, norms = [], []
    for _ in range(STEPS):
        loss_sum, count = loss_fn(model, (x, y))
        loss = loss_sum / count
        loss.backward()
        norms.append(float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()
                                          if p.grad is not None))))
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


def _gpt_reference() -> tuple[dict, list[float]]:
    model = GPT(GPT_CFG, seed=3)
    model.get_parameter(GPT_FROZEN).requires_grad_(False)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    data = SyntheticCorpus(GPT_CFG.vocab_size, GPT_CFG.seq_len)
    losses = []
    for s in range(2):
        loss_sum, count = model(**data.batch(0, s, 4))
        (loss_sum / count).backward()
        losses.append((loss_sum / count).item())
        opt.step()
        opt.zero_grad()
    return start, losses


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_frozen_layer_and_buffer_train_as_plain_pytorch_at_every_zero_stage(tmp_path):
    root = str(tmp_path / "ckpt")
    res = run_distributed(_job, 2, root, timeout_s=200)
    ref = _reference()
    start = {n: init(n, tuple(t.shape), tuple(slice(None) for _ in t.shape))
             for n, t in ref["state"].items()}
    for rank, runs in res.items():
        for zero in (0, 1, 2, 3):
            r = runs[zero]
            where = f"rank {rank} zero {zero}"
            assert "error" not in r, f"{where}: {r.get('error')}"
            for got, want in zip(r["losses"], ref["losses"]):
                assert abs(got - want) <= LOSS_ABS, f"{where}: losses {r['losses']} vs {ref['losses']}"
            for got, want in zip(r["norms"], ref["norms"]):
                assert abs(got - want) <= NORM_REL * want, f"{where}: norms {r['norms']} vs {ref['norms']}"
            for name in FROZEN:            # unchanged (no update, no weight decay), on every rank
                assert torch.equal(r["frozen"][name], start[name]), f"{where}: {name} changed"
                assert torch.equal(r["full"][name], start[name]), f"{where}: {name} consolidated"
            assert torch.equal(r["scale"], start["1.scale"]), f"{where}: buffer"
            assert torch.equal(r["full"]["1.scale"], start["1.scale"]), f"{where}: buffer consolidated"
            for name, want in ref["state"].items():
                err = (r["full"][name] - want).abs().max().item()
                assert err <= 10 * LOSS_ABS, f"{where}: {name} trained off by {err}"
        saved = runs[2]
        for name in FROZEN:                # restored over other initial values
            assert torch.equal(saved["reloaded"][name], start[name]), f"rank {rank}: {name} reloaded"
        assert saved["next"][0] == pytest.approx(saved["next"][1], abs=LOSS_ABS), saved["next"]
    for name in FROZEN:                    # from the DP root, as DDP does
        assert torch.equal(res[0]["broadcast"][name], res[1]["broadcast"][name]), f"{name} broadcast"
    weights = load_file(str(consolidate(root, tmp_path / "model.safetensors")))
    for name in FROZEN:
        assert torch.equal(weights[name], start[name]), f"consolidated checkpoint: {name}"

    gpt_start, gpt_losses = _gpt_reference()
    whole = gpt_start[GPT_FROZEN]
    for rank, runs in res.items():
        t = runs["tp"]
        assert t["sharded"] and t["shape"] == (whole.shape[0] // 2, whole.shape[1]), t["shape"]
        assert torch.equal(t["value"], whole[t["index"]]), f"rank {rank}: tp slice of {GPT_FROZEN}"
        assert torch.equal(t["full"], whole), f"rank {rank}: consolidated {GPT_FROZEN}"
        for got, want in zip(t["losses"], gpt_losses):
            assert abs(got - want) <= LOSS_ABS, f"rank {rank}: tp losses {t['losses']} vs {gpt_losses}"
