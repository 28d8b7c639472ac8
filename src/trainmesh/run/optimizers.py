"""The built-in GPT's optimizer recipe, shared by the mesh and the parameter-server workers."""
from __future__ import annotations

import torch

from trainmesh.config.train import TrainConfig


def no_decay(name: str) -> dict[str, float]:
    """Parameter groups: no weight decay on biases, norms and embeddings."""
    skip = name.endswith("bias") or ".ln" in name or "embed." in name
    return {"weight_decay": 0.0 if skip else 0.1}


def optimizer_factory(cfg: TrainConfig, device: torch.device):
    """The optimizer, in its fastest implementation where it steps: fused AdamW on CUDA and on
    the host under --offload (the fused CPU kernel is several times faster than foreach there:
    docs/BENCHMARKS.md), the multi-tensor (foreach) kernels elsewhere; each computes the same
    update up to rounding. The fused kernels only where every parameter is contiguous: the fused
    CPU AdamW miscomputes strided ones (a ZeRO-1/2 shard of several buckets is a strided view)."""
    lr = cfg.peak_lr
    on_host = cfg.parallel.offload != "none"
    if cfg.optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, foreach=True)

    def adamw(params) -> torch.optim.Optimizer:
        params = list(params)
        fused = (device.type == "cuda" or on_host) and all(p.is_contiguous() for p in _tensors(params))
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95),
                                 **({"fused": True} if fused else {"foreach": True}))
    return adamw


def _tensors(params: list) -> list[torch.Tensor]:
    """The tensors of an optimizer's ``params`` argument (tensors or group dicts)."""
    return [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
