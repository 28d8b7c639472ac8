"""Each private torch API trainmesh uses (trainmesh.core.compat) still does what trainmesh needs.

A torch upgrade that renames or changes one of them fails here, naming it, instead of deep
inside a ZeRO-3 backward or a checkpoint restore. No processes: one in-process group of one.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from trainmesh.core import compat


def _during_backward(fn) -> list:
    """Run ``fn()`` from a hook inside a real backward pass; returns what it recorded."""
    seen: list = []
    x = torch.ones(2, requires_grad=True)
    y = x * 3
    y.register_hook(lambda g: seen.append(fn()) or g)
    y.sum().backward()
    return seen


@pytest.mark.timeout(30)
def test_in_backward_tells_backward_from_forward():
    assert hasattr(torch._C, "_current_graph_task_id"), \
        "torch._C._current_graph_task_id is gone: update trainmesh.core.compat.in_backward"
    assert compat.in_backward() is False
    assert _during_backward(compat.in_backward) == [True]
    assert compat.in_backward() is False


@pytest.mark.timeout(30)
def test_queued_callback_runs_once_after_the_backward_pass():
    order: list[str] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 3
    z = y * 2

    def first_hook(g: torch.Tensor) -> torch.Tensor:     # runs before y's hook
        compat.queue_backward_callback(lambda: order.append("end"))
        order.append("z")
        return g

    z.register_hook(first_hook)
    y.register_hook(lambda g: order.append("y") or g)
    z.sum().backward()
    assert order == ["z", "y", "end"], \
        f"Variable._execution_engine.queue_callback ran out of order: {order}"


@pytest.mark.timeout(30)
def test_default_store_is_the_groups_store():
    assert compat.default_store() is None             # no process group yet
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        found = compat.default_store()
        assert found is not None, "distributed_c10d._get_default_store no longer answers"
        found.set("trainmesh/compat", "ok")          # what hang diagnosis does with it
        assert found.check(["trainmesh/compat"]) and found.get("trainmesh/compat") == b"ok"
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(30)
def test_set_last_lr_restores_what_get_last_lr_reports():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    compat.set_last_lr(sched, [0.125])
    assert sched.get_last_lr() == [0.125], "LRScheduler._last_lr no longer backs get_last_lr()"
    opt.step()                                         # (no gradient: nothing moves)
    sched.step()                                       # the schedule goes on from its epoch
    assert sched.get_last_lr() == [0.5]


CLOSED_SERVER = """
import multiprocessing, os, threading
from multiprocessing import forkserver
from trainmesh.core.compat import close_fork_server
multiprocessing.set_forkserver_preload([])
forkserver.ensure_running()
pid = forkserver._forkserver._forkserver_pid
close_fork_server()
try:
    os.kill(pid, 0)
    print("server alive")
except ProcessLookupError:
    pass
restart = threading.Thread(target=forkserver.ensure_running, daemon=True)
restart.start()
restart.join(1.0)
print("blocked" if restart.is_alive() else "restarted")
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_closed_fork_server_is_gone_and_none_starts_again():
    """A launcher stopping on a signal closes its fork server first: an agent thread asking for
    a worker afterwards blocks instead of starting a server (and a half-started worker)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", CLOSED_SERVER], capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["blocked"], out.stdout


def test_rendezvous_events_are_named_as_torch_names_them(monkeypatch):
    """The frame-based name is the one torch's inspect.stack() gives (the method that called
    ``_record``), and it replaces torch's own in the rendezvous module."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    current = dynamic_rendezvous.get_method_name       # an earlier launch in this process may
    original = getattr(current, "__wrapped__", current)  # have replaced it already
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", original)

    class Handler:
        def _record(self, depth: int = 2) -> str:
            return dynamic_rendezvous.get_method_name(depth)

        def next_rendezvous(self) -> str:
            return self._record()

    want = Handler().next_rendezvous()
    compat.cheap_rendezvous_event_names()
    assert dynamic_rendezvous.get_method_name is not original
    assert Handler().next_rendezvous() == want == "next_rendezvous"
    assert Handler()._record(10_000) == original(10_000) == "no_method_name"


def test_materialize_empty_makes_cpu_tensors_of_the_meta_shapes():
    """Parameters and buffers of a meta module become CPU tensors of the same shapes, dtypes
    and parameter-ness, as ``to_empty`` makes them."""
    with torch.device("meta"):
        module = torch.nn.BatchNorm1d(3)
        module.half()
    compat.materialize_empty(module)
    want = torch.nn.BatchNorm1d(3).half()
    for (name, t), (_, w) in zip([*module.named_parameters(), *module.named_buffers()],
                                 [*want.named_parameters(), *want.named_buffers()]):
        assert (t.device.type, t.shape, t.dtype) == ("cpu", w.shape, w.dtype), name
    assert all(isinstance(p, torch.nn.Parameter) for p in module.parameters())
