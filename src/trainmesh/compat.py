"""Small accessors for private or version-dependent torch APIs, each with the reason it exists.

Everything here may break with a torch release; keeping it in one place makes that one fix.
"""
from __future__ import annotations

from typing import Any


def default_store() -> Any | None:
    """The default process group's key-value store, or None without one.

    Hang diagnosis needs a store that every rank already reaches; torch has no public getter
    for the default group's store (``torch.distributed.distributed_c10d._get_default_store``).
    """
    try:
        import torch.distributed as dist
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group, or a torch without the helper
        return None


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
