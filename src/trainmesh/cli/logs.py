"""Logging of a ``trainmesh train`` worker, set up by the command line (never by the library).

The library logs to the ``trainmesh`` logger and leaves its configuration to the application;
the command line gives that logger one plain handler on stdout: INFO on rank 0, warnings only
on the other ranks (one rank speaks for the job).
"""
from __future__ import annotations

import logging
import os
import sys


class _WorkerHandler(logging.StreamHandler):
    """The handler this module adds (found again on a second call: set-up is idempotent)."""


def configure_worker_logging(rank: int | None = None) -> None:
    """The ``trainmesh`` logger of this worker (``rank``: from ``RANK`` / ``SLURM_PROCID``)."""
    if rank is None:
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    log = logging.getLogger("trainmesh")
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if not any(isinstance(h, _WorkerHandler) for h in log.handlers):
        handler = _WorkerHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
