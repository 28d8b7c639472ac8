"""Process-group set-up from the torchrun / srun environment."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def pick_device(device: str = "auto") -> torch.device:
    """``auto``: this worker's CUDA device when CUDA is present, else the CPU."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def init_distributed(backend: str | None = None, *, timeout_s: float = 300.0,
                     device: str = "auto") -> torch.device:
    """Join the job described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    gloo on CPU, nccl on CUDA unless ``backend`` says otherwise. Without a torchrun
    environment it starts a world of one (a single process needs no launcher). Returns the
    device this worker computes on.
    """
    dev = pick_device(device)
    if dist.is_initialized():
        return dev
    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"})
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                            device_id=dev if dev.type == "cuda" else None)
    return dev


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
