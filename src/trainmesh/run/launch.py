"""Local workers through PyTorch's elastic launcher (the machinery behind ``torchrun``).

``trainmesh train`` started directly runs ``dp*cp*pp*tp`` workers under an elastic agent; each
worker runs :func:`worker_entry` with the ``TrainConfig`` the
launcher already validated. The launcher

- holds the ``--save-dir`` lock for the run's lifetime (:mod:`trainmesh.checkpoint.savedir`);
- hosts one key-value store, listening on the loopback address only, on a port the kernel
  picked at bind time (:mod:`trainmesh.core.stores`): torch's dynamic rendezvous runs over it,
  rank 0 hands its process-group store's port to the others through it, and the workers' hang
  diagnosis uses it (so a stalled worker cannot block its peers' diagnosis);
- turns a worker failure into exit 1 with a headline naming the rank (the suspect, when a rank
  stopped answering), and kills the remaining workers after a short grace;
- exits 130 after Ctrl-C and 143 after SIGTERM, once every worker is gone.

Workers are forked by a server that imported torch and trainmesh once
(:func:`worker_start_method`), and die with the launcher, even a SIGKILLed one (parent-death
signal).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.util
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from trainmesh.core.stores import LOOPBACK, STORE_ENV, server_store

if TYPE_CHECKING:
    from trainmesh.config.train import TrainConfig

SHUTDOWN_GRACE_S = 2
"""After a signal (Ctrl-C, SIGTERM), seconds the agent gives the workers to end after SIGTERM,
before SIGKILL."""
FAILURE_GRACE_S = 0.25
"""After a worker failed, seconds the agent gives the others to end by themselves, and again
after SIGTERM, before SIGKILL. Short: the failure is already recorded, and a stopped worker, or
one stuck in a collective, never ends on SIGTERM."""
MONITOR_INTERVAL_S = 0.1
"""How often the agent checks its workers."""
PR_SET_PDEATHSIG = 1
WORKER_IMAGE = "trainmesh.run.worker_image"
"""What the fork server imports before forking workers (see :func:`worker_start_method`)."""
RDZV_BACKEND = "trainmesh-loopback"
"""The elastic agent's rendezvous: torch's dynamic rendezvous over the launcher's own store."""


def _prepare_agent() -> None:
    """This process as torch's elastic agent runs in it: quiet (the launcher prints one headline
    per failure; workers print their own tracebacks), the remaining workers killed
    FAILURE_GRACE_S after one fails, and rendezvous events named without walking the stack."""
    from trainmesh.core.compat import bound_worker_shutdown, cheap_rendezvous_event_names
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    bound_worker_shutdown(FAILURE_GRACE_S)
    cheap_rendezvous_event_names()


HF_PRELOAD = "transformers.modeling_utils"
"""What every worker of a ``--model-dir`` run imports first (transformers and its model base
class: about 4 CPU-seconds and 100 MiB per process), imported once by that run's fork server."""


def worker_start_method(model_dir: bool = False) -> str:
    """How the elastic agent starts workers: forked by a server process that imported torch and
    trainmesh once (:mod:`trainmesh.run.worker_image`), and for a ``--model-dir`` run
    transformers (:data:`HF_PRELOAD`, where installed), where the platform has one
    (``forkserver``), so each worker skips those imports; else ``spawn``. The server starts
    from a clean interpreter (no threads, no sockets of this process) and ends with this
    process."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    hub = model_dir and importlib.util.find_spec("transformers") is not None
    multiprocessing.set_forkserver_preload([WORKER_IMAGE, *([HF_PRELOAD] if hub else [])])
    return "forkserver"


def launch_local(cfg: TrainConfig, *, nproc: int, max_restarts: int = 0,
                 end_process_on_failure: bool = True,
                 worker_setup: Callable[[], None] | None = None) -> int:
    """Run :func:`worker_entry` on ``nproc`` local workers; return the exit code.

    A failed or signalled run ends this process right there (``end_process_on_failure``), once
    the headline is written, the ``--save-dir`` lock released and the exit handlers run: the
    interpreter's own teardown after importing torch takes seconds on a loaded machine."""
    code = _launch(cfg, nproc=nproc, max_restarts=max_restarts, worker_setup=worker_setup)
    if code and end_process_on_failure:
        end_process(code)
    return code


def end_process(code: int) -> NoReturn:
    """Exit now with ``code``: exit handlers run and output flushed, module teardown skipped."""
    run_exit_handlers()
    os._exit(code)


def run_exit_handlers() -> None:
    """Run what ``atexit`` holds (once: it empties) and flush the output. A worker forked by the
    fork server ends with ``os._exit``, which runs none: it calls this as it finishes, as a
    spawned worker's interpreter would at exit (e.g. the NVMe offload files' removal)."""
    import atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


def _launch(cfg: TrainConfig, *, nproc: int, max_restarts: int,
            worker_setup: Callable[[], None] | None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from trainmesh.checkpoint.savedir import SaveDirLock

    with SaveDirLock(cfg.save_dir) if cfg.save_dir else contextlib.nullcontext():
        _prepare_agent()
        grace = ({"shutdown_timeout": SHUTDOWN_GRACE_S}   # where torch has it; else 30 s on signals
                 if "shutdown_timeout" in LaunchConfig.__dataclass_fields__ else {})
        with local_rendezvous() as rendezvous:
            config = LaunchConfig(
                min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"trainmesh-{uuid.uuid4().hex[:8]}",
                max_restarts=max_restarts, monitor_interval=MONITOR_INTERVAL_S, start_method=worker_start_method(cfg.model_dir is not None),
                **rendezvous, **grace)
            env = worker_env(rendezvous, threads=max(1, (os.cpu_count() or 1) // nproc))
            try:
                elastic_launch(config, worker_entry)(cfg, os.getpid(), worker_setup, env, Stdio())
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


@contextlib.contextmanager
def local_rendezvous(timeout_s: float = 600.0) -> Iterator[dict[str, Any]]:
    """The rendezvous fields of a single-node ``LaunchConfig``, over a store this process serves
    on the loopback address (port picked by the kernel at bind time) until the block ends.

    Workers started inside the block find the store through ``TRAINMESH_LAUNCHER_STORE``, which
    :func:`worker_env` gives them. The agent's own store sharing must be off
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, read by torch's rendezvous in this process: the
    shared store would listen on every interface); rank 0 of the workers then serves the process
    group's store on loopback (:func:`trainmesh.core.stores.process_group_store`)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    rendezvous_handler_registry.register(RDZV_BACKEND, _loopback_rendezvous)
    store = server_store(LOOPBACK, timeout_s=timeout_s, multi_tenant=True)
    yield {"rdzv_backend": RDZV_BACKEND, "rdzv_endpoint": f"{LOOPBACK}:{store.port}",
           "rdzv_configs": {"store": store}, "local_addr": LOOPBACK}


def worker_env(rendezvous: dict[str, Any], *, threads: int) -> dict[str, str]:
    """The environment the launcher's workers run with (:func:`apply_env`): the launcher's own
    as it is now, with the launcher's store (``TRAINMESH_LAUNCHER_STORE``) and, unless already
    set, ``threads`` OpenMP threads and unbuffered output. Passed as an argument of the workers'
    entry point: a fork server holds the environment of its own start, which an earlier launch
    from the same process may have left behind; the launcher's own environment is left as it was."""
    env = {**os.environ, STORE_ENV: rendezvous["rdzv_endpoint"]}
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def apply_env(env: dict[str, str]) -> None:
    """A worker, first thing: run with ``env`` (:func:`worker_env`) and what the elastic agent set
    for this worker (its rank, world size, ...: the variables that differ from the environment
    this process started with, the fork server's or for a spawned worker ``env`` itself). Output
    becomes unbuffered as ``PYTHONUNBUFFERED`` would have made it at start-up."""
    started = getattr(sys.modules.get(WORKER_IMAGE), "STARTED_WITH", env)
    agent = {name: value for name, value in os.environ.items() if started.get(name) != value}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(agent)
    if env.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(write_through=True)


@dataclasses.dataclass
class Stdio:
    """The launcher's standard output and error, handed to its workers (:func:`worker_entry`):
    a fork server started earlier holds the ones of its own start. Pickled for the worker as
    duplicates of the descriptors (``multiprocessing.reduction.DupFd``)."""

    out: int = 1
    err: int = 2

    def __reduce__(self):
        from multiprocessing.reduction import DupFd
        return _stdio_in_worker, (DupFd(self.out), DupFd(self.err))

    def apply(self) -> None:
        """A worker: write where the launcher writes."""
        for fd, target in ((self.out, 1), (self.err, 2)):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _stdio_in_worker(out, err) -> Stdio:
    return Stdio(out.detach(), err.detach())


def _loopback_rendezvous(params):
    """torch's dynamic rendezvous handler over the store in ``params`` (see local_rendezvous)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:   # the registry checks the handler's backend against its key
            return RDZV_BACKEND

    store = params.config["store"]
    return create_handler(store, LoopbackBackend(store, params.run_id), params)


def _headline(exc) -> str:
    """One line for the first failure: its message when it names a rank itself (a comm failure
    names the rank that stopped answering first), else "rank N failed"."""
    rank, failure = exc.get_first_failure()
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", message)
    text = str(message).strip()
    first = text.splitlines()[0] if text else f"exit code {failure.exitcode}"
    for prefix in ("CommTimeout: ", "NonFiniteError: ", "DataError: "):
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
def worker_entry(cfg: TrainConfig, launcher_pid: int,
                 setup: Callable[[], None] | None = None, env: dict[str, str] | None = None,
                 stdio: Stdio | None = None) -> int:
    """What each local worker runs: die with the launcher, take the launcher's ``env``
    (:func:`worker_env`) and ``stdio``, ``setup()`` (the caller's logging configuration: the
    library configures none), then train under ``cfg``."""
    die_with_parent(launcher_pid)
    if stdio is not None:
        stdio.apply()
    if env is not None:
        apply_env(env)
    if setup is not None:
        setup()
    from trainmesh.comm.check import CollectiveOrderError
    from trainmesh.core.errors import CommTimeout, DataError
    from trainmesh.run.trainer import NonFiniteError, worker_main
    try:
        code = worker_main(cfg, lock_save_dir=False)   # the launcher holds the lock
        run_exit_handlers()
        return code
    except (CommTimeout, NonFiniteError, CollectiveOrderError, DataError):
        _exit_failed()                  # reported in full by the headline (the error file)
    except Exception:
        traceback.print_exc()           # an unexpected error: its traceback, once, from this rank
        _exit_failed()


DEBUG_ENV = "TRAINMESH_DEBUG"
"""``TRAINMESH_DEBUG=1``: a failing worker of torchrun or srun prints its traceback too."""


def run_as_worker(cfg: TrainConfig, *, verbose: bool = False) -> int:
    """One worker of a torchrun or srun job: train under ``cfg``. A failure ends it with exit 1
    and one line on stderr naming this rank, its host and the cause (a peer that stopped
    answering is named with its host); the traceback follows only with ``verbose`` or
    ``TRAINMESH_DEBUG=1``. Invalid input (``ConfigError``) is left to the command line (exit 2)."""
    from trainmesh.core.distributed import launcher_job
    from trainmesh.core.errors import ConfigError
    from trainmesh.run.trainer import worker_main
    # torchrun prints the error file that @record writes, traceback included: not used here
    train = getattr(worker_main, "__wrapped__", worker_main)
    try:
        return train(cfg)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line
        job = launcher_job()
        debug = verbose or os.environ.get(DEBUG_ENV, "") not in ("", "0")
        hint = "" if debug or _known(exc) else f" (--verbose or {DEBUG_ENV}=1: the traceback)"
        sys.stderr.write(f"trainmesh train: {failure_line(exc, job.rank if job else 0)}{hint}\n")
        if debug:
            traceback.print_exc()
        end_process(1)


def _known(exc: BaseException) -> bool:
    """Failures whose one line says it all (no hint about the traceback)."""
    from trainmesh.comm.check import CollectiveOrderError
    from trainmesh.core.errors import CommTimeout, DataError
    from trainmesh.run.trainer import NonFiniteError
    return isinstance(exc, (CommTimeout, NonFiniteError, CollectiveOrderError, DataError))


def failure_line(exc: BaseException, rank: int) -> str:
    """One line for a failed worker: the error's own first line where it names the ranks
    (a comm failure), else ``rank R on HOST failed: Type: first line``."""
    import socket
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if _known(exc) and first.startswith("rank "):
        return first
    what = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    if _known(exc):
        what = first or what
    return f"rank {rank} on {socket.gethostname()} failed: {what}"


def _exit_failed() -> NoReturn:
    """End a failed worker at once, exit status 1. Its error is already recorded (the error
    file ``worker_main`` writes, stderr); the interpreter's teardown would first destroy process
    groups whose peers may be stopped, which takes seconds."""
    end_process(1)


def die_with_parent(launcher_pid: int) -> None:
    """End this worker when the launcher ``launcher_pid`` ends, even by SIGKILL.

    Linux: the kernel sends SIGKILL when the worker's parent dies (prctl PR_SET_PDEATHSIG);
    SIGKILL because a worker blocked inside a collective runs no Python signal handler. The
    parent is the launcher, or its fork server, which the same signal ends with the launcher
    (:mod:`trainmesh.run.worker_image`). Elsewhere, and where the parent is some other
    process (a fork server that outlives this launcher), a daemon thread polls the launcher."""
    if kill_with_parent():
        if not _alive(launcher_pid):   # it died before prctl took effect
            os._exit(1)
        parent = os.getppid()
        if parent == launcher_pid or (WORKER_IMAGE in sys.modules and _parent_of(parent) == launcher_pid):
            return                                                        # or its fork server
    threading.Thread(target=_watch_launcher, args=(launcher_pid,), daemon=True,
                     name="trainmesh-launcher-watch").start()


def kill_with_parent() -> bool:
    """Linux: have the kernel SIGKILL this process when its parent dies (prctl
    PR_SET_PDEATHSIG); whether that took. Elsewhere False."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(
            PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` (Linux /proc), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _watch_launcher(launcher_pid: int) -> None:
    while _alive(launcher_pid):
        time.sleep(0.5)
    os._exit(1)
