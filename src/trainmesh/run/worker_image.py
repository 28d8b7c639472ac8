"""What every worker needs, imported once by the launcher's fork server.

Workers forked from the server start with torch, torch.distributed and trainmesh's engine and
run loop already imported, and torch's deferred imports done
(:func:`~trainmesh.core.compat.load_lazy_imports`). The server dies with the launcher (the
parent-death signal), and its workers with it."""
import ctypes
import importlib
import signal
import sys

from trainmesh.core.compat import load_lazy_imports
from trainmesh.run.launch import PR_SET_PDEATHSIG

PRELOADED = ("torch.distributed", "trainmesh.run.trainer", "trainmesh.testing")
"""Modules a worker would otherwise import first thing (the trainer; the test helpers' worker)."""

if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
for module in PRELOADED:
    importlib.import_module(module)
load_lazy_imports()
