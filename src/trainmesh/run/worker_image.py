"""What every worker needs, imported once by the launcher's fork server.

Workers forked from the server start with torch, torch.distributed and trainmesh's engine and
run loop already imported, and torch's deferred imports done
(:func:`~trainmesh.core.compat.load_lazy_imports`). The server dies with the
launcher (the parent-death signal), and its workers with it."""
import ctypes
import signal
import sys

import torch
import torch.distributed

import trainmesh.run.launch as launch
from trainmesh.core.compat import load_lazy_imports
import trainmesh.run.trainer  # noqa: F401

if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(launch.PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

load_lazy_imports()
