"""Local workers through PyTorch's elastic launcher (the machinery behind ``torchrun``).

``trainmesh train`` started directly runs its workers under elastic agents; each worker runs
:func:`~trainmesh.run.worker.worker_entry` with the ``TrainConfig`` the launcher already
validated. One launcher (:func:`launch`) serves every kind of run; a kind shapes it through the
hooks of :class:`Launch` (the plain run: the hooks as they are; fault tolerance:
:mod:`trainmesh.run.ft_launch`). The launcher

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
import importlib.util
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from trainmesh.core.stores import LOOPBACK, STORE_ENV, server_store
from trainmesh.run.worker import (  # noqa: F401 - WORKER_IMAGE, apply_env: their old home
    WORKER_IMAGE,
    Stdio,
    WorkerMain,
    apply_env,
    end_process,
    run_exit_handlers,
    worker_entry,
)

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


class Launch:
    """One launch of ``cfg``'s workers, and the hooks through which a kind of run shapes it.

    As it is, the plain run: one elastic agent for the job's ``nproc`` workers, in the main
    thread (torch's agent turns Ctrl-C and SIGTERM into an exception and stops the workers
    within :data:`SHUTDOWN_GRACE_S`), each worker training (:class:`WorkerMain`); a failed
    worker's headline is the run's last line. Fault tolerance overrides the hooks
    (:class:`trainmesh.run.ft_launch.FaultTolerantLaunch`)."""

    threaded = False
    """Each agent a thread of this process (several agents, one per replica), the main thread
    taking the signals itself and stopping the workers."""

    def __init__(self, cfg: TrainConfig, *, nproc: int | None = None) -> None:
        self.cfg = cfg
        self.nproc = cfg.parallel.world_size if nproc is None else nproc
        """Workers per agent."""
        self.launch_id = uuid.uuid4().hex[:8]

    def agents(self) -> list[int]:
        """One elastic agent per item (the replica it runs)."""
        return [0]

    def begin(self) -> None:
        """First thing, before the --save-dir lock is taken."""

    def save_dir(self) -> tuple[bool, bool]:
        """Whether this launcher holds the --save-dir lock for the run, and whether it removes
        what interrupted saves left first (a plain run's rank 0 does, as under torchrun)."""
        return self.cfg.save_dir is not None, False

    def serve(self) -> dict[str, str]:
        """Before any agent: what the workers need served; returns what their environment
        adds to the launcher's (:func:`worker_env`)."""
        return {}

    def run_id(self, agent: int) -> str:
        """The rendezvous run id of ``agent``."""
        return f"trainmesh-{self.launch_id}"

    def worker(self, agent: int) -> WorkerMain:
        """What the workers of ``agent`` run once their preamble is done."""
        return WorkerMain()

    def started(self) -> None:
        """The agents start now."""

    def failed(self, agent: int, headline: str) -> str:
        """The line for a worker of ``agent`` that failed (``headline``: its rank and error)."""
        return headline

    def agent_failed(self, agent: int, exc: Exception) -> str:
        """The line for a threaded ``agent`` that failed itself."""
        return f"agent {agent} failed: {exc}"

    def finish(self, failures: dict[int, str]) -> int:
        """Once every agent ended (``failures``: agent -> line): the exit status."""
        for why in failures.values():
            sys.stderr.write(f"trainmesh train: {why}\n")
        return 1 if failures else 0


def launch_local(cfg: TrainConfig, *, nproc: int | None = None, max_restarts: int = 0,
                 end_process_on_failure: bool = True,
                 worker_setup: Callable[[], None] | None = None) -> int:
    """Train under ``cfg`` on ``nproc`` local workers (default: the layout's world size), the
    plain run; return the exit code."""
    return launch(Launch(cfg, nproc=nproc), max_restarts=max_restarts, worker_setup=worker_setup,
                  end_process_on_failure=end_process_on_failure)


def launch(run: Launch, *, max_restarts: int, worker_setup: Callable[[], None] | None = None,
           end_process_on_failure: bool = True) -> int:
    """Run ``run``'s agents until their workers end; return the exit code (``run.finish``; 1
    with a headline after a failure, 128 + the signal after Ctrl-C or SIGTERM).

    A failed or signalled run ends this process right there (``end_process_on_failure``), once
    the headline is written, the ``--save-dir`` lock released and the exit handlers run: the
    interpreter's own teardown after importing torch takes seconds on a loaded machine."""
    code = _launch(run, max_restarts=max_restarts, worker_setup=worker_setup)
    if code and end_process_on_failure:
        end_process(code)
    return code


def _launch(run: Launch, *, max_restarts: int, worker_setup: Callable[[], None] | None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cfg, failures = run.cfg, {}
    _prepare_agent()
    run.begin()
    if run.threaded:   # the agents are threads: the main thread takes the signals
        _signals_raise()
    grace = ({"shutdown_timeout": SHUTDOWN_GRACE_S}   # where torch has it; else 30 s on signals
             if "shutdown_timeout" in LaunchConfig.__dataclass_fields__ else {})
    try:
        with _save_dir_held(cfg, *run.save_dir()):
            served = run.serve()
            with local_rendezvous() as rendezvous:
                agents = run.agents()
                start_method = worker_start_method(cfg.model_dir is not None)
                threads = max(1, (os.cpu_count() or 1) // (run.nproc * len(agents)))
                env = {**worker_env(rendezvous, threads=threads), **served}

                def agent(a: int) -> None:
                    config = LaunchConfig(
                        min_nodes=1, max_nodes=1, nproc_per_node=run.nproc, run_id=run.run_id(a),
                        max_restarts=max_restarts, monitor_interval=MONITOR_INTERVAL_S,
                        start_method=start_method, **rendezvous, **grace)
                    try:
                        elastic_launch(config, worker_entry)(cfg, os.getpid(), worker_setup, env,
                                                             Stdio(), run.worker(a))
                    except ChildFailedError as exc:
                        failures[a] = run.failed(a, _headline(exc))

                if run.threaded and start_method == "forkserver":
                    # the fork server dies with the thread that started it: this one, which
                    # outlives every agent's
                    multiprocessing.forkserver.ensure_running()
                run.started()
                if run.threaded:
                    _in_threads(run, agent, agents, failures)
                else:
                    agent(agents[0])
    except BaseException as exc:   # noqa: BLE001 - a signal's exception only
        code = _signal_exit_code(exc)
        if code is None:
            raise
        if run.threaded:
            _stop_workers()
        sys.stderr.write(f"trainmesh train: stopped by {signal.Signals(code - 128).name}; "
                         "workers stopped\n")
        return code
    return run.finish(failures)


def _in_threads(run: Launch, agent: Callable[[int], None], agents: list[int],
                failures: dict[int, str]) -> None:
    """Each agent in a thread of its own, until every one ended (an agent that fails itself is
    one more failure, not the launcher's)."""
    def guarded(a: int) -> None:
        try:
            agent(a)
        except Exception as exc:   # noqa: BLE001 - the agent itself failed
            failures[a] = run.agent_failed(a, exc)

    threads = [threading.Thread(target=guarded, args=(a,), name=f"{run.run_id(a)}-agent",
                                daemon=True) for a in agents]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(0.2)


@contextlib.contextmanager
def _save_dir_held(cfg: TrainConfig, lock: bool, clean: bool) -> Iterator[None]:
    """The --save-dir lock held for the block (``lock``), what interrupted saves left removed
    first (``clean``)."""
    if not (cfg.save_dir and lock):
        yield
        return
    from trainmesh.checkpoint.savedir import SaveDirLock, remove_stale_tmp
    with SaveDirLock(cfg.save_dir):
        for path in remove_stale_tmp(Path(cfg.save_dir)) if clean else ():
            print(f"trainmesh: removed {path}, left by an interrupted save", flush=True)
        yield


class _Signalled(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _signals_raise() -> None:
    """Ctrl-C and SIGTERM end the launcher (as :class:`_Signalled`); the workers die with it
    (parent-death signal)."""
    def raise_(signum: int, _frame: Any) -> NoReturn:
        raise _Signalled(signum)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, raise_)


def _stop_workers() -> None:
    """Threaded agents: stop the workers from here."""
    from trainmesh.core.compat import close_fork_server
    close_fork_server()      # first: no agent restarts a worker that dies now
    for worker in multiprocessing.active_children():   # (exit would wait for them)
        worker.kill()


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
    if isinstance(exc, _Signalled):
        return 128 + exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    from torch.distributed.elastic.multiprocessing.api import SignalException
    if isinstance(exc, SignalException):
        return 128 + int(exc.sigval)
    return None
