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

Planted bugs caught here (each seen failing with an assertion, "the whole pair, exactly"): the
owner placing each rank's stretches one element late (offset + 1, what passes the matrix's end
cut off); every tensor's stretches sent as the first tensor's (the gradient replaced by the
value).
"""
from __future__ import annotations

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
