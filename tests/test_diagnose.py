"""A rank that skips a collective: the job ends within the timeout naming that rank and op."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from trainmesh.comm import Comm
from trainmesh.comm.diagnose import verdict
from trainmesh.core.mesh import ParallelMesh
from trainmesh.testing import run_distributed


def _skip_one(skipper: int) -> None:
    comm = Comm(ParallelMesh(dp=dist.get_world_size(), timeout_s=4))
    x = torch.ones(6)
    comm.all_reduce(x, "dp")
    if dist.get_rank() != skipper:
        comm.all_reduce(x, "dp")          # the skipper never issues this one
    comm.broadcast(x, "dp", src=0)
    comm.all_reduce(x, "dp")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_skipped_collective_is_named():
    with pytest.raises(ChildFailedError) as info:
        run_distributed(_skip_one, 3, 2, timeout_s=4)
    messages = " ".join(str(f.message) for f in info.value.failures.values())
    assert "rank 2 diverged at op #2" in messages, messages
    assert "broadcast" in messages and "all_reduce" in messages


def test_verdict_names_minority_and_silent_ranks():
    a = [(1, "all_reduce", "dp", (6,)), (2, "all_reduce", "dp", (6,))]
    b = [(1, "all_reduce", "dp", (6,)), (2, "broadcast", "dp", (6,))]
    text = verdict({0: a, 1: a, 2: b}, 4)
    assert "ranks 3 sent no history" in text
    assert "rank 2 diverged at op #2: rank 2 ran broadcast@dp(6,) while ranks 0, 1 ran all_reduce@dp(6,)" in text


def _exchange_with_a_stalled_store(results) -> None:
    """In a forked child: a store whose host accepts connections and never answers; the
    exchange's outcome and how long it took are sent on ``results``. The store client the exchange
    abandons stays blocked on the stalled socket and ends with this process: in the test's own
    process it would outlive the test and, once the socket closed, print c10d's error and C++
    stack to the suite's output."""
    import socket
    import threading
    import time

    from trainmesh.comm.diagnose import CALL_TIMEOUT_S, exchange
    from trainmesh.core.stores import STORE_ENV
    mine = [(1, "all_reduce", "dp", (6,))]
    with socket.socket() as stalled:
        stalled.bind(("127.0.0.1", 0))
        stalled.listen()
        os.environ[STORE_ENV] = f"127.0.0.1:{stalled.getsockname()[1]}"
        result: dict = {}
        t0 = time.monotonic()
        worker = threading.Thread(target=lambda: result.update(exchange(1, 3, mine, wait_s=2.0)), daemon=True)
        worker.start()
        worker.join(timeout=2.0 + 3 * CALL_TIMEOUT_S + 5)
        results.send((worker.is_alive(), time.monotonic() - t0, result, mine))
        os._exit(0)   # the abandoned client ends here, the stalled socket still open


@pytest.mark.slow
def test_exchange_is_bounded_when_the_store_stops_answering():
    """A store whose host is stalled (it accepts connections, never answers): the exchange
    gives up within its bounds and reports only this rank, so the peers are the suspects."""
    import multiprocessing

    from trainmesh.comm.diagnose import silent_ranks
    context = multiprocessing.get_context("fork")
    results, sent = context.Pipe(duplex=False)
    child = context.Process(target=_exchange_with_a_stalled_store, args=(sent,))
    child.start()
    try:
        assert results.poll(60), "the child sent nothing within 60 s"
        waits, took, result, mine = results.recv()
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert not waits, f"the exchange still waits after {took:.0f}s"
    assert result == {1: mine}
    assert silent_ranks(result, 3) == [0, 2]


def test_exchange_through_the_launchers_store(monkeypatch):
    """Ranks publish and collect through a store hosted outside the workers."""
    from datetime import timedelta

    from trainmesh.comm.diagnose import exchange
    from trainmesh.core.stores import STORE_ENV
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    monkeypatch.setenv(STORE_ENV, f"127.0.0.1:{store.port}")
    a = [(1, "all_reduce", "dp", (6,))]
    b = [(1, "broadcast", "dp", (6,))]
    assert exchange(0, 2, a, wait_s=0.2) == {0: a}          # rank 1 has not reported yet
    assert exchange(1, 2, b, wait_s=5.0) == {0: a, 1: b}


# ---------------------------------------------------------------- TRAINMESH_CHECK_COLLECTIVES=1
def _rank_dependent_order() -> int:
    """Step 1: both ranks all-reduce on dp, then on the world. Step 2: rank 1 swaps the order
    (asynchronous ops on two groups, so nothing hangs: only the check can tell)."""
    comm = Comm(ParallelMesh(dp=dist.get_world_size(), timeout_s=30))
    assert comm.order_check is not None
    x, y = torch.ones(6), torch.ones(3, dtype=torch.float64)
    for step in (1, 2):
        comm.ledger.begin_step()
        order = [(x, "dp"), (y, "world")]
        if step == 2 and dist.get_rank() == 1:
            order.reverse()
        handles = [comm.all_reduce(t, axis, async_op=True) for t, axis in order]
        for h in handles:
            h.wait()
        comm.end_step()
    return comm.order_check.checks


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_check_collectives_names_the_first_op_that_differs(monkeypatch):
    from trainmesh.comm.check import CHECK_ENV
    monkeypatch.setenv(CHECK_ENV, "1")
    with pytest.raises(ChildFailedError) as info:
        run_distributed(_rank_dependent_order, 2, timeout_s=30)
    messages = " ".join(str(f.message) for f in info.value.failures.values())
    assert ("rank 1 and rank 0 issued different collectives: at collective #1 on the groups they "
            "share, in step 2 of this process, rank 0 ran all_reduce@dp[ranks 0,1] float32(6,) while "
            "rank 1 ran all_reduce@world[ranks 0,1] float64(3,)") in messages, messages


def test_check_collectives_compares_only_shared_groups():
    """Ranks on different groups (two dp groups of a 2x2 mesh, say) issue different collectives
    legitimately; only the collectives on groups a pair shares are compared."""
    from trainmesh.comm.check import first_difference
    dp0 = ("all_reduce", "dp", (0, 2), "float32", (6,))
    dp1 = ("all_reduce", "dp", (1, 3), "float32", (8,))
    world = ("all_reduce", "world", (0, 1, 2, 3), "float32", (2,))
    same = {0: [dp0, world], 1: [dp1, world], 2: [dp0, world], 3: [dp1, world]}
    assert first_difference(same) is None
    swapped = {**same, 2: [world, dp0]}
    assert first_difference(swapped) == (0, 2, 0, "all_reduce@dp[ranks 0,2] float32(6,)",
                                         "all_reduce@world[ranks 0,1,2,3] float32(2,)")
