"""The private torch (and standard library) APIs trainmesh relies on, each behind one small function.

torch and multiprocessing offer no public way to do these few things; each function says why it needs the private
name and what it falls back to. ``tests/test_compat.py`` checks every one against the installed
torch, so an upgrade that moves or changes one fails there, by name, rather than deep inside a
training step.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


def in_backward() -> bool:
    """Whether the calling code runs inside autograd's backward pass (e.g. a forward re-run by
    activation recomputation). ZeRO-3 needs it to keep a unit gathered for its backward;
    torch exposes the running graph task only as ``torch._C._current_graph_task_id`` (-1 when
    none runs)."""
    return torch._C._current_graph_task_id() != -1


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the current backward pass ends (call it from inside a backward hook).

    ZeRO-3 reduces and frees every unit the hooks left at the end of backward; torch's own FSDP
    uses the same entry point, ``Variable._execution_engine.queue_callback``, for which there is
    no public alias."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def default_store() -> Any | None:
    """The key-value store of the default process group, or None (no group, or no such helper).

    Ranks publish their recent op histories there when an op fails (hang diagnosis): the store
    still answers when a collective does not. torch names it only
    ``distributed_c10d._get_default_store``."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group, or a torch without the helper
        return None


def set_last_lr(scheduler: Any, lrs: Sequence[float]) -> None:
    """Make ``scheduler.get_last_lr()`` return ``lrs`` (restoring a checkpoint).

    A checkpoint stores the LRs the schedule last set; ``get_last_lr()`` reads the scheduler's
    ``_last_lr`` attribute, which has no public setter (``load_state_dict`` would also need the
    schedule's lambdas, which are not picklable)."""
    scheduler._last_lr = list(lrs)


def bound_worker_shutdown(grace_s: float) -> None:
    """Make the elastic agent kill the remaining local workers ``grace_s`` after one fails.

    The agent's worker context waits on ``torch.multiprocessing``'s ``ProcessContext.join``
    without a grace period, which then waits 30 s between SIGTERM and SIGKILL; a stopped or
    stuck worker (one that never handles SIGTERM) holds the whole job that long. The grace
    period is a parameter of ``join``; the agent just never passes it, so it is defaulted here.
    Affects only this process (the launcher).
    """
    import inspect

    from torch.multiprocessing.spawn import ProcessContext
    join = ProcessContext.join
    if getattr(join, "trainmesh_grace_s", None) == grace_s:
        return
    original = getattr(join, "__wrapped__", join)
    if "grace_period" not in inspect.signature(original).parameters:
        return   # an older torch: its own fixed grace stays

    def bounded_join(self, timeout=None, grace_period=None):
        return original(self, timeout, grace_s if grace_period is None else grace_period)

    bounded_join.__wrapped__ = original  # type: ignore[attr-defined]
    bounded_join.trainmesh_grace_s = grace_s  # type: ignore[attr-defined]
    ProcessContext.join = bounded_join


def cheap_rendezvous_event_names() -> None:
    """Make the elastic rendezvous name its events from the calling frame alone.

    ``dynamic_rendezvous.get_method_name`` runs ``inspect.stack()`` twice for every event the
    rendezvous records (each state change, each keep-alive, the shutdown), even where no event
    handler is set: that builds source context for every frame and walks ``sys.modules`` per
    frame, several CPU-seconds per launch once torch is imported. The name it returns is the
    function ``depth`` frames up, which ``sys._getframe`` gives directly. Affects only this
    process (the launcher); where torch has no such function, nothing changes.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    current = getattr(dynamic_rendezvous, "get_method_name", None)
    if not callable(current) or getattr(current, "trainmesh_frame_name", False):
        return

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:                     # the stack is not that deep
            return "no_method_name"

    get_method_name.trainmesh_frame_name = True  # type: ignore[attr-defined]
    get_method_name.__wrapped__ = current  # type: ignore[attr-defined]
    dynamic_rendezvous.get_method_name = get_method_name


def materialize_empty(module: torch.nn.Module) -> None:
    """Replace every tensor of ``module`` (meta or not) by an uninitialised CPU tensor of its
    shape and dtype, as ``module.to_empty(device="cpu")`` does, without its ``empty_like``: on
    meta tensors that runs torch's Python meta kernels, most of a small model's build time.
    ``Module._apply`` is what ``to_empty`` itself calls; there is no public way to pass it
    another function."""
    module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype), recurse=True)


DEFERRED_IMPORT_BYTES = 72 * 2**20
"""Resident memory :func:`load_lazy_imports` adds on CPU (torch 2.13, measured: 72 MiB)."""


def lazy_imports_loaded() -> bool:
    """Whether this process has already done torch's deferred imports."""
    return "torch._dynamo" in sys.modules


def load_lazy_imports() -> None:
    """Do now the imports torch defers to first use: its optimizers import ``torch._dynamo``
    (about 1.4 CPU-seconds and 72 MiB) in the first ``add_param_group``. A throwaway optimizer
    over one scalar; no thread pool is started. Workers do it before measuring their base
    footprint, so the base means the same however they were started (docs/METRICS.md)."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)


def close_fork_server(wait_s: float = 10.0) -> None:
    """Kill this process's multiprocessing fork server and keep any thread from starting
    another. A fault-tolerant launcher stopping on a signal kills its workers while its
    replicas' agents (threads) still run: an agent seeing its workers killed would start new
    ones through the server as the launcher exits, and they would fail half-started, each
    printing a traceback. multiprocessing has no public way to stop its server; the server's
    lock is taken here and kept, so ``ensure_running`` blocks the agents instead of starting a
    new server (waiting up to ``wait_s`` for an agent holding it)."""
    import os
    import signal
    from multiprocessing import forkserver
    server = forkserver._forkserver
    server._lock.acquire(timeout=wait_s)
    pid, server._forkserver_pid = server._forkserver_pid, None
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):   # gone already, or not this process's child
        pass
