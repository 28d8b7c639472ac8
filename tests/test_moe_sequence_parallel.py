"""MoE under sequence parallelism: an expert used by one TP rank's chunk of the tokens only is
used, and every rank of the TP group updates it as one process does.

Under ``--sequence-parallel`` each TP rank routes its own chunk of every sequence (its
contiguous ``s / tp`` positions), so an expert no token of one rank's chunk chose may be chosen
in another's. Its gradient is then partial over tp like any parameter that runs on chunks
(zero from the rank that did not use it) and summed over tp; whether it was used at all must be
agreed over tp too, or the rank that did not use it skips its update while the others take it:
the TP ranks' copies of the replicated expert then differ, each rank routing and computing with
its own, and the run leaves one process (seen with SGD at its default lr: loss 1e-3 off at step
5 after 5e-7 at step 4, where a layer's expert drew no token from TP rank 0's chunk).

One launch of 2 processes (the Python API): the float64 MoE GPT at tp 2 with sequence
parallelism (whole gradients, and ZeRO-3), plain SGD, its router silencing expert IDLE for the
first half of every sequence's positions (all of TP rank 0's chunk, none of rank 1's) at every
step, against the same model in one process with the same positions silenced: every MoE
parameter on both TP ranks ends where the one-process run ends.

Planted and seen failing with an assertion: the unused check agreed over the data-parallel group
only (engine/partial_grads.py's ``unused_reach`` returning ``across`` unchanged) fails with "AssertionError: rank
0 tp2-sp: blocks.0.mlp.experts.1.fc.weight off one process by 5.0e-04" (rank 0 is up to
9e-3 off in both layouts; rank 1, which used the expert, stays within 3.4e-10).
"""
from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch
from torch import nn

from trainmesh import Engine, ParallelConfig, ParallelMesh
from trainmesh.testing import run_distributed

SEQ = 16
IDLE = 1
"""The expert the router never chooses for the first half of a sequence's positions."""
LAYOUTS = {"tp2-sp": {}, "tp2-sp-zero3": {"zero": 3}}
"""At tp 2 with sequence parallelism: the whole gradients, and ZeRO-3's units and shards."""
STEPS = 3
LR = 0.1
TOL = 1e-8
"""MoE parameters of a TP rank vs the one-process run after STEPS SGD steps. The model is
float64 (no routing decision flips between the split and the whole sequence) but its
cross-entropy is float32 (vocabulary-parallel under tp): each logit's gradient carries float32's
relative rounding 6e-8, so a parameter's gradient is off by ~6e-8 x 2 x its scale (largest
element ~1e-2 here) ~ 1e-9, which SGD at lr 0.1 turns into 1e-10 per step, 3e-10 over 3 steps
(x30 headroom; seen 2.8e-10, 3.4e-10 at ZeRO-3). A skipped update of the expert leaves it
lr x |grad| off, ~5e-4 here (the planted failure)."""


def _config():
    from trainmesh.models.gpt import GPTConfig
    return GPTConfig(vocab_size=64, seq_len=SEQ, d_model=32, n_layers=2, n_heads=4, n_experts=4,
                     top_k=2, moe_every=1, moe_aux_loss=0.1)


def _silence_first_half(model: nn.Module, held: int) -> None:
    """Every MoE router of ``model`` gives expert IDLE a -inf logit on the tokens at positions
    0 .. SEQ/2 - 1 of every sequence, its tokens routed here ``held`` consecutive positions per
    sequence from position 0 (SEQ in one process; SEQ/2 on TP rank 0: all of them)."""
    from trainmesh.models.moe import MoE

    def hook(_module, _args, out):
        out = out.clone()
        out.view(-1, held, out.shape[-1])[:, : SEQ // 2, IDLE] = float("-inf")
        return out
    for m in model.modules():
        if isinstance(m, MoE):
            m.router.register_forward_hook(hook)


def _train(cfg: ParallelConfig, mesh: ParallelMesh | None, held: int | None
           ) -> dict[str, torch.Tensor]:
    """The MoE parameters after STEPS steps of ``cfg``, IDLE silenced on the first half of the
    positions where this rank routes ``held`` of them per sequence (None: not silenced)."""
    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.models.gpt import GPT
    model = GPT(_config(), seed=3).double()   # float64: no routing tie flips between layouts
    if held is not None:
        _silence_first_half(model, held)
    engine = Engine(model, lambda ps: torch.optim.SGD(ps, lr=LR), lambda m, b: m(**b), cfg,
                    mesh=mesh)
    corpus = SyntheticCorpus(64, SEQ)
    for k in range(STEPS):
        engine.train_step(corpus.batch(5, k, 8))
    params, _ = engine.grad_sync.logical_state()   # whole parameters at every ZeRO stage
    return {n: p.clone() for n, p in params.items() if ".mlp." in n}


def _runs() -> dict[str, Any]:
    """Rank 0 also trains the one-process reference; both ranks train at tp 2 with sequence
    parallelism, rank 0's router silencing IDLE on its whole chunk (the first half of every
    sequence), rank 1's on none of its tokens."""
    from trainmesh.comm.check import CHECK_ENV
    os.environ[CHECK_ENV] = "1"                 # the ranks compare their collectives every step
    rank = torch.distributed.get_rank()
    try:
        ref = _train(ParallelConfig(), ParallelMesh(local=True), SEQ) if rank == 0 else None
        held = SEQ // 2 if rank == 0 else None
        got = {label: _train(ParallelConfig(tp=2, sequence_parallel=True, timeout_s=30, **kw),
                             None, held) for label, kw in LAYOUTS.items()}
        return {"got": got, "ref": ref}
    except Exception:
        return {"error": traceback.format_exc()}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_expert_one_tp_rank_left_unused_is_updated_on_every_rank():
    """Bug: whether a parameter was used agreed over the data-parallel group only, so the TP
    rank whose chunk never chose the expert skipped its update (its copy left the others')."""
    res = run_distributed(_runs, 2, timeout_s=180)
    for rank, r in res.items():
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    ref = res[0]["ref"]
    assert any(f"experts.{IDLE}." in n for n in ref), sorted(ref)
    for rank, r in sorted(res.items()):
        for label, got in r["got"].items():
            assert set(got) == set(ref), (label, sorted(set(got) ^ set(ref)))
            for name, want in ref.items():
                err = float((got[name] - want).abs().max())
                assert err <= TOL, f"rank {rank} {label}: {name} off one process by {err:.1e}"
