"""Every comm op against torch's own result and its ledger bytes; mesh coordinates and groups."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from trainmesh.comm import Comm
from trainmesh.core.mesh import ParallelMesh
from trainmesh.testing import run_distributed


def _ops_check() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = Comm(ParallelMesh(dp=n))
    comm.ledger.begin_step()
    x = torch.arange(6, dtype=torch.float32) + rank            # (6,)
    out: dict = {}

    t = x.clone(); comm.all_reduce(t, "dp"); out["all_reduce"] = t
    t = x.clone(); comm.broadcast(t, "dp", src=n - 1); out["broadcast"] = t
    t = x.clone(); comm.reduce(t, "dp", dst=0); out["reduce"] = t if rank == 0 else None
    g = torch.empty(6 * n); comm.all_gather(g, x, "dp"); out["all_gather"] = g
    s = torch.empty(6 // n if 6 % n == 0 else 1)
    big = torch.arange(6 * n, dtype=torch.float32) * (rank + 1)
    rs = torch.empty(6); comm.reduce_scatter(rs, big, "dp"); out["reduce_scatter"] = rs
    chunks = [torch.full((2,), float(i)) for i in range(n)] if rank == 0 else None
    sc = torch.empty(2); comm.scatter(sc, chunks, "dp", src=0); out["scatter"] = sc
    gl = [torch.empty(6) for _ in range(n)] if rank == 0 else None
    comm.gather(x, gl, "dp", dst=0); out["gather"] = torch.stack(gl) if gl else None
    a2a = torch.empty(2 * n); comm.all_to_all(a2a, torch.arange(2 * n, dtype=torch.float32) + 10 * rank, "dp")
    out["all_to_all"] = a2a
    peer = (rank + 1) % n
    prev = (rank - 1) % n
    recv = torch.empty(3)
    hs = comm.batch_p2p([("send", torch.full((3,), float(rank)), peer), ("recv", recv, prev)])
    for h in hs:
        h.wait()
    out["batch_p2p"] = recv
    if rank == 0:
        comm.send(torch.ones(4), 1)
    elif rank == 1:
        r = torch.empty(4); comm.recv(r, 0); out["recv"] = r
    h = comm.all_reduce(x.clone(), "dp", async_op=True); h.wait()
    window = comm.ledger.end_step()
    out["ledger"] = {f"{axis}.{op}": (st.calls, st.bytes) for axis, ops in window.items() for op, st in ops.items()}
    out["rank"], out["n"], out["s"] = rank, n, s.numel()
    return out


def _expected(rank: int, n: int) -> dict:
    xs = [torch.arange(6, dtype=torch.float32) + r for r in range(n)]
    bigs = [torch.arange(6 * n, dtype=torch.float32) * (r + 1) for r in range(n)]
    a2a_in = [torch.arange(2 * n, dtype=torch.float32) + 10 * r for r in range(n)]
    return {
        "all_reduce": sum(xs), "broadcast": xs[n - 1], "reduce": sum(xs) if rank == 0 else None,
        "all_gather": torch.cat(xs), "reduce_scatter": sum(bigs)[rank * 6:(rank + 1) * 6],
        "scatter": torch.full((2,), float(rank)), "gather": torch.stack(xs) if rank == 0 else None,
        "all_to_all": torch.cat([a[rank * 2:(rank + 1) * 2] for a in a2a_in]),
        "batch_p2p": torch.full((3,), float((rank - 1) % n)),
    }


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_every_op_matches_torch_and_is_accounted(world):
    results = run_distributed(_ops_check, world)
    f = 4  # fp32 bytes
    for rank, out in results.items():
        for op, want in _expected(rank, world).items():
            if want is None:
                assert out[op] is None
            else:
                torch.testing.assert_close(out[op], want, msg=f"{op} on rank {rank}")
        if rank == 1:
            torch.testing.assert_close(out["recv"], torch.ones(4))
        led = out["ledger"]
        # nccl-tests convention: all_reduce/broadcast/reduce the tensor, all_gather the output,
        # reduce_scatter the input, scatter/gather the full buffer, send/recv the tensor.
        assert led["dp.all_reduce"] == (2, 2 * 6 * f)
        assert led["dp.broadcast"] == (1, 6 * f)
        assert led["dp.reduce"] == (1, 6 * f)
        assert led["dp.all_gather"] == (1, 6 * world * f)
        assert led["dp.reduce_scatter"] == (1, 6 * world * f)
        assert led["dp.scatter"] == (1, 2 * world * f)
        assert led["dp.gather"] == (1, 6 * world * f)
        assert led["dp.all_to_all"] == (1, 2 * world * f)
        sends = 1 + (rank == 0)
        recvs = 1 + (rank == 1)
        assert led["pp.send"] == (sends, 3 * f + (rank == 0) * 4 * f)
        assert led["pp.recv"] == (recvs, 3 * f + (rank == 1) * 4 * f)


def _mesh_check() -> dict:
    meshes = {name: ParallelMesh(**kw) for name, kw in
              {"dp4": dict(dp=4), "dp2tp2": dict(dp=2, tp=2), "pp2dp2": dict(pp=2, dp=2),
               "pp2tp2": dict(pp=2, tp=2), "dp2cp2ep2": dict(dp=2, cp=2, ep=2),
               "dp4shard2": dict(dp=4, dp_shard=2)}.items()}
    out = {}
    for name, mesh in meshes.items():  # several meshes live in one process
        comm = Comm(mesh)
        row = {"coords": mesh.coords}
        for axis in ("dp", "pp", "tp", "cp", "dp_cp", "ep", "edp", "dp_shard", "dp_replicate"):
            t = torch.tensor([float(mesh.rank)])
            comm.all_reduce(t, axis, group=mesh.group(axis))
            row[axis] = (mesh.ranks(axis), t.item())
        out[name] = row
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_mesh_groups_and_coordinates():
    results = run_distributed(_mesh_check, 4)
    # tp fastest, then dp, then pp: rank = (pp*dp_deg + dp)*tp_deg + tp
    assert results[3]["dp2tp2"]["coords"] == {"dp": 1, "pp": 0, "tp": 1, "cp": 0}
    assert results[2]["pp2dp2"]["coords"] == {"dp": 0, "pp": 1, "tp": 0, "cp": 0}
    assert results[1]["pp2tp2"]["coords"] == {"dp": 0, "pp": 0, "tp": 1, "cp": 0}
    for rank, res in results.items():
        assert res["dp4"]["dp"] == ([0, 1, 2, 3], 6.0)
        tp_group = [rank - rank % 2, rank - rank % 2 + 1]
        assert res["dp2tp2"]["tp"] == (tp_group, float(sum(tp_group)))
        dp_group = [rank % 2, rank % 2 + 2]
        assert res["dp2tp2"]["dp"] == (dp_group, float(sum(dp_group)))
        assert res["pp2dp2"]["pp"] == (dp_group, float(sum(dp_group)))
        # rank = ((pp*dp + dp_i)*cp + cp_i)*tp + tp_i; ep: runs of 2 in (dp, cp) order
        pair, stride = [rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]
        cpm = res["dp2cp2ep2"]
        assert cpm["cp"] == cpm["ep"] == (pair, float(sum(pair)))
        assert cpm["dp"] == cpm["edp"] == (stride, float(sum(stride)))
        assert cpm["dp_cp"] == ([0, 1, 2, 3], 6.0)
        assert res["dp4shard2"]["dp_shard"] == (pair, float(sum(pair)))
        assert res["dp4shard2"]["dp_replicate"] == (stride, float(sum(stride)))
        assert res["dp4shard2"]["cp"] == ([rank], float(rank))
        assert res["pp2tp2"]["tp"] == (tp_group, float(sum(tp_group)))
        assert res["pp2tp2"]["dp"] == ([rank], float(rank))   # size-1 axis: a no-op


def test_mesh_rejects_bad_degrees():
    from trainmesh.core.errors import ConfigError
    with pytest.raises(ConfigError, match="dp"):
        ParallelMesh(dp=0)
    with pytest.raises(ConfigError, match="world size 1"):
        ParallelMesh(dp=2)   # no process group: the world is one process


def test_world_axis_is_reported_as_other():
    """The ledger keys the whole world's traffic "world"; the metrics file calls it "other"
    (docs/METRICS.md comm_bytes_per_step), and code that says "other" lands in the same row."""
    from trainmesh.comm import Ledger
    ledger = Ledger()
    ledger.begin_step()
    ledger.record("world", "all_reduce", 16)
    ledger.record("other", "all_reduce", 8)
    ledger.record("dp", "all_reduce", 4)
    ledger.end_step()
    assert ledger.bytes_per_step() == {"dp": {"all_reduce": 4.0}, "tp": {}, "pp": {},
                                       "other": {"all_reduce": 24.0}}


def test_ledger_memory_is_bounded_and_averages_cover_every_step():
    """A long run: the ledger's memory stops growing once its window is full, while the
    per-step averages still cover every step (step k sends k bytes: the mean is (n + 1) / 2)."""
    import tracemalloc

    from trainmesh.comm import Ledger

    def run(ledger: Ledger, first: int, last: int) -> None:
        for k in range(first, last + 1):
            ledger.begin_step()
            for axis in ("dp", "tp", "pp", "world"):
                ledger.record(axis, "all_reduce", k if axis == "dp" else 0, seconds=1e-3)
                ledger.record(axis, "all_gather", 0)
            ledger.end_step()

    ledger = Ledger()
    tracemalloc.start()
    try:
        run(ledger, 1, 1000)      # (the window's tables, allocated while traced)
        before = tracemalloc.get_traced_memory()[0]
        run(ledger, 1001, 3000)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 10_000, f"2000 more steps grew the ledger by {grown} bytes"
    assert ledger.closed == 3000 and len(ledger.steps) == ledger.keep
    assert ledger.bytes_per_step()["dp"]["all_reduce"] == pytest.approx(3001 / 2)
    assert ledger.seconds_per_step() == pytest.approx(4e-3)
    assert ledger.step_bytes(2999) == 3000
    with pytest.raises(IndexError, match="not kept"):
        ledger.step_bytes(0)
