"""A rank that skips a collective: the job ends within the timeout naming that rank and op."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from trainmesh.comm import Comm
from trainmesh.comm.diagnose import verdict
from trainmesh.mesh import ParallelMesh
from trainmesh.testing import run_distributed


def _skip_one(skipper: int) -> None:
    comm = Comm(ParallelMesh(dp=dist.get_world_size(), timeout_s=4))
    x = torch.ones(6)
    comm.all_reduce(x, "dp")
    if dist.get_rank() != skipper:
        comm.all_reduce(x, "dp")          # the skipper never issues this one
    comm.broadcast(x, "dp", src=0)
    comm.all_reduce(x, "dp")


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
