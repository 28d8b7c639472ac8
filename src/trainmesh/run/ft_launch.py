"""The fault-tolerant run's hooks on the one launcher (:mod:`trainmesh.run.launch`): one
elastic agent per replica of this host, and, on one host, the coordinator
(docs/FAULT_TOLERANCE.md).

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

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainmesh.run.launch import Launch, launch
from trainmesh.run.worker import WorkerMain

if TYPE_CHECKING:
    from trainmesh.config.train import TrainConfig

FT_MAX_RESTARTS = 3
"""Restarts of each replica when ``--max-restarts`` is not given with ``--fault-tolerant``."""
STARTUP_TIMEOUT_S = 300.0
"""How long the first quorum waits for every replica to start."""


def launch_fault_tolerant(cfg: TrainConfig, *, max_restarts: int,
                          worker_setup: Callable[[], None] | None = None,
                          end_process_on_failure: bool = True) -> int:
    """Run the replicas and the coordinator until the last step; the exit code (a failure or a
    signal ends this process right there unless ``end_process_on_failure`` is False, as
    :func:`~trainmesh.run.launch.launch_local`).
    The job's secret: a run on one host makes its own; across hosts it is given
    (``--secret-file`` or ``TRAINMESH_FT_SECRET``; none: :class:`ConfigError`, exit 2, before
    anything starts)."""
    return launch(FaultTolerantLaunch(cfg), max_restarts=max_restarts, worker_setup=worker_setup,
                  end_process_on_failure=end_process_on_failure)


class FaultTolerantLaunch(Launch):
    """The launcher's hooks for a ``--fault-tolerant`` run: one threaded agent per replica of
    this host; on one host the coordinator, the run's first line and its summary."""

    threaded = True

    def __init__(self, cfg: TrainConfig) -> None:
        from trainmesh.fault_tolerance.auth import load_secret, new_secret
        self.secret = new_secret() if cfg.coordinator is None else load_secret(cfg.secret_file)
        super().__init__(cfg, nproc=cfg.parallel.replica_ranks)
        self.coordinator: Any = None
        self.board: Any = None
        self.address = cfg.coordinator
        self.began = time.perf_counter()

    def agents(self) -> list[int]:
        return list(range(self.cfg.parallel.replicas)) if self.cfg.coordinator is None \
            else [self.cfg.replica_id]

    def begin(self) -> None:
        _print_header(self.cfg)
        self.began = time.perf_counter()

    def save_dir(self) -> tuple[bool, bool]:
        # across hosts the replicas share the directory: no lock, nothing removed (a peer may
        # be writing); on one host this launcher cleans, as no replica may
        return self.cfg.coordinator is None, True

    def serve(self) -> dict[str, str]:
        from trainmesh.fault_tolerance.auth import SECRET_ENV
        if self.cfg.coordinator is None:
            self.coordinator, self.board = _local_coordinator(self.cfg, self.secret)
            self.address = self.coordinator.address
        return {SECRET_ENV: self.secret}   # the workers' only copy (their environment, not argv)

    def run_id(self, agent: int) -> str:
        return f"trainmesh-ft-{self.launch_id}-r{agent}"

    def worker(self, agent: int) -> WorkerMain:
        return ReplicaWorker(agent, self.address, self.launch_id)

    def started(self) -> None:
        if self.coordinator is not None:
            self.coordinator.start()

    def failed(self, agent: int, headline: str) -> str:
        return (headline.replace("rank 0", f"replica {agent}", 1) if self.nproc == 1
                else f"replica {agent}: {headline}")

    def agent_failed(self, agent: int, exc: Exception) -> str:
        return f"replica {agent}: agent failed: {exc}"

    def finish(self, failures: dict[int, str]) -> int:
        if self.coordinator is None:   # across hosts: this host's replica reported its own run
            return super().finish(failures)
        return _finish(self.cfg, self.coordinator, self.board, failures, self.began)


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
    """The run's summary record: a row per replica (its first rank, pids, restarts, failure)
    and fault tolerance's tally."""
    from trainmesh.observe.summary import summary_record
    t, ranks = coordinator.tally, cfg.parallel.replica_ranks
    rows = [{"rank": r * ranks, "replica": r, "pids": t.pids.get(r, []),
             "restarts": max(0, len(t.pids.get(r, [])) // ranks - 1),
             **({"failed": failures[r]} if r in failures else {})}
            for r in range(cfg.parallel.replicas)]
    return summary_record(cfg, final_loss=coordinator.final_loss, steps=coordinator.committed,
                          ranks=rows,
                          fault_tolerance={"degraded_steps": t.degraded_steps,
                                           "failed_attempts": t.failed_attempts,
                                           "recovery_s": round(t.recovery_s, 3),
                                           "state_transfer_s": round(t.transfer_s, 3)})


class ReplicaWorker(WorkerMain):
    """What each worker of replica ``replica`` runs (:func:`ft_worker_main`)."""

    def __init__(self, replica: int, address: str, launcher_id: str) -> None:
        self.replica, self.address, self.launcher_id = replica, address, launcher_id

    def __call__(self, cfg: TrainConfig) -> int:
        from torch.distributed.elastic.multiprocessing.errors import record
        return record(ft_worker_main)(cfg, self.replica, self.address, self.launcher_id,
                                      own_records=cfg.coordinator is not None)

    def known(self) -> tuple[type[BaseException], ...]:
        from trainmesh.fault_tolerance.replica import ProtocolMismatch
        from trainmesh.run.ft_steps import ReplicaRankLost
        return ReplicaRankLost, ProtocolMismatch

    def report(self, exc: BaseException) -> None:
        sys.stderr.write(f"trainmesh: {exc}\n")


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
