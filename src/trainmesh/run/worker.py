"""The worker side of a launch: what every worker process does first and last.

A local launch (:mod:`trainmesh.run.launch`) starts each worker in :func:`worker_entry`: die
with the launcher, write where it writes, run with its environment and the caller's set-up,
then the run's own main (:class:`WorkerMain`: training, or a fault-tolerant replica), ending
quietly on the errors the launcher's headline already reports. :func:`run_as_worker` is one
worker of a torchrun or srun job.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from trainmesh.config.train import TrainConfig

PR_SET_PDEATHSIG = 1
WORKER_IMAGE = "trainmesh.run.worker_image"
"""What the fork server imports before forking workers
(:func:`trainmesh.run.launch.worker_start_method`)."""


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


def apply_env(env: dict[str, str]) -> None:
    """A worker, first thing: run with ``env`` (:func:`trainmesh.run.launch.worker_env`) and
    what the elastic agent set for this worker (its rank, world size, ...: the variables that
    differ from the environment this process started with, the fork server's or for a spawned
    worker ``env`` itself). Output becomes unbuffered as ``PYTHONUNBUFFERED`` would have made
    it at start-up."""
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


class WorkerMain:
    """What a launched worker runs once its preamble is done: a plain run trains
    (``trainer.worker_main``; the launcher holds the --save-dir lock). Picklable: the
    launcher hands it to every worker."""

    def __call__(self, cfg: TrainConfig) -> int:
        from trainmesh.run.trainer import worker_main
        return worker_main(cfg, lock_save_dir=False)

    def known(self) -> tuple[type[BaseException], ...]:
        """Errors that end the worker without a traceback."""
        from trainmesh.comm.check import CollectiveOrderError
        from trainmesh.core.errors import CommTimeout, DataError
        from trainmesh.run.trainer import NonFiniteError
        return CommTimeout, NonFiniteError, CollectiveOrderError, DataError

    def report(self, exc: BaseException) -> None:
        """How a known error is told: here by nobody else than the launcher's headline, which
        reads it from the error file ``worker_main`` writes."""


def worker_entry(cfg: TrainConfig, launcher_pid: int, setup: Callable[[], None] | None,
                 env: dict[str, str] | None, stdio: Stdio | None, main: WorkerMain) -> int:
    """What each local worker runs: die with the launcher, take the launcher's ``env`` and
    ``stdio``, ``setup()`` (the caller's logging configuration: the library configures none),
    then ``main(cfg)``. A failure ends the worker at once with exit status 1 (the
    interpreter's teardown would first destroy process groups whose peers may be stopped,
    which takes seconds): one of ``main``'s known errors as ``main`` reports it, any other with
    its traceback, once, from this rank."""
    die_with_parent(launcher_pid)
    if stdio is not None:
        stdio.apply()
    if env is not None:
        apply_env(env)
    if setup is not None:
        setup()
    known = main.known()
    try:
        code = main(cfg)
        run_exit_handlers()   # a forked worker ends with os._exit
        return code
    except known as exc:
        main.report(exc)
        end_process(1)
    except Exception:
        traceback.print_exc()
        end_process(1)


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
    return isinstance(exc, WorkerMain().known())


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
