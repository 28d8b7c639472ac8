"""The built-in GPT's optimizer recipe, shared by the mesh and the parameter-server workers."""
from __future__ import annotations

import torch

from .train_config import TrainConfig


def no_decay(name: str) -> dict[str, float]:
    """Parameter groups: no weight decay on biases, norms and embeddings."""
    skip = name.endswith("bias") or ".ln" in name or "embed." in name
    return {"weight_decay": 0.0 if skip else 0.1}


def optimizer_factory(cfg: TrainConfig, device: torch.device):
    """The optimizer, in its fastest implementation on ``device``: fused AdamW on CUDA, the
    multi-tensor (foreach) kernels elsewhere; each computes the same update up to rounding."""
    lr = cfg.peak_lr
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    if cfg.optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, foreach=True)
    return lambda params: torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), **fast)
