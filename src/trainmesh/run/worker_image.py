"""What every worker needs, imported once by the launcher's fork server.

Workers forked from the server start with torch, torch.distributed and trainmesh's engine and
run loop already imported, and torch's deferred imports done
(:func:`~trainmesh.core.compat.load_lazy_imports`). The server dies with the launcher (the
parent-death signal), and its workers with it."""
import importlib
import os

from trainmesh.core.compat import load_lazy_imports
from trainmesh.run.worker import kill_with_parent

STARTED_WITH: dict[str, str] = dict(os.environ)
"""The server's environment as it started: what a forked worker's differs from is what the
elastic agent set for it (:func:`trainmesh.run.worker.apply_env`)."""

PRELOADED = ("torch.distributed", "trainmesh.run.trainer", "trainmesh.testing")
"""Modules a worker would otherwise import first thing (the trainer; the test helpers' worker)."""

kill_with_parent()
for module in PRELOADED:
    importlib.import_module(module)
load_lazy_imports()
