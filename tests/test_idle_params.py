"""A parameter with no gradient in a step is left as torch.optim leaves it in one process, at
every ZeRO stage, with offload, and for MoE experts no token was routed to (docs/ZERO.md).

In one process (``ParallelMesh(local=True)``, so ZeRO's flat shards with one rank): a model
whose branch sits some steps out trains at ZeRO 1, 2, 3 (and offloaded to the CPU and to files)
exactly as a plain torch.optim loop, bit for bit — weights and every optimizer state, each
parameter's own step count included — for AdamW with weight decay and for optimizers with other
per-parameter scalars (NAdam's ``mu_product``, ASGD's ``eta``/``mu``, Adagrad's initial
accumulator, Rprop's step sizes, SGD's momentum born from the first gradient); its per-parameter
state survives a checkpoint from one stage into another. The built-in MoE does not run an expert
no row reached (its gradient is None). Multi-process (slow, one launch of 2): the MoE GPT through
the Python API at dp 2 ZeRO 1-3 and dp 2 x ep 2 ZeRO 1/3, AdamW, an expert silenced for one step
on every rank: its weights and moments are untouched by that step and the run ends where the
one-process run ends; silenced on one rank only (still used: reduced), every layout ends where
DDP ends, with the ranks' collectives checked to match.

Planted and seen failing with an assertion (docs: tests/tolerances.py): an idle parameter's step
count advanced with the shard's (test_zero_steps_..., step count 4.0 vs 3.0); idle elements
stepped with a zero gradient (weights off by ~1e-3: weight decay); the MoE running an expert on
zero rows (its gradient zeros, not None); a group every parameter of which is idle stepped whole
(test_a_group_every_..., "AssertionError: (1, 0.035072699189186096, 0.00951012596487999)").
"""
from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch
from torch import nn

from trainmesh import Engine, ParallelConfig, ParallelMesh
from trainmesh.data_parallel.readiness import reached
from trainmesh.testing import run_distributed

STEPS_USED = [True, False, True, False, False, True, True]
"""Whether each step uses ``Branchy.b``: it sits steps 1, 3 and 4 out."""
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, initial_accumulator_value=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.5, weight_decay=0.1),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
}


class Branchy(nn.Module):
    """``b`` only on the steps that ask for it; ``c`` after both."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.a(x)
        if use_b:
            y = y + self.b(x)
        return self.c(y).pow(2).mean()


def _x(k: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(k))


def _reference(make_opt, steps: list[bool]) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Branchy()
    opt = make_opt(model.parameters())
    for k, use in enumerate(steps):
        model(_x(k), use).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _states_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    return {n: dict(opt.state[p]) for n, p in model.named_parameters() if opt.state.get(p)}


def _differences(want_model: nn.Module, want_states: dict, engine: Engine) -> tuple[float, float]:
    """(largest weight difference, largest optimizer-state difference); the state keys must match."""
    full = engine.full_state_dict()
    _, states = engine.grad_sync.logical_state()
    assert sorted(states) == sorted(want_states), (sorted(states), sorted(want_states))
    weights = max(float((full[n] - p.detach()).abs().max()) for n, p in want_model.named_parameters())
    worst = 0.0
    for n, st in want_states.items():
        assert sorted(states[n]) == sorted(st), (n, sorted(states[n]), sorted(st))
        for k, v in st.items():
            worst = max(worst, float((states[n][k].double() - v.double()).abs().max()))
    return weights, worst


def _engine(zero: int, make_opt, offload: str = "none") -> Engine:
    # tiny buckets: shards cut through parameters, several buckets per group
    return Engine(Branchy(), make_opt, lambda m, b: m(*b),
                  ParallelConfig(zero=zero, offload=offload, bucket_mb=1e-4, find_unused_parameters=True),
                  mesh=ParallelMesh(local=True))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_zero_steps_each_parameter_as_torch_optim(name):
    """Bugs: an idle parameter's step count advanced with the shard's; its elements stepped
    with a zero gradient (weight decay, moment decay); its states born at the shard's first
    step (Adagrad's accumulator, SGD's momentum, Rprop's step sizes start otherwise)."""
    make_opt = OPTIMIZERS[name]
    model, opt = _reference(make_opt, STEPS_USED)
    want = _states_of(model, opt)
    # every path with AdamW; the other optimizers' scalars through the one step code, at ZeRO-2
    layouts = [(1, "none"), (2, "none"), (3, "none"), (1, "cpu"), (3, "cpu"), (2, "nvme")]
    for zero, offload in layouts if name == "adamw" else [(2, "none")]:
        engine = _engine(zero, make_opt, offload)
        for k, use in enumerate(STEPS_USED):
            engine.train_step((_x(k), use))
        weights, states = _differences(model, want, engine)
        # the same element-wise arithmetic on the same values: bit for bit
        assert weights == 0.0 and states == 0.0, (name, zero, offload, weights, states)


def test_never_stepped_parameter_has_no_state_and_resumes_across_stages():
    """A parameter no step has used yet has no optimizer state (as in torch.optim: a DDP
    resume would otherwise find moments without a step count); per-parameter step counts go
    through the logical state from ZeRO-1 into ZeRO-3 and the run continues as one process."""
    make_opt = OPTIMIZERS["adamw"]
    first = _engine(1, make_opt)
    for k in range(2):
        first.train_step((_x(k), False))
    _, states = first.grad_sync.logical_state()
    assert "b.weight" not in states and float(states["a.weight"]["step"]) == 2.0, states.get("b.weight")
    for k in range(2, 5):
        first.train_step((_x(k), STEPS_USED[k]))
    params, states = first.grad_sync.logical_state()
    assert float(states["b.weight"]["step"]) == 1.0 and float(states["a.weight"]["step"]) == 5.0
    second = _engine(3, make_opt)
    second.grad_sync.load_logical_state(params, states)
    for k in range(5, 7):
        second.train_step((_x(k), STEPS_USED[k]))
    model, opt = _reference(make_opt, [False, False, *STEPS_USED[2:]])
    weights, worst = _differences(model, _states_of(model, opt), second)
    assert weights == 0.0 and worst == 0.0, (weights, worst)


def test_a_group_every_parameter_of_which_sits_out_takes_no_step():
    """An optimizer group none of whose parameters has a gradient this step takes no step, as
    torch.optim leaves it: ``b`` in a group of its own (as the experts' strategy's shard holds
    only a rank's experts, all idle in a step where its ep group routed them no row). Bug: the
    group's empty plan taken for the usual step of whole shards, so it was stepped with zero
    gradients (moment decay, weight decay)."""
    make_opt = OPTIMIZERS["adamw"]
    model = Branchy()
    opt = make_opt([{"params": [p for n, p in model.named_parameters() if not n.startswith("b.")]},
                    {"params": list(model.b.parameters()), "lr": 2e-2}])
    for k, use in enumerate(STEPS_USED):
        model(_x(k), use).backward()
        opt.step()
        opt.zero_grad()
    for zero in (1, 2, 3):
        engine = Engine(Branchy(), make_opt, lambda m, b: m(*b),
                        ParallelConfig(zero=zero, bucket_mb=1e-4, find_unused_parameters=True),
                        mesh=ParallelMesh(local=True),
                        param_groups=lambda n: {"lr": 2e-2} if n.startswith("b.") else {})
        for k, use in enumerate(STEPS_USED):
            engine.train_step((_x(k), use))
        weights, states = _differences(model, _states_of(model, opt), engine)
        assert weights == 0.0 and states == 0.0, (zero, weights, states)   # bit for bit


def test_reached_finds_the_parameters_a_backward_updates():
    model = Branchy()
    loss = model(_x(0), False)
    assert reached([loss]) == {id(p) for n, p in model.named_parameters() if not n.startswith("b.")}


def _moe_config(**kw: Any):
    from trainmesh.models.gpt import GPTConfig
    return GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_experts=4,
                     top_k=2, moe_every=1, moe_aux_loss=0.1, **kw)


IDLE = 1
"""The expert a silenced router never chooses."""


def _silence(model: nn.Module, when: dict) -> None:
    """Every MoE router of ``model`` gives expert IDLE a -inf logit while ``when["on"]``: no
    token goes there (its probability is exactly 0)."""
    from trainmesh.models.moe import MoE
    mask = torch.tensor([IDLE])

    def hook(_module, _args, out):
        return out.index_fill(-1, mask, float("-inf")) if when["on"] else None
    for m in model.modules():
        if isinstance(m, MoE):
            m.router.register_forward_hook(hook)


def test_moe_does_not_run_an_expert_without_rows():
    """Bug: the expert run on zero rows (its gradient zeros, not None: AdamW's weight decay and
    moment decay would move it, and its step count would advance)."""
    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.models.gpt import GPT
    model = GPT(_moe_config(), seed=3)
    when = {"on": True}
    _silence(model, when)
    loss_sum, _ = model(**SyntheticCorpus(64, 16).batch(5, 0, 4))
    loss_sum.backward()
    for name, p in model.named_parameters():
        idle = f"experts.{IDLE}." in name
        assert (p.grad is None) == idle, (name, p.grad is None)


# ============================================================== the MoE GPT over 2 ranks
LAYOUTS = {"zero1": dict(zero=1), "zero2": dict(zero=2), "zero3": dict(zero=3),
           "ep2-zero1": dict(ep=2, zero=1), "ep2-zero3": dict(ep=2, zero=3)}
MOE_STEPS = 4
MOE_ABS = 1e-6
"""Weights and optimizer states of a layout vs the reference after MOE_STEPS AdamW steps. The
model is float64 (no routing decision flips between layouts) but its cross-entropy is float32,
so each gradient element carries ~1e-10 of rounding, which AdamW (lr 1e-2) turns into at most
lr x 1e-10 / eps = 1e-8 per step with eps = 1e-4 (x25 headroom over 4 steps). A stepped idle
expert moves by lr x wd x |w| ~ 2e-5 per step and its step count by 1."""


def _moe_runs() -> dict:
    """Rank 0 and 1 train the MoE GPT on halves of the global batch under each layout, AdamW
    with weight decay. ``global``: the router skips expert IDLE at step 2 on both ranks (each
    layout vs one process, and the expert's logical state before and after that step);
    ``one_rank``: only rank 0's router skips it, at steps 1 and 2 (each layout vs DDP)."""
    from trainmesh.comm.check import CHECK_ENV
    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.models.gpt import GPT
    os.environ[CHECK_ENV] = "1"                 # the ranks compare their collectives every step
    rank = torch.distributed.get_rank()
    corpus = SyntheticCorpus(64, 16)

    def train(cfg: ParallelConfig, mesh, silent_on: set[int], ranks: set[int]):
        when = {"on": False}
        model = GPT(_moe_config(), seed=3).double()   # float64: no routing tie flips between layouts
        _silence(model, when)
        engine = Engine(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, eps=1e-4),
                        lambda m, b: m(**b), cfg, mesh=mesh)
        around = []
        for k in range(MOE_STEPS):
            batch = corpus.batch(5, k, 8)
            if mesh is None:
                batch = {key: v[4 * rank : 4 * rank + 4] for key, v in batch.items()}
            when["on"] = k in silent_on and (mesh is not None or rank in ranks)
            if k == 2:
                around.append(_expert_state(engine))
            engine.train_step(batch)
            if k == 2:
                around.append(_expert_state(engine))
        params, states = engine.grad_sync.logical_state()   # under ep: this rank's experts
        return {**params, **{f"{n}/{k}": v for n, st in states.items() for k, v in st.items()}}, around

    out: dict[str, Any] = {}
    try:
        ref = None
        if rank == 0:
            ref, _ = train(ParallelConfig(), ParallelMesh(local=True), {2}, {0, 1})
        for label, kw in LAYOUTS.items():
            got, around = train(ParallelConfig(dp=2, timeout_s=30, **kw), None, {2}, {0, 1})
            out[f"global/{label}"] = {"untouched": around[0] == around[1],
                                      "err": _diff(got, ref) if ref is not None else None}
        ddp, _ = train(ParallelConfig(dp=2, timeout_s=30), None, {1, 2}, {0})
        for label in ("zero2", "zero3", "ep2-zero3"):   # a mismatched collective: error in 30 s
            got, _ = train(ParallelConfig(dp=2, timeout_s=30, **LAYOUTS[label]), None, {1, 2}, {0})
            out[f"one_rank/{label}"] = {"err": _diff(got, ddp)}
    except Exception:
        out["error"] = traceback.format_exc()
    return out


def _expert_state(engine: Engine) -> dict[str, list[float]]:
    """Expert IDLE's logical parameters and optimizer states (a collective), as lists."""
    params, states = engine.grad_sync.logical_state()
    mine = {n: t for n, t in params.items() if f"experts.{IDLE}." in n}
    mine.update({f"{n}/{k}": v for n, st in states.items() if f"experts.{IDLE}." in n for k, v in st.items()})
    return {n: t.reshape(-1).tolist() for n, t in sorted(mine.items())}


def _diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest difference over what ``got`` holds (under ep: this rank's experts only)."""
    assert set(got) <= set(want) and len(got) > len(want) // 2, sorted(set(got) - set(want))[:4]
    return max(float((got[k].double() - want[k].double()).abs().max()) for k in got)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_moe_idle_expert_untouched_in_every_layout():
    """Bugs: an expert with no token stepped (weight decay moves its weights, its moments decay,
    its step count advances) at some stage; an expert idle on one rank only skipped (it was
    used: reduced as DDP reduces it); ranks reducing an expert's ZeRO-3 unit in different orders
    (the collective check names the step)."""
    res = run_distributed(_moe_runs, 2, timeout_s=280)
    for rank, r in res.items():
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        for label in LAYOUTS:
            g = r[f"global/{label}"]
            assert g["untouched"], f"rank {rank} {label}: the idle expert changed in its idle step"
            if rank == 0:
                assert g["err"] <= MOE_ABS, f"{label}: off the one-process run by {g['err']}"
        for label in ("zero2", "zero3", "ep2-zero3"):
            err = r[f"one_rank/{label}"]["err"]
            assert err <= MOE_ABS, f"rank {rank} {label}: off DDP by {err}"
