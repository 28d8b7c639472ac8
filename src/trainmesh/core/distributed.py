"""Process-group set-up from the torchrun / srun environment."""
from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from trainmesh.core.errors import ConfigError
from trainmesh.core.mesh import TIMEOUT_S
from trainmesh.core.stores import process_group_store

log = logging.getLogger("trainmesh")


def visible_gpus() -> int:
    """CUDA devices this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def env_job() -> tuple[int, int, int, int] | None:
    """(rank, world size, local rank, local world size) of the job torchrun's (``RANK``, ...) or
    srun's (``SLURM_PROCID``, ...) environment describes; None outside a launcher. Read only:
    the environment is never written."""
    env = os.environ
    if "RANK" in env:
        return (int(env["RANK"]), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0")),
                int(env.get("LOCAL_WORLD_SIZE", "1")))
    if "SLURM_PROCID" in env:
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        return (int(env["SLURM_PROCID"]), int(env.get("SLURM_NTASKS", "1")),
                int(env.get("SLURM_LOCALID", "0")), int(per_node) if per_node.isdigit() else 1)
    return None


def local_world_size(default: int = 1) -> int:
    """Ranks of this job on this machine, from the launcher's environment; ``default`` (the
    workers a local launch is about to start) when it does not say."""
    job = env_job()
    known = "LOCAL_WORLD_SIZE" in os.environ or os.environ.get(
        "SLURM_NTASKS_PER_NODE", "").split("(")[0].isdigit()
    return job[3] if job is not None and known else int(os.environ.get("LOCAL_WORLD_SIZE", default))


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
    """Join the job described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), which
    is read, never written.

    gloo on CPU, nccl on CUDA unless ``backend`` says otherwise. Without a torchrun
    environment it starts a world of one (a single process needs no launcher). ``world_size``
    overrides the environment's (an elastic job using fewer processes than it has). Returns
    the device this worker computes on.
    """
    dev = pick_device(device)
    if dist.is_initialized():
        return dev
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    timeout = timedelta(seconds=timeout_s)
    device_id = dev if dev.type == "cuda" else None
    job = env_job()
    if job is None:   # no launcher: a world of one on an in-process store, nothing listens
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout, device_id=device_id)
        return dev
    rank, world = job[0], world_size or job[1]
    store = process_group_store(rank, world, timeout_s=timeout_s)
    if store is None:   # torchrun's agent store (env://)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                device_id=device_id)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout, device_id=device_id)
    return dev


def shutdown(*, barrier: bool = True) -> None:
    """Leave the job: a barrier first (on success), so no rank tears down gloo pairs a peer
    still reads."""
    if not dist.is_initialized():
        return
    try:
        if barrier and dist.get_world_size() > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()
