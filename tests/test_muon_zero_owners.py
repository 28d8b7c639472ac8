"""ZeRO's owners of whole matrices (data_parallel/zero_owners.py) at dp 2, in two processes:
every matrix handed whole to its owner and the owner's result handed back to each rank's
stretches, exactly, a bucket of matrices per pair of all-to-alls.

The map is called with two tensors laid out like a group's shard (as a whole-parameter
optimizer's value and gradient) cut from known whole tensors, and a function of the whole pair;
each owner must see exactly the whole pair of each matrix it owns and no other, and each rank
must get back exactly its stretches of the function of the wholes (cut by the strategy's own
checkpoint path, ``shards_from``). Copies are exact, so every comparison is bitwise. ZeRO-1/2
with flat buckets of 1,000 values (a rank holds several stretches of a matrix) and ZeRO-3 (its
units' pieces), each with one bucket of matrices and with a bucket per matrix or two; the ledger
books each element once each way (all_to_all) and no reduce or broadcast.

At tp 2 x dp 2 (four processes), ZeRO-1 and ZeRO-3 with Muon's tp owners: each rank runs
exactly the iteration FLOPs its owner tables give it (each matrix once over the four ranks) and
the weights after two steps equal bitwise those of every tp rank of the ZeRO owner iterating
the gathered whole; each element crosses once each way over dp and over tp (all_to_all).

Planted bugs caught here (each seen failing with an assertion, "the whole pair, exactly"): the
owner placing each rank's stretches one element late (offset + 1, what passes the matrix's end
cut off); every tensor's stretches sent as the first tensor's (the gradient replaced by the
value). Under tp x ZeRO: the tp owners balanced over all cut matrices instead of per ZeRO owner
("zero1-one", rank 0 ran 19660800 FLOPs, 2 * 4915200 expected); each tp rank handed the other's
shard of an owner's result, and the stretches placed one element late (the weights off the
every-rank run's by 1.7e-2 and 2.8e-2); the shards sent to the tp owners twice (tp all_to_all
bytes 589824, 2 * 8 * 24576 expected).
"""
from __future__ import annotations

import math

import pytest
import torch

SHAPE = {"n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 16, "vocab_size": 64}
LAYOUTS = {"zero1": 1, "zero2": 2, "zero3": 3}
BUCKETS = {"one": 1 << 24, "small": 3000}


def _zero_owner_maps() -> dict:
    """On each rank, per layout and bucket size: the names whose whole pair this rank's map
    call handed to the function, whether each was exact, whether the returned stretches were,
    and the all-to-all calls and bytes booked on dp (and whether any reduce or broadcast)."""
    from trainmesh import Engine, ParallelConfig
    from trainmesh.data_parallel.muon import MuonAdamW, muon_options
    from trainmesh.models.gpt import GPT, GPTConfig
    out: dict = {}
    for layout, zero in LAYOUTS.items():
        model = GPT(GPTConfig(**SHAPE), seed=0).double()
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        engine = Engine(model, lambda ps: MuonAdamW(ps), lambda m, b: m(**b),
                        ParallelConfig(dp=2, zero=zero, bucket_mb=1000 * 8 / 2**20),
                        param_groups=muon_options(shapes, lambda n: {}))
        sync, opt = engine.grad_sync, engine.optimizer
        wholes, comm = opt.wholes, sync.comm
        for bucket, limit in BUCKETS.items():
            opt.bucket_values = limit
            for gi, group in enumerate(opt.param_groups):
                if not group["muon"]:
                    continue
                gen = torch.Generator().manual_seed(gi)
                slots = sync._slots(gi)
                w = {s.name: torch.randn(s.shape, generator=gen, dtype=torch.float64) for s in slots}
                g = {s.name: torch.randn(s.shape, generator=gen, dtype=torch.float64) for s in slots}
                seen: dict[str, bool] = {}

                def fn(name, pair, w=w, g=g, seen=seen):
                    seen[name] = torch.equal(pair[0], w[name]) and torch.equal(pair[1], g[name])
                    return pair[0] - 3 * pair[1]

                comm.ledger.begin_step()
                pair = [sync.shards_from(w)[gi], sync.shards_from(g)[gi]]
                got = wholes.map(sync.shard_params[gi], pair, fn)
                window = comm.ledger.end_step()
                want = sync.shards_from({n: w[n] - 3 * g[n] for n in w})[gi]
                dp = window.get("dp", {})
                out[f"{layout}-{bucket}-{gi}"] = {
                    "seen": seen, "owned": sorted(n for n in w if wholes.owns(n)), "names": sorted(w),
                    "returned": torch.equal(got, want), "values": sum(s.numel for s in slots),
                    "calls": dp["all_to_all"].calls if "all_to_all" in dp else 0,
                    "bytes": dp["all_to_all"].bytes if "all_to_all" in dp else 0,
                    "others": sorted(op for op in dp if op in ("reduce", "broadcast"))}
    return out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_zero_owners_hand_each_matrix_whole_to_its_owner_and_back():
    from trainmesh.testing import run_distributed
    res = run_distributed(_zero_owner_maps, 2, timeout_s=180)
    assert set(res[0]) == set(res[1]) and res[0], res
    for key in res[0]:
        a, b = res[0][key], res[1][key]
        for r, rank in ((0, a), (1, b)):
            assert all(rank["seen"].values()), (key, r, rank["seen"])      # the whole pair, exactly
            assert sorted(rank["seen"]) == rank["owned"], (key, r)          # at its owner only
            assert rank["returned"], (key, r)                               # its stretches, exactly
            assert rank["others"] == [], (key, r, rank["others"])
        assert not set(a["owned"]) & set(b["owned"]), key                   # one owner each
        assert set(a["owned"]) | set(b["owned"]) == set(a["names"]), key
        assert a["calls"] == b["calls"], key                     # the same collectives on both
        # there: each element of both tensors once; back: each element once (float64)
        assert a["bytes"] + b["bytes"] == (2 + 1) * 8 * a["values"], (key, a["bytes"], b["bytes"])
        assert a["calls"] % 2 == 0 and (a["calls"] == 2 or "-small-" in key), (key, a["calls"])
    assert any(res[0][k]["calls"] > 2 for k in res[0] if "-small-" in k), res[0]


TP_STEPS = 2


def _greedy(values: list[int], ranks: int) -> list[int]:
    """Each rank's load after handing ``values`` out largest first, each to the least loaded
    rank (ties: the lowest): what any order of equal values gives, so the loads follow from
    the values alone, whichever of two equal matrices a table names."""
    load = [0] * ranks
    for v in sorted(values, reverse=True):
        load[load.index(min(load))] += v
    return load


def _tp_zero_runs() -> dict:
    """Each of the 4 ranks (tp 2 x dp 2): the float64 GPT trained TP_STEPS Muon steps under
    ZeRO-1 and ZeRO-3, with the tp owners (one bucket of matrices, and buckets of 3000
    values) and with every tp rank of the ZeRO owner iterating the gathered whole (the map
    install() gives a user's optimizer: ShardOwners without tp owners). Returns per run this
    rank's iteration FLOPs and its weights' largest difference from the every-rank run, its
    coordinates, and the hidden matrices' FLOPs (whole shapes) and whether tp cuts each."""
    from trainmesh import Engine, ParallelConfig
    from trainmesh.core.layout import Group
    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.data_parallel import whole_maps
    from trainmesh.data_parallel.muon import MuonAdamW, is_hidden_matrix, muon_options, ns_flops
    from trainmesh.models.gpt import GPT, GPTConfig
    corpus = SyntheticCorpus(64, 16)
    shapes = {n: tuple(p.shape) for n, p in GPT(GPTConfig(**SHAPE), seed=0).named_parameters()}
    hidden = {n: ns_flops(s) for n, s in shapes.items() if is_hidden_matrix(n, s)}
    out: dict = {"hidden": hidden, "values": sum(math.prod(shapes[n]) for n in hidden)}

    def train(zero: int, owned: bool, bucket: int) -> tuple[dict[str, torch.Tensor], int, dict]:
        chosen = whole_maps.ShardOwners              # the map install() gives Muon under ZeRO
        if not owned:
            whole_maps.ShardOwners = lambda part, tp, tp_owned: chosen(part, tp)
        try:
            engine = Engine(GPT(GPTConfig(**SHAPE), seed=0).double(),
                            lambda ps: MuonAdamW(ps, lr=0.01), lambda m, b: m(**b),
                            ParallelConfig(dp=2, tp=2, zero=zero),
                            param_groups=muon_options(shapes, lambda n: {}))
        finally:
            whole_maps.ShardOwners = chosen
        engine.optimizer.bucket_values = bucket
        d = engine.mesh.index(Group.dp)
        out["coords"] = (d, engine.mesh.index(Group.tp))
        out["cut"] = {n: engine.optimizer.wholes.tp.cut(n) is not None for n in hidden}
        for k in range(TP_STEPS):
            batch = corpus.batch(5, k, 8)
            engine.step({key: v[4 * d : 4 * d + 4] for key, v in batch.items()})
        last = engine.comm.ledger.steps[-1]         # the last step's all-to-all bytes per axis
        a2a = {axis: last[axis]["all_to_all"].bytes for axis in ("dp", "tp")
               if "all_to_all" in last.get(axis, {})}
        return engine.full_state_dict(), engine.optimizer.flops_run, a2a

    for zero in (1, 3):
        every, out[f"zero{zero}-every"], _ = train(zero, False, 1 << 25)
        for bucket, limit in (("one", 1 << 25), ("small", 3000)):
            got, flops, out[f"zero{zero}-{bucket}-a2a"] = train(zero, True, limit)
            out[f"zero{zero}-{bucket}"] = flops
            out[f"zero{zero}-{bucket}-diff"] = max(((got[k] - every[k]).abs().max().item(), k)
                                                   for k in every)
    return out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_tp_x_zero_owners_iterate_each_matrix_once_and_equal_every_tp_rank_iterating():
    """tp 2 x dp 2 under ZeRO-1 and ZeRO-3. The FLOPs: ZeRO's table hands the hidden matrices
    (whole shapes) to the 2 dp indices greedily, then each ZeRO owner's cut matrices to its 2
    tp ranks greedily (every hidden matrix of the GPT is cut by tp), so rank (d, t) runs
    exactly load t of the greedy over tp of the values of load d's matrices; the 4 ranks
    together run each matrix once per step (one shard group x TP group grid), where every tp
    rank iterating runs each twice. Per step each element of each matrix goes once to its
    ZeRO owner and back over dp, and once to its tp owner and back over tp: 2 x 8 bytes per
    element on each axis, summed over the ranks. The weights equal the every-rank run's
    bitwise: the owner iterates the same whole matrix (every move a copy), so the same ops on
    the same input."""
    from trainmesh.testing import run_distributed
    res = run_distributed(_tp_zero_runs, 4, timeout_s=180)
    hidden = res[0]["hidden"]
    assert all(res[r]["cut"] == {n: True for n in hidden} for r in res), res[0]["cut"]
    once = sum(hidden.values())
    # the ZeRO owners' multisets of values, then each one's over tp (loads follow from values)
    zload: list[list[int]] = [[], []]
    load = [0, 0]
    for v in sorted(hidden.values(), reverse=True):
        d = load.index(min(load))
        zload[d].append(v)
        load[d] += v
    assert sorted(res[r]["coords"] for r in res) == [(0, 0), (0, 1), (1, 0), (1, 1)], res
    for zero in (1, 3):
        for r, rank in res.items():
            d, t = rank["coords"]
            assert rank[f"zero{zero}-every"] == TP_STEPS * sum(zload[d]), (zero, r)
            for bucket in ("one", "small"):
                key = f"zero{zero}-{bucket}"
                assert rank[key] == TP_STEPS * _greedy(zload[d], 2)[t], (key, r, rank[key])
                assert rank[f"{key}-diff"][0] == 0.0, (key, r, rank[f"{key}-diff"])
        for bucket in ("one", "small"):
            key = f"zero{zero}-{bucket}"
            assert sum(res[r][key] for r in res) == TP_STEPS * once, zero
            # per step, each element of every hidden matrix (float64) crosses once each way
            # over dp (its tp shard's stretches to the ZeRO owner) and over tp (to the tp owner)
            for axis in ("dp", "tp"):
                got = sum(res[r][f"{key}-a2a"].get(axis, 0) for r in res)
                assert got == 2 * 8 * res[0]["values"], (key, axis, got, res[0]["values"])
        assert sum(res[r][f"zero{zero}-every"] for r in res) == 2 * TP_STEPS * once, zero
