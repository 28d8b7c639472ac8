"""Process-group set-up from the torchrun / srun environment, and its shutdown at exit."""
from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainmesh.core.errors import ConfigError
from trainmesh.core.mesh import TIMEOUT_S
from trainmesh.core.interfaces import backend_interface, bind_backends
from trainmesh.core.slurm import slurm_task
from trainmesh.core.stores import STORE_ENV, process_group_store, publish_host

log = logging.getLogger("trainmesh")


def visible_gpus() -> int:
    """CUDA devices this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class Job:
    """The job this process is a worker of, as its launcher's environment describes it."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    local_world_known: bool
    """Whether the launcher said how many ranks share this machine."""
    master: tuple[str, int] | None
    """Where the ranks meet (``MASTER_ADDR``/``MASTER_PORT``, or srun's derived address);
    None under torchrun's shared agent store or trainmesh's local launcher."""


def launcher_job(env=None) -> Job | None:
    """The job torchrun's (``RANK``, ...) or srun's (``SLURM_PROCID``, ...) environment
    describes; None outside a launcher (a batch script or an salloc shell is none). Read only."""
    env = os.environ if env is None else env
    given = (env["MASTER_ADDR"], int(env.get("MASTER_PORT", "29500"))) if "MASTER_ADDR" in env else None
    if "RANK" in env:
        return Job(int(env["RANK"]), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0")),
                   int(env.get("LOCAL_WORLD_SIZE", "1")), "LOCAL_WORLD_SIZE" in env, given)
    task = slurm_task(env)
    if task is None:
        return None
    if given is None:
        given = (task.master_addr, int(env.get("MASTER_PORT", task.master_port)))
    return Job(task.rank, task.world, task.local_rank, task.local_world, True, given)


def env_job() -> tuple[int, int, int, int] | None:
    """(rank, world size, local rank, local world size) of :func:`launcher_job`, or None."""
    job = launcher_job()
    return None if job is None else (job.rank, job.world, job.local_rank, job.local_world)


def local_world_size(default: int = 1) -> int:
    """Ranks of this job on this machine, from the launcher's environment; ``default`` (the
    workers a local launch is about to start) when it does not say."""
    job = launcher_job()
    return job.local_world if job is not None and job.local_world_known else int(
        os.environ.get("LOCAL_WORLD_SIZE", default))


def worker_threads() -> int:
    """Intra-op threads for one worker: ``OMP_NUM_THREADS``, else srun's
    ``SLURM_CPUS_PER_TASK``, else this machine's CPUs shared among its ranks."""
    for var in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size()))


def is_local(job: Job | None) -> bool:
    """Whether every rank of ``job`` runs on this machine: no launcher, trainmesh's local
    launcher, or a torchrun/srun job whose ranks all sit here."""
    return job is None or STORE_ENV in os.environ or (job.local_world_known and job.local_world >= job.world)


def choose_device(device: str, *, local_ranks: int, gpus: int) -> tuple[str, str | None]:
    """The device type every local rank computes on, and why ``auto`` fell back to the CPU.

    CUDA only when every local rank gets its own GPU (two ranks on one GPU would each call
    set_device on an ordinal that does not exist, or share a GPU NCCL refuses to share).
    ``cuda`` with fewer GPUs than local ranks is a :class:`ConfigError` naming both counts.
    """
    if device == "cpu":
        return "cpu", None
    if device not in ("auto", "cuda"):
        raise ConfigError("device", f"must be one of auto, cpu, cuda; got {device!r}")
    if gpus >= local_ranks and gpus > 0:
        return "cuda", None
    if device == "cuda":
        raise ConfigError("device", f"--device cuda needs one GPU per local rank: {local_ranks} local ranks "
                          f"asked for, {gpus} GPU(s) visible; use --device auto or cpu, or fewer ranks")
    if gpus == 0:
        return "cpu", None
    return "cpu", (f"{local_ranks} local ranks but {gpus} GPU(s) visible: each rank needs its own "
                   "GPU, so training on the CPU with gloo")


def pick_device(device: str = "auto") -> torch.device:
    """This worker's device by :func:`choose_device`; the fallback reason logged once, on rank 0."""
    kind, reason = choose_device(device, local_ranks=local_world_size(), gpus=visible_gpus())
    job = env_job() or (0, 1, 0, 1)
    rank, local = job[0], int(os.environ.get("LOCAL_RANK", job[2]))
    if reason and rank == 0:
        log.warning("trainmesh: --device %s: %s", device, reason)
    if kind == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def init_distributed(backend: str | None = None, *, timeout_s: float = TIMEOUT_S,
                     device: str = "auto", world_size: int | None = None) -> torch.device:
    """Join the job described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, ... of
    torchrun; SLURM_PROCID, SLURM_NTASKS, SLURM_STEP_NODELIST, ... of srun).

    gloo on CPU, nccl on CUDA unless ``backend`` says otherwise. Without a launcher it starts a
    world of one (a single process needs no launcher). ``world_size`` overrides the
    environment's (an elastic job using fewer processes than it has). The backends listen on the
    loopback interface when every rank is on this machine, else on the interface that reaches
    the master (:mod:`trainmesh.core.interfaces`: the only environment variables written, and
    only where unset). The process group is shut down in order at exit
    (:func:`shutdown_at_exit`). Returns the device this worker computes on.
    """
    dev = pick_device(device)
    if dist.is_initialized():
        return dev
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    timeout = timedelta(seconds=timeout_s)
    device_id = dev if dev.type == "cuda" else None
    job = launcher_job()
    master = job.master if job is not None else None
    bind_backends(backend_interface(local=is_local(job), master=master[0] if master else None))
    atexit.unregister(shutdown_at_exit)   # registered once, however often this is called
    atexit.register(shutdown_at_exit)
    if job is None:   # no launcher: a world of one on an in-process store
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout, device_id=device_id)
        return dev
    rank, world = job.rank, world_size or job.world
    store = process_group_store(rank, world, master=master, timeout_s=timeout_s)
    if store is None:   # torchrun's agent store (env://)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                device_id=device_id)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout, device_id=device_id)
    publish_host(rank)
    return dev


def shutdown(*, barrier: bool = True) -> None:
    """Leave the job: a barrier first (on success), so no rank tears down gloo pairs a peer
    still reads; then every process group is destroyed."""
    if not dist.is_initialized():
        return
    try:
        if barrier and dist.get_world_size() > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def shutdown_at_exit() -> None:
    """The process group's orderly end when the program ends without :func:`shutdown` (run by
    ``atexit``, while the interpreter is whole): a barrier unless the program is ending on an
    uncaught exception, then the groups destroyed. Left to the interpreter's teardown instead,
    gloo's threads may still hold work whose tensors are freed after Python is gone, which
    aborts the process (SIGABRT) after a finished run."""
    if not dist.is_initialized():
        return
    failed = getattr(sys, "last_value", None) is not None
    try:
        shutdown(barrier=not failed)
    except Exception as exc:  # noqa: BLE001 - a peer gone at exit: the groups are destroyed anyway
        log.warning("trainmesh: at exit on %s: the barrier before shutting down failed: %s",
                    socket.gethostname(), str(exc).strip().splitlines()[0] if str(exc).strip() else exc)
