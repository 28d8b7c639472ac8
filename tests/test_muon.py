"""--optimizer muon in one process: MuonAdamW against torch.optim.Muon + torch.optim.AdamW on the
same split, the split itself, stacked experts, the owners' balance, and a ZeRO shard stepping a
matrix that took no part in a step (in process, one rank). The layouts: test_muon_layouts.py
and test_layout_matrix.py (whose rows run Muon).

Planted bugs caught here: a 1-D parameter sent to Muon (is_hidden_matrix true for every shape)
fails test_the_split_is_the_hidden_matrices and the parity test; an expert's E matrices
orthogonalised as one (``matrices`` returning the stack as one (E*a, b) matrix) fails
test_stacked_experts_are_matrices_of_their_own.
"""
from __future__ import annotations

import torch
from torch import nn

from trainmesh.config.train import TrainConfig
from trainmesh.data_parallel.muon import MuonAdamW, is_hidden_matrix, newton_schulz, ns_flops
from trainmesh.data_parallel.muon_owners import owners, tp_owners
from trainmesh.models.gpt import GPT
from trainmesh.run.optimizers import describe_split, no_decay, param_groups

CFG = TrainConfig(layers=2, d_model=32, heads=4, seq_len=16, vocab_size=64, optimizer="muon")
LR = 0.01


def _reference_split(name: str, p: torch.Tensor) -> bool:
    """Muon's usual split, written independently of the code: 2-D weights but the embeddings'
    and the output head's."""
    return p.ndim == 2 and not name.startswith(("embed.", "head."))


def _ours(model: nn.Module) -> MuonAdamW:
    options = param_groups(CFG, model)
    groups: dict[tuple, tuple[dict, list]] = {}
    for name, p in model.named_parameters():
        o = options(name)
        groups.setdefault(tuple(sorted(o.items())), (o, []))[1].append(p)
    return MuonAdamW([{**o, "params": ps} for o, ps in groups.values()], lr=LR, betas=(0.9, 0.95))


def _torch(model: nn.Module) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    muon = [p for n, p in named if _reference_split(n, p)]
    adam: dict[float, list] = {}
    for n, p in named:
        if not _reference_split(n, p):
            adam.setdefault(no_decay(n)["weight_decay"], []).append(p)
    return [torch.optim.Muon(muon, lr=LR, weight_decay=0.1),
            torch.optim.AdamW([{"params": ps, "weight_decay": wd} for wd, ps in adam.items()],
                              lr=LR, betas=(0.9, 0.95), foreach=True)]


def test_the_split_is_the_hidden_matrices():
    model = GPT(CFG.gpt_config(), seed=0, device="meta")
    options = param_groups(CFG, model)
    ours = {n for n, _ in model.named_parameters() if options(n)["muon"]}
    want = {n for n, p in model.named_parameters() if _reference_split(n, p)}
    assert ours == want, (sorted(ours - want), sorted(want - ours))
    assert describe_split(model, options).startswith("optimizer: Muon on 12 hidden weight tensors")
    assert is_hidden_matrix("layers.0.mlp.experts.gate_up_proj", (4, 64, 32))     # stacked
    assert not is_hidden_matrix("model.embed_tokens.weight", (64, 32))
    assert not is_hidden_matrix("lm_head.weight", (64, 32))
    assert not is_hidden_matrix("blocks.0.ln1.weight", (32,))
    assert not is_hidden_matrix("conv.weight", (4, 3, 3, 3))


def test_muon_equals_torch_muon_and_adamw_for_20_steps():
    """20 steps of the GPT. The bound is 0 (equal bits): both run the same float operations in
    the same order. Muon's learning-rate factors here (1 for the square matrices, 2 for the
    MLP's (128, 32) and (32, 128)... sqrt(max(1, a/b)) = 2 and 1) are powers of two, so our
    update scaled by the factor before the step's multiply-add rounds exactly as torch's
    factor folded into the learning rate; a factor that is not a power of two would differ by
    one float32 rounding of the update (2^-24 relative), which the next step's bf16 cast can
    turn into 2^-8 of one element."""
    a, b = GPT(CFG.gpt_config(), seed=0), GPT(CFG.gpt_config(), seed=0)
    ours, theirs = [_ours(a)], _torch(b)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        x = torch.randint(0, 64, (4, 16), generator=g)
        for model, opts in ((a, ours), (b, theirs)):
            loss, count = model(input_ids=x, labels=x)
            (loss / count).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    moved = 0
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), (name, (p - q).abs().max().item())
        moved += int(not torch.equal(p, GPT(CFG.gpt_config(), seed=0).get_parameter(name)))
    assert moved == len(list(a.parameters()))      # every parameter took steps
    assert set(ours[0].state[a.blocks[0].attn.q.weight]) == {"momentum_buffer"}


def test_stacked_experts_are_matrices_of_their_own():
    """A (E, a, b) expert tensor is E matrices: MuonAdamW on it equals torch.optim.Muon on
    E separate (a, b) parameters, learning-rate factor of (a, b) each (0 bound: the same ops;
    (16, 4)'s factor is 2, a power of two: see the test above)."""
    torch.manual_seed(0)
    stacked = nn.Parameter(torch.randn(3, 16, 4))
    parts = [nn.Parameter(stacked.detach()[e].clone()) for e in range(3)]
    ours = MuonAdamW([{"params": [stacked], "muon": True, "weight_decay": 0.1}], lr=LR)
    theirs = torch.optim.Muon(parts, lr=LR, weight_decay=0.1)
    for step in range(3):
        grad = torch.randn(3, 16, 4, generator=torch.Generator().manual_seed(step))
        stacked.grad = grad.clone()
        for e, p in enumerate(parts):
            p.grad = grad[e].clone()
        ours.step()
        theirs.step()
    for e, p in enumerate(parts):
        assert torch.equal(stacked.detach()[e], p.detach()), (e, (stacked[e] - p).abs().max().item())
    u = torch.randn(2, 8, 8)
    group = ours.param_groups[0]
    assert not torch.equal(newton_schulz(u, group), newton_schulz(u.reshape(16, 8), group).reshape(2, 8, 8))


def test_owners_balance_the_iterations_flops():
    """The greedy owners of the GPT-2-small-like matrices over 4 ranks: every rank within
    1.25x of the mean FLOPs, the same table whatever the order the ranks list them in is not
    (the table is a function of the list only)."""
    shapes = [(f"b{i}.{k}", s) for i in range(12)
              for k, s in (("q", (768, 768)), ("k", (768, 768)), ("v", (768, 768)),
                           ("proj", (768, 768)), ("fc", (3072, 768)), ("out", (768, 3072)))]
    table = owners(shapes, 4)
    load = [0] * 4
    for name, shape in shapes:
        load[table[name]] += ns_flops(shape)
    mean = sum(load) / 4
    assert max(load) <= 1.25 * mean, load
    assert owners(shapes, 4) == table
    assert ns_flops((3, 16, 8)) == 3 * ns_flops((16, 8))


def test_tp_owners_compose_with_zeros():
    """tp 2 x a ZeRO group of 2 over the GPT-2-small-like matrices: ZeRO's table as without tp,
    and among each ZeRO owner's tp ranks the tp owners of its matrices: each of the 4 ranks
    within 1.25x of the mean (a quarter of the FLOPs), the same table from the same list."""
    shapes = [(f"b{i}.{k}", s) for i in range(12)
              for k, s in (("q", (768, 768)), ("k", (768, 768)), ("v", (768, 768)),
                           ("proj", (768, 768)), ("fc", (3072, 768)), ("out", (768, 3072)))]
    zero = owners(shapes, 2)
    tp = tp_owners(shapes, zero, 2)
    assert set(tp) == set(zero) and set(tp.values()) == {0, 1}
    load = [[0, 0], [0, 0]]
    for name, shape in shapes:
        load[zero[name]][tp[name]] += ns_flops(shape)
    mean = sum(ns_flops(s) for _, s in shapes) / 4
    assert max(max(row) for row in load) <= 1.25 * mean, load
    assert tp_owners(shapes, zero, 2) == tp


def test_a_zero_shard_leaves_a_matrix_without_a_gradient_alone():
    """ZeRO-1 on one rank (the flat shard and its stepper, in process): a layer unused in a
    step keeps its value and momentum, as torch.optim.Muon leaves a parameter without a
    gradient; the used ones step as torch's (0 bound: one rank, the same ops)."""
    from trainmesh import Engine, ParallelConfig, ParallelMesh

    class TwoPaths(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)

        def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
            return (self.b(self.a(x)) if use_b else self.a(x)).pow(2).mean()

    torch.manual_seed(0)
    model, ref = TwoPaths(), TwoPaths()
    ref.load_state_dict(model.state_dict())
    engine = Engine(model, lambda ps: MuonAdamW(ps, lr=LR), lambda m, batch: m(*batch),
                    ParallelConfig(zero=1, find_unused_parameters=True),
                    param_groups=lambda name: {"muon": True, "weight_decay": 0.1},
                    mesh=ParallelMesh(local=True))
    theirs = torch.optim.Muon(ref.parameters(), lr=LR, weight_decay=0.1)
    for step, use_b in enumerate([True, False, True]):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        engine.train_step((x, use_b))
        ref(x, use_b).backward()
        theirs.step()
        theirs.zero_grad(set_to_none=True)
    for (name, p), q in zip(engine.module.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=0), (name, (p - q).abs().max().item())


def test_the_planner_counts_muons_states_and_gathers():
    """`trainmesh plan --optimizer muon` at dp 2 ZeRO-1 and tp 2: the momentum on the hidden
    matrices and AdamW's two moments on the rest (plus its step counters), and per step the
    owners' all-to-alls over dp (fp32: a rank's stretches there, the matrices it owns back, on
    average half of every matrix each way; test_muon_zero_owners.py measures the two ranks'
    sum), the tp all-to-alls of the cut ones to their owners and back (figures a run measured
    equal, by the summary's comm_bytes_per_step and model_state_bytes)."""
    from trainmesh.config.parallel import ParallelConfig
    from trainmesh.planner.predict import predict_layout
    gpt = CFG.gpt_config()
    model = GPT(gpt, seed=0, device="meta")
    split = param_groups(CFG, model)
    matrices = sum(p.numel() for n, p in model.named_parameters() if split(n)["muon"])
    rest = sum(p.numel() for n, p in model.named_parameters() if not split(n)["muon"])
    zero1 = predict_layout(gpt, ParallelConfig(dp=2, zero=1), global_batch=8, optimizer="muon",
                           base_bytes=0).ranks[0]
    assert zero1.comm_bytes_per_step["dp"]["all_to_all"] == 2 * 4 * matrices / 2
    assert "reduce" not in zero1.comm_bytes_per_step["dp"]
    assert "broadcast" not in zero1.comm_bytes_per_step["dp"]
    counters = zero1.model_state_bytes["optimizer"] - (4 * matrices + 8 * rest) // 2
    assert 0 < counters <= 8, counters          # AdamW's step count per flat shard (4 bytes)
    tp2 = predict_layout(gpt, ParallelConfig(tp=2), global_batch=8, optimizer="muon",
                         base_bytes=0).ranks[0]
    # to the owners and back: this rank's shards, and its owned matrices whole (as many here)
    assert tp2.comm_bytes_per_step["tp"]["all_to_all"] == 2 * 4 * matrices / 2
    assert "all_gather" not in tp2.comm_bytes_per_step["tp"]
    assert "reduce" not in tp2.comm_bytes_per_step["dp"]


def test_zero_with_offload_to_files_steps_as_one_process(tmp_path):
    """ZeRO-2 on one rank with --offload nvme (the file store steps one group at a time) and
    ZeRO-3 with --offload cpu, the GPT's split into three groups: bit for bit the one-process
    Muon + AdamW (the same element-wise arithmetic on flat shards, each matrix assembled whole
    by exact copies)."""
    from trainmesh import Engine, ParallelConfig, ParallelMesh
    from trainmesh.data.corpus import SyntheticCorpus
    corpus = SyntheticCorpus(64, 16)

    def run(cfg: ParallelConfig) -> dict[str, torch.Tensor]:
        model = GPT(CFG.gpt_config(), seed=0)
        engine = Engine(model, lambda ps: MuonAdamW(ps, lr=LR, betas=(0.9, 0.95)),
                        lambda m, b: m(**b), cfg, param_groups=param_groups(CFG, model),
                        mesh=ParallelMesh(local=True))
        for k in range(3):
            engine.train_step(corpus.batch(5, k, 4))
        return engine.grad_sync.logical_state()[0]

    want = run(ParallelConfig())
    for cfg in (ParallelConfig(zero=2, offload="nvme", offload_dir=str(tmp_path)),
                ParallelConfig(zero=3, offload="cpu")):
        got = run(cfg)
        for name, value in want.items():
            assert torch.equal(got[name], value), (cfg.zero, name, (got[name] - value).abs().max().item())
