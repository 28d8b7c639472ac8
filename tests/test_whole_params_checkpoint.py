"""A user's optimizer that needs whole parameters keeps its states across a checkpoint: saved
at ZeRO-3 dp 2 (each parameter's states whole, written by its owner), resumed under ZeRO-1 dp 2
(read by each parameter's new owner), tp 2 and in one process, it continues as the
uninterrupted one-process run. Under DiLoCo (each replica's states its own) a save and resume
is the uninterrupted DiLoCo run, and a fault-tolerant replica that copies a live one's state
(in one process, and ZeRO-3's shards) continues as the live one.

The optimizer (FactoredAdam below) has the states such optimizers have: a momentum shaped like
the parameter, Adafactor's factored second moment of a matrix (a row and a column vector, not
the parameter's shape) and a step count that is a Python int. Started afresh at the resume,
its bias correction and moments restart and the next update moves each weight by about lr
(0.01); kept, the runs differ by reduction-order rounding only (float64).
"""
from __future__ import annotations

import pytest
import torch
from tolerances import fp64_atol

SHAPE = {"n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 16, "vocab_size": 64}
STEPS, SAVED = 6, 3


class FactoredAdam(torch.optim.Optimizer):
    """Adam with Adafactor's factored second moment on matrices (row and column means of g^2,
    their outer product over their mean), on other tensors the usual one; eps 1e-8 keeps a
    gradient that is zero but for rounding (attention's key bias) from a unit step."""

    needs_whole_params = True

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, st = p.grad, self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p)
                    if p.dim() == 2:
                        st["row"], st["col"] = p.new_zeros(p.shape[0]), p.new_zeros(p.shape[1])
                    else:
                        st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                st["exp_avg"].lerp_(g, 0.1)
                if p.dim() == 2:
                    st["row"].lerp_((g * g).mean(1), 0.01)
                    st["col"].lerp_((g * g).mean(0), 0.01)
                    v = torch.outer(st["row"], st["col"]) / st["row"].mean().clamp_min(1e-30)
                else:
                    v = st["exp_avg_sq"].lerp_(g * g, 0.01)
                m_hat = st["exp_avg"] / (1 - 0.9 ** st["step"])
                v_hat = v / (1 - 0.99 ** st["step"])
                p.add_(m_hat / (v_hat.sqrt() + 1e-8), alpha=-group["lr"])


def _runs(directory: str) -> dict:
    """Rank 0 and 1: one process STEPS steps (rank 0); ZeRO-3 dp 2 SAVED steps, saved; that
    checkpoint resumed at ZeRO-1 dp 2, at tp 2, and in one process (rank 0), to step STEPS. Returns each
    resumed run's largest weight difference from one process and what was saved."""
    from trainmesh import Engine, ParallelConfig, ParallelMesh
    from trainmesh.checkpoint.sharded import read_metadata
    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.models.gpt import GPT, GPTConfig
    rank = torch.distributed.get_rank()
    corpus = SyntheticCorpus(64, 16)

    def engine(cfg: ParallelConfig | None) -> Engine:
        mesh = ParallelMesh(local=True) if cfg is None else None
        return Engine(GPT(GPTConfig(**SHAPE), seed=0).double(), FactoredAdam, lambda m, b: m(**b),
                      cfg or ParallelConfig(), mesh=mesh)

    def train(e: Engine, first: int, last: int, dp: int) -> dict[str, torch.Tensor]:
        for k in range(first, last):
            batch = corpus.batch(5, k, 8)
            if dp == 2:
                batch = {key: v[4 * rank : 4 * rank + 4] for key, v in batch.items()}
            norms.append(e.step(batch).grad_norm)
        return e.full_state_dict()      # collective: every rank of the run

    out: dict = {}
    norms: list[float] = []
    ref = train(engine(None), 0, STEPS, 1) if rank == 0 else None
    out["norm"] = max(norms, default=0.0)      # the one process's largest gradient norm
    zero3 = engine(ParallelConfig(dp=2, zero=3))
    train(zero3, 0, SAVED, 2)
    saved = zero3.save(f"{directory}/ck")
    out["held"] = sorted(zero3.optimizer.whole_state())     # this rank's: those it owns
    copy3 = engine(ParallelConfig(dp=2, zero=3))    # a fault-tolerant replica's live copy
    _copied(zero3, copy3)
    a, b = train(zero3, SAVED, STEPS, 2), train(copy3, SAVED, STEPS, 2)
    if rank == 0:
        out["live"] = max(((a[k] - v).abs().max().item(), k) for k, v in b.items())
    diloco = ParallelConfig(dp=2, strategy="diloco", inner_steps=2)   # an outer step at 2, 4, 6
    whole = train(engine(diloco), 0, STEPS, 2)
    first = engine(diloco)
    train(first, 0, SAVED, 2)
    dck = first.save(f"{directory}/diloco")
    again = engine(diloco)
    again.load(f"{directory}/diloco")
    got = train(again, SAVED, STEPS, 2)
    if rank == 0:
        out["diloco"] = max(((got[k] - v).abs().max().item(), k) for k, v in whole.items())
        md = read_metadata(dck).state_dict_metadata
        out["diloco_saved"] = sorted(k for k in md if k.startswith("optimizer.state.blocks.0.mlp.fc.bias"))
    zero1 = engine(ParallelConfig(dp=2, zero=1))    # read by the new owners only
    zero1.load(f"{directory}/ck")
    out["read"] = sorted(zero1.optimizer.whole_state())
    got = train(zero1, SAVED, STEPS, 2)
    if rank == 0:
        out["zero1"] = max(((got[k] - v).abs().max().item(), k) for k, v in ref.items())
    tp2 = engine(ParallelConfig(tp=2))
    tp2.load(f"{directory}/ck")
    got = train(tp2, SAVED, STEPS, 1)
    if rank == 0:
        md = read_metadata(saved).state_dict_metadata
        out["saved"] = {k: (tuple(m.size), m.properties.dtype) if hasattr(m, "size") else type(m).__name__
                        for k, m in md.items() if k.startswith("optimizer.state.blocks.0.mlp.fc")}
        out["tp2"] = max(((got[k] - v).abs().max().item(), k) for k, v in ref.items())
        one = engine(None)
        one.load(f"{directory}/ck")
        got = train(one, SAVED, STEPS, 1)
        out["one"] = max(((got[k] - v).abs().max().item(), k) for k, v in ref.items())
        first = engine(None)                      # one process saved, one process resumed
        train(first, 0, SAVED, 1)
        first.save(f"{directory}/ck1")
        again = engine(None)
        again.load(f"{directory}/ck1")
        got = train(again, SAVED, STEPS, 1)
        out["same"] = max(((got[k] - v).abs().max().item(), k) for k, v in ref.items())
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_whole_param_optimizers_states_resume_under_another_layout(tmp_path):
    """What a checkpoint adds must be nothing: one process saved and resumed is bit for bit
    the uninterrupted run (the same ops on the same states, the int step included). Across
    layouts, float64 end to end (test_fp64_layouts): each gradient element equals one
    process's within fp64_atol(||g||, terms) (sums over 128 tokens of products through inner
    sums up to 4 * d_model wide), and an update m / (sqrt(v) + 1e-8) moves by at most 2 x that
    / 1e-8 of lr (an element whose gradient is rounding alone: attention's key bias), each of
    the STEPS steps: about 1e-5 (seen: 1.3e-13). A state lost or wrong moves weights by about lr
    (1e-2), 1000x above."""
    from trainmesh.testing import run_distributed
    ranks = run_distributed(_runs, 2, str(tmp_path), timeout_s=280)
    res = ranks[0]
    # each parameter's states at one rank of ZeRO-3's two, both ranks holding some
    assert ranks[0]["held"] and ranks[1]["held"], ranks
    assert not set(ranks[0]["held"]) & set(ranks[1]["held"]), ranks
    assert len(ranks[0]["held"]) + len(ranks[1]["held"]) == 37, ranks   # the GPT's parameters
    # resumed at ZeRO-1 dp 2: each parameter's states read by its one new owner
    assert not set(ranks[0]["read"]) & set(ranks[1]["read"]), ranks
    assert len(ranks[0]["read"]) + len(ranks[1]["read"]) == 37, ranks
    fc = "optimizer.state.blocks.0.mlp.fc"
    assert res["saved"] == {f"{fc}.weight.exp_avg": ((128, 32), torch.float64),
                            f"{fc}.weight.row": ((128,), torch.float64),
                            f"{fc}.weight.col": ((32,), torch.float64),
                            f"{fc}.weight.step": "BytesStorageMetadata",   # an int
                            f"{fc}.bias.exp_avg": ((128,), torch.float64),
                            f"{fc}.bias.exp_avg_sq": ((128,), torch.float64),
                            f"{fc}.bias.step": "BytesStorageMetadata"}, res["saved"]
    assert res["same"][0] == 0, res["same"]     # the same ops on the same states: bit for bit
    assert res["live"][0] == 0, res["live"]     # ZeRO-3's live copy (its shards), likewise
    assert res["diloco"][0] == 0, res["diloco"]   # DiLoCo saved mid-round and resumed, likewise
    bias = "optimizer.state.blocks.0.mlp.fc.bias"
    assert res["diloco_saved"] == sorted(
        [f"{bias}.inner_steps_done", f"{bias}.outer_momentum"]
        + [f"{bias}.replica{r}/{k}" for r in (0, 1) for k in ("param", "exp_avg", "exp_avg_sq", "step")]), \
        res["diloco_saved"]
    terms = 8 * SHAPE["seq_len"] * 4 * SHAPE["d_model"]
    bound = STEPS * 0.01 * 2 * fp64_atol(res["norm"], terms) / 1e-8
    for layout in ("zero1", "tp2", "one"):
        assert res[layout][0] <= bound, (layout, res[layout], bound)


def test_a_state_a_checkpoint_cannot_hold_is_refused_naming_it():
    """A state that is neither a tensor nor a number: the save refuses it in one line (on every
    rank: local_state gathers the refusal with the groups before any file is written)."""
    from trainmesh.core.errors import ConfigError
    from trainmesh.data_parallel.whole_params import WholeParams

    class Tagged(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)
            for p in self.param_groups[0]["params"]:
                self.state[p]["note"] = "warm"

    class Named:                                   # the engine's map where nothing is cut
        def map(self, p, tensors, fn):
            return fn("w", tensors)

    w = torch.nn.Parameter(torch.ones(2, 2))
    opt = WholeParams([w], lambda ps: Tagged(ps, lr=0.1))
    opt.wholes = Named()
    w.grad = torch.ones(2, 2)
    opt.step()
    with pytest.raises(ConfigError, match=r"optimizer: Tagged's state 'note' of w is a str"):
        opt.whole_state()
    opt.load_whole_state({"w": {"momentum_buffer": torch.full((2, 2), 3.0)}})
    assert torch.equal(opt.whole_state()["w"]["momentum_buffer"], torch.full((2, 2), 3.0))


def _copied(source, receiver) -> None:
    """``receiver`` takes ``source``'s live state as a fault-tolerant replica does: described
    by the header's layout, flattened into one buffer per dtype, cut up again on arrival."""
    from trainmesh.fault_tolerance.transfer import flatten, state_layout, unflatten
    params, optim = source.live_state()
    layout = state_layout(params, optim)
    sent = flatten([t for _, t in params] + [optim[name][k] for name, k, _, _ in layout])
    mine = receiver.live_state()[0]
    shapes = [(t.shape, t.dtype) for _, t in mine] + [(torch.Size(s), getattr(torch, d))
                                                        for _, _, s, d in layout]
    got = unflatten(shapes, lambda i, buf: buf.copy_(sent[i]))
    optim_got: dict = {}
    for (name, k, _, _), t in zip(layout, got[len(mine):]):
        optim_got.setdefault(name, {})[k] = t
    receiver.load_live_state({n: t for (n, _), t in zip(mine, got)}, optim_got, source.trainer_state())


def test_a_replica_copying_a_live_one_takes_its_whole_param_states():
    """A fault-tolerant replica that copies a live one's state gets the user's optimizer's
    states too (the momentum, the factored moments, the int step back as an int): trained on
    from there, it is the live one bit for bit (the same ops on the same states). Started afresh
    instead, its first update moves each weight by about lr (module docstring)."""
    from trainmesh import Engine, ParallelConfig, ParallelMesh
    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.models.gpt import GPT, GPTConfig
    corpus = SyntheticCorpus(64, 16)

    def engine() -> Engine:
        return Engine(GPT(GPTConfig(**SHAPE), seed=0).double(), FactoredAdam, lambda m, b: m(**b),
                      ParallelConfig(), mesh=ParallelMesh(local=True))
    live, fresh = engine(), engine()
    for k in range(SAVED):
        live.train_step(corpus.batch(5, k, 8))
    _copied(live, fresh)
    taken = dict(fresh.optimizer.pending)
    for k in range(SAVED, STEPS):
        for e in (live, fresh):
            e.train_step(corpus.batch(5, k, 8))
    a, b = live.full_state_dict(), fresh.full_state_dict()
    worst = max(((a[k] - v).abs().max().item(), k) for k, v in b.items())
    assert worst[0] == 0, worst
    assert len(taken) == 37 and all(type(s["step"]) is int for s in taken.values())   # as it was


def test_a_live_copy_takes_back_each_number_as_the_type_it_was():
    """A live copy's numbers travel as 0-d tensors: each comes back as the int, float, bool or
    None it was (an int step read back as a tensor would change the optimizer's arithmetic),
    a tensor as a tensor of its own."""
    from trainmesh.data_parallel.whole_params import LIVE, WholeParams, live_states, load_live_states

    class Named:                                   # the engine's map where nothing is cut
        def map(self, p, tensors, fn):
            return fn("w", tensors)

    class Part:
        def __init__(self, opt):
            self.optimizer = opt

    state = {"step": 3, "scale": 0.1, "warm": True, "none": None, "m": torch.full((2,), 3.0)}
    source = WholeParams([torch.nn.Parameter(torch.ones(2))], lambda ps: torch.optim.SGD(ps, lr=0.1))
    source.load_whole_state({"w": state})
    sent = live_states(Part(source))
    assert set(sent) == {LIVE + "w"}
    receiver = WholeParams([torch.nn.Parameter(torch.ones(2))], lambda ps: torch.optim.SGD(ps, lr=0.1))
    receiver.wholes = Named()
    load_live_states(Part(receiver), {**sent, "shard0": {}})
    got = receiver.whole_state()["w"]
    assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in state.items()}, got
    assert {k: v for k, v in got.items() if k != "m"} == {k: v for k, v in state.items() if k != "m"}
    assert torch.equal(got["m"], state["m"]) and got["m"] is not state["m"]
