"""The local launcher of a ``--fault-tolerant`` run: one elastic agent per replica of this
host, and, on one host, the coordinator (docs/FAULT_TOLERANCE.md).

Each replica runs under its own PyTorch elastic agent (a thread of this process, one worker
per rank of the replica; its own rendezvous run id over the launcher's loopback store), so the
agent of a failed replica restarts that replica (all its ranks) alone (``--max-restarts``,
:data:`FT_MAX_RESTARTS` by default) while the others go on.

- One host (no ``--coordinator``): every replica runs here, and so does the coordinator
  (:mod:`trainmesh.fault_tolerance.coordinator`, a thread listening on loopback), which
  decides every step's quorum and commit and writes the metrics file from the records the
  replicas post; this module adds the summary.
- Across hosts (``--coordinator HOST:PORT --replica-id I``): replica I runs here and writes its
  own metrics file; the coordinator is a ``trainmesh coordinator`` process elsewhere.

Exit status: 0 when the last step was committed (a replica whose agent gave up is reported in
one line); 1 when the run could not go on, with the coordinator's reason or the first failed
replica's headline; 130/143 after Ctrl-C/SIGTERM (workers die with this process).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from trainmesh.run.launch import (
    MONITOR_INTERVAL_S,
    SHUTDOWN_GRACE_S,
    Stdio,
    _headline,
    _prepare_agent,
    apply_env,
    die_with_parent,
    end_process,
    local_rendezvous,
    run_exit_handlers,
    worker_env,
    worker_start_method,
)

if TYPE_CHECKING:
    from trainmesh.config.train import TrainConfig

FT_MAX_RESTARTS = 3
"""Restarts of each replica when ``--max-restarts`` is not given with ``--fault-tolerant``."""
STARTUP_TIMEOUT_S = 300.0
"""How long the first quorum waits for every replica to start."""


def launch_fault_tolerant(cfg: TrainConfig, *, max_restarts: int,
                          worker_setup: Callable[[], None] | None = None) -> int:
    """Run the replicas and the coordinator until the last step; the exit code (a failure or a
    signal ends this process right there, as :func:`~trainmesh.run.launch.launch_local`).
    The job's secret: a run on one host makes its own; across hosts it is given
    (``--secret-file`` or ``TRAINMESH_FT_SECRET``; none: :class:`ConfigError`, exit 2, before
    anything starts)."""
    from trainmesh.fault_tolerance.auth import load_secret, new_secret
    secret = new_secret() if cfg.coordinator is None else load_secret(cfg.secret_file)
    code = _launch(cfg, secret, max_restarts=max_restarts, worker_setup=worker_setup)
    if code:
        end_process(code)
    return code


def _launch(cfg: TrainConfig, secret: str, *, max_restarts: int,
            worker_setup: Callable[[], None] | None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from trainmesh.core.compat import close_fork_server
    from trainmesh.fault_tolerance.auth import SECRET_ENV

    p = cfg.parallel
    _prepare_agent()
    grace = ({"shutdown_timeout": SHUTDOWN_GRACE_S}
             if "shutdown_timeout" in LaunchConfig.__dataclass_fields__ else {})
    ranks = p.replica_ranks
    here = list(range(p.replicas)) if cfg.coordinator is None else [cfg.replica_id]
    failures: dict[int, str] = {}
    launcher_id = uuid.uuid4().hex[:8]
    run_id = f"trainmesh-ft-{launcher_id}"
    _print_header(cfg)
    began = time.perf_counter()
    _signals_raise()
    lock = _save_dir_lock(cfg)
    try:
        coordinator, board = _local_coordinator(cfg, secret) if cfg.coordinator is None else (None, None)
        address = coordinator.address if coordinator is not None else cfg.coordinator
        with local_rendezvous() as rendezvous:
            env = worker_env(rendezvous, threads=max(1, (os.cpu_count() or 1) // (ranks * len(here))))
            env[SECRET_ENV] = secret   # the workers' only copy (their environment, not argv)
            start_method = worker_start_method()
            if start_method == "forkserver":   # started here: it dies with this thread, which
                multiprocessing.forkserver.ensure_running()   # outlives every agent's thread

            def agent(replica: int) -> None:
                config = LaunchConfig(
                    min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=f"{run_id}-r{replica}",
                    max_restarts=max_restarts, monitor_interval=MONITOR_INTERVAL_S,
                    start_method=start_method, **rendezvous, **grace)
                try:
                    elastic_launch(config, ft_worker_entry)(cfg, os.getpid(), worker_setup, replica,
                                                            address, launcher_id, env, Stdio())
                except ChildFailedError as exc:
                    failures[replica] = (_headline(exc).replace("rank 0", f"replica {replica}", 1)
                                         if ranks == 1 else f"replica {replica}: {_headline(exc)}")
                except Exception as exc:   # noqa: BLE001 - the agent itself failed
                    failures[replica] = f"replica {replica}: agent failed: {exc}"

            agents = [threading.Thread(target=agent, args=(r,), name=f"trainmesh-ft-agent-{r}",
                                       daemon=True) for r in here]
            if coordinator is not None:
                coordinator.start()
            for t in agents:
                t.start()
            while any(t.is_alive() for t in agents):
                for t in agents:
                    t.join(0.2)
    except _Signalled as exc:   # the agents are threads: the workers are stopped here
        close_fork_server()      # first: no agent restarts a replica whose workers die now
        for worker in multiprocessing.active_children():   # (exit would wait for them)
            worker.kill()
        sys.stderr.write(f"trainmesh train: stopped by {signal.Signals(exc.signum).name}; "
                         "workers stopped\n")
        return 128 + exc.signum
    finally:
        lock.__exit__(None, None, None)
    if coordinator is None:   # across hosts: this host's replica reported its own run
        for why in failures.values():
            sys.stderr.write(f"trainmesh train: {why}\n")
        return 1 if failures else 0
    return _finish(cfg, coordinator, board, failures, began)


def _save_dir_lock(cfg: TrainConfig) -> Any:
    """A run on one host holds the --save-dir lock for its replicas, removing what interrupted
    saves left first (across hosts the replicas share the directory: no lock, nothing removed:
    a peer may be writing)."""
    from pathlib import Path

    from trainmesh.checkpoint.savedir import SaveDirLock, remove_stale_tmp
    if not cfg.save_dir or cfg.coordinator is not None:
        return contextlib.nullcontext()
    lock = SaveDirLock(cfg.save_dir).__enter__()
    for path in remove_stale_tmp(Path(cfg.save_dir)):
        print(f"trainmesh: removed {path}, left by an interrupted save", flush=True)
    return lock


def _local_coordinator(cfg: TrainConfig, secret: str) -> tuple[Any, Any]:
    """The coordinator of a run on one host: a thread of this process, on loopback (its address
    printed on stderr); it writes the metrics file and hands each record to the run's
    TensorBoard (``board``)."""
    from trainmesh.fault_tolerance.coordinator import Coordinator
    from trainmesh.observe.layout import layout_record
    from trainmesh.observe.tensorboard import TensorBoardLog
    board = TensorBoardLog(cfg.tensorboard, layout_record(cfg))
    coordinator = Coordinator(replicas=cfg.parallel.replicas, secret=secret,
                              last=cfg.exit_after or cfg.steps,
                              metrics_out=cfg.metrics_out, startup_timeout_s=STARTUP_TIMEOUT_S,
                              step_timeout_s=cfg.parallel.timeout_s + 30,
                              notify=lambda line: print(line, file=sys.stderr, flush=True),
                              also=board.record)
    print(f"trainmesh: fault-tolerance coordinator serving {coordinator.address} (loopback)",
          file=sys.stderr, flush=True)
    return coordinator, board


def _finish(cfg: TrainConfig, coordinator: Any, board: Any, failures: dict[int, str],
            began: float) -> int:
    """A run on one host: the records still to write, the summary, the exit status."""
    coordinator.stop()
    coordinator.join(5.0)
    coordinator.drain()
    p = cfg.parallel
    last = cfg.exit_after or cfg.steps
    summary = _summary(cfg, coordinator, failures)
    coordinator.metrics.write(summary)
    board.close(summary)
    if coordinator.committed < last:
        why = coordinator.error or next(iter(failures.values()), "every replica ended early")
        sys.stderr.write(f"trainmesh train: {why} (fault-tolerant run stopped after step "
                         f"{coordinator.committed} of {last})\n")
        return 1
    t = coordinator.tally
    print(f"trainmesh: {last} steps in {time.perf_counter() - began:.1f} s, final loss "
          f"{coordinator.final_loss:.4f}; {t.failed_attempts} step attempts discarded, "
          f"{t.degraded_steps} steps with fewer than {p.replicas} replicas", flush=True)
    for why in failures.values():
        sys.stderr.write(f"trainmesh train: warning: {why}; the run finished without it\n")
    from trainmesh.observe.progress import outputs_of, print_outputs
    print_outputs(outputs_of(cfg))
    return 0


def _print_header(cfg: TrainConfig) -> None:
    """The run's first line, as every ``trainmesh train`` prints it (the layout in full)."""
    from trainmesh.core.distributed import choose_device, visible_gpus
    from trainmesh.observe.layout import layout_record
    from trainmesh.observe.progress import run_header
    device, _ = choose_device(cfg.device, local_ranks=cfg.parallel.world_size, gpus=visible_gpus())
    print(run_header(params=cfg.num_params(), world=cfg.parallel.world_size,
                     layout=layout_record(cfg), steps=cfg.exit_after or cfg.steps, start=1,
                     device=device), flush=True)


def _summary(cfg: TrainConfig, coordinator: Any, failures: dict[int, str]) -> dict[str, Any]:
    from trainmesh.observe.layout import layout_record
    t, ranks = coordinator.tally, cfg.parallel.replica_ranks
    return {"event": "summary", "world_size": cfg.parallel.world_size,
            "layout": layout_record(cfg),
            "params": cfg.num_params(), "final_loss": coordinator.final_loss,
            "steps": coordinator.committed,
            "ranks": [{"rank": r * ranks, "replica": r, "pids": t.pids.get(r, []),
                       "restarts": max(0, len(t.pids.get(r, [])) // ranks - 1),
                       **({"failed": failures[r]} if r in failures else {})}
                      for r in range(cfg.parallel.replicas)],
            "fault_tolerance": {"degraded_steps": t.degraded_steps,
                                "failed_attempts": t.failed_attempts,
                                "recovery_s": round(t.recovery_s, 3),
                                "state_transfer_s": round(t.transfer_s, 3)}}


class _Signalled(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _signals_raise() -> None:
    """Ctrl-C and SIGTERM end the launcher (the agents run in threads: the main thread takes
    the signal); the workers die with it (parent-death signal)."""
    def raise_(signum: int, _frame: Any) -> NoReturn:
        raise _Signalled(signum)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, raise_)


def ft_worker_entry(cfg: TrainConfig, launcher_pid: int, setup: Callable[[], None] | None,
                    replica: int, address: str, launcher_id: str, env: dict[str, str],
                    stdio: Stdio | None = None) -> int:
    """What each replica's worker runs (see :func:`~trainmesh.run.launch.worker_entry`: the
    launcher's environment and output, whichever fork server forked it)."""
    die_with_parent(launcher_pid)
    if stdio is not None:
        stdio.apply()
    apply_env(env)
    if setup is not None:
        setup()
    from torch.distributed.elastic.multiprocessing.errors import record

    from trainmesh.fault_tolerance.replica import ProtocolMismatch
    from trainmesh.run.ft_steps import ReplicaRankLost
    try:
        code = record(ft_worker_main)(cfg, replica, address, launcher_id,
                                      own_records=cfg.coordinator is not None)
        run_exit_handlers()   # a forked worker ends with os._exit
        return code
    except (ReplicaRankLost, ProtocolMismatch) as exc:
        sys.stderr.write(f"trainmesh: {exc}\n")
        end_process(1)
    except Exception:
        traceback.print_exc()
        end_process(1)


def ft_worker_main(cfg: TrainConfig, replica: int, coordinator: str, launcher_id: str, *,
                   own_records: bool) -> int:
    """Rank ``LOCAL_RANK`` of replica ``replica`` of the run whose coordinator serves one of
    ``coordinator``'s addresses. ``own_records``: the replica writes its own metrics file (a
    run across hosts), else it posts its records to the coordinator (a run on one host)."""
    import dataclasses
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from trainmesh.core.distributed import pick_device, worker_threads
    from trainmesh.core.interfaces import bind_backends, loopback_interface
    from trainmesh.core.stores import STORE_ENV, client_store
    from trainmesh.fault_tolerance.auth import SECRET_ENV
    from trainmesh.fault_tolerance.replica import QuorumClient
    from trainmesh.run.ft_steps import QuorumSteps
    from trainmesh.run.trainer import _train
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: os._exit(128 + signum))
    torch.set_num_threads(worker_threads())
    device = pick_device(cfg.device)
    ranks, rank = cfg.parallel.replica_ranks, int(os.environ.get("LOCAL_RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    incarnation = f"{launcher_id}.{restart}"
    client = QuorumClient(coordinator, replica, incarnation, secret=os.environ[SECRET_ENV],
                          replicas=cfg.parallel.replicas, last=cfg.exit_after or cfg.steps,
                          timeout_s=cfg.parallel.timeout_s, rank=rank)
    # the replica's own group, in this incarnation, over its launcher's store (one rank: alone):
    # its ranks all sit on this host, so the backends listen on loopback (as a local run's); the
    # groups across replicas listen on the address towards the coordinator (QuorumClient)
    bind_backends(loopback_interface())
    store = (dist.HashStore() if ranks == 1 else
             dist.PrefixStore(f"ft/{replica}/{incarnation}",
                              client_store(os.environ[STORE_ENV], timeout_s=client.startup_timeout_s)))
    timeout = timedelta(seconds=cfg.parallel.timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks, timeout=timeout)
    try:   # the control group: decisions and commits wait as long as the first quorum may
        control = (dist.new_group(backend="gloo", timeout=timedelta(seconds=client.startup_timeout_s))
                   if ranks > 1 else None)
        local = dataclasses.replace(cfg.parallel, dp=cfg.parallel.replica_dp, dp_shard=None,
                                    fault_tolerant=False)
        one = dataclasses.replace(cfg, parallel=local, coordinator=None, replica_id=None,
                                  replicas=None)
        return _train(one, device, lambda engine, dataset: QuorumSteps(
            cfg, engine, dataset, client, replica=replica, restart=restart, control=control,
            own_records=own_records))
    finally:
        client.close()
        dist.destroy_process_group()
