"""Local workers through PyTorch's elastic launcher (the machinery behind ``torchrun``).

``trainmesh train`` started directly runs ``dp*pp*tp`` workers under an elastic agent (c10d
rendezvous on loopback); each worker runs :func:`worker_entry` with the ``TrainConfig`` the
launcher already validated. The launcher

- holds the ``--save-dir`` lock for the run's lifetime (:mod:`trainmesh.savedir`);
- hosts the hang-diagnosis store, so a stalled worker cannot block its peers' diagnosis;
- turns a worker failure into exit 1 with a headline naming the rank (the suspect, when a rank
  stopped answering), and kills the remaining workers after a short grace;
- exits 130 after Ctrl-C and 143 after SIGTERM, once every worker is gone.

Workers die with the launcher, even a SIGKILLed one (parent-death signal).
"""
from __future__ import annotations

import ctypes
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from typing import TYPE_CHECKING

from .comm.diagnose import STORE_ENV

if TYPE_CHECKING:
    from .train_config import TrainConfig

SHUTDOWN_GRACE_S = 2
"""After a failure or a signal, seconds the agent gives the other workers to end by themselves
and again after SIGTERM, before SIGKILL. Short: a stopped worker, or one stuck in a collective,
never ends on SIGTERM."""
PR_SET_PDEATHSIG = 1


def _quiet_agent() -> None:
    """The launcher prints one headline per failure; workers print their own tracebacks."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def launch_local(cfg: TrainConfig, *, nproc: int, max_restarts: int = 0) -> int:
    """Run :func:`worker_entry` on ``nproc`` local workers; return the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .compat import bound_worker_shutdown
    from .savedir import SaveDirLock

    with SaveDirLock(cfg.save_dir) if cfg.save_dir else contextlib.nullcontext():
        _quiet_agent()
        bound_worker_shutdown(SHUTDOWN_GRACE_S)
        # Restarted workers must not reuse the dead attempt's store (flaky gloo reconnects otherwise).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        diag_store = _diagnosis_store()   # serves while referenced
        os.environ[STORE_ENV] = f"127.0.0.1:{diag_store.port}"
        grace = ({"shutdown_timeout": SHUTDOWN_GRACE_S}   # where torch has it; else 30 s on signals
                 if "shutdown_timeout" in LaunchConfig.__dataclass_fields__ else {})
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc,
            rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", run_id=f"trainmesh-{uuid.uuid4().hex[:8]}",
            max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn", **grace)
        try:
            elastic_launch(config, worker_entry)(cfg, os.getpid())
        except ChildFailedError as exc:
            sys.stderr.write(f"trainmesh train: {_headline(exc)}\n")
            return 1
        except BaseException as exc:   # noqa: BLE001 - SignalException / KeyboardInterrupt only
            code = _signal_exit_code(exc)
            if code is None:
                raise
            sys.stderr.write(f"trainmesh train: stopped by {signal.Signals(code - 128).name}; "
                             "workers stopped\n")
            return code
    return 0


def _diagnosis_store():
    """A key-value store in this process for the workers' hang diagnosis (see comm.diagnose)."""
    from datetime import timedelta

    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


def _headline(exc) -> str:
    """One line for the first failure: its message when it names a rank itself (a comm failure
    names the rank that stopped answering first), else "rank N failed"."""
    rank, failure = exc.get_first_failure()
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", message)
    text = str(message).strip()
    first = text.splitlines()[0] if text else f"exit code {failure.exitcode}"
    for prefix in ("CommTimeout: ", "NonFiniteError: "):
        first = first.removeprefix(prefix)
    if first.startswith("rank "):
        return f"{first} (exit code {failure.exitcode} of rank {rank})"
    return f"rank {rank} failed (exit code {failure.exitcode}): {first}"


def _signal_exit_code(exc: BaseException) -> int | None:
    """128 + the signal that stopped the launcher (the shell's convention), or None."""
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    from torch.distributed.elastic.multiprocessing.api import SignalException
    if isinstance(exc, SignalException):
        return 128 + int(exc.sigval)
    return None


# ---------------------------------------------------------------- worker side
def worker_entry(cfg: TrainConfig, launcher_pid: int) -> int:
    """What each local worker runs: die with the launcher, then train under ``cfg``."""
    die_with_parent(launcher_pid)
    from .cli.logs import configure_worker_logging
    configure_worker_logging()
    from .errors import CommTimeout
    from .trainer import NonFiniteError, worker_main
    try:
        return worker_main(cfg, lock_save_dir=False)   # the launcher holds the lock
    except (CommTimeout, NonFiniteError):
        raise SystemExit(1) from None   # reported in full by the headline (the error file)
    except Exception:
        traceback.print_exc()           # an unexpected error: its traceback, once, from this rank
        raise SystemExit(1) from None


def die_with_parent(parent_pid: int) -> None:
    """End this process when ``parent_pid`` (its parent) ends, even by SIGKILL.

    Linux: the kernel sends SIGKILL on the parent's death (prctl PR_SET_PDEATHSIG); SIGKILL
    because a worker blocked inside a collective runs no Python signal handler. Elsewhere a
    daemon thread polls the parent pid."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
                if os.getppid() != parent_pid:   # it died before prctl took effect
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                     name="trainmesh-parent-watch").start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)
