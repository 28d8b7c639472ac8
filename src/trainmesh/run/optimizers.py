"""The built-in GPT's optimizer recipe, shared by the mesh and the parameter-server workers."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from trainmesh.config.train import TrainConfig
from trainmesh.data_parallel.muon import MuonAdamW, muon_options

log = logging.getLogger("trainmesh")


def no_decay(name: str) -> dict[str, float]:
    """Parameter groups: no weight decay on biases, norms and embeddings."""
    skip = name.endswith("bias") or ".ln" in name or "embed." in name
    return {"weight_decay": 0.0 if skip else 0.1}


def param_groups(cfg: TrainConfig, model: torch.nn.Module) -> Callable[[str], dict]:
    """The parameter groups' options by name: :func:`no_decay`, and under ``--optimizer muon``
    which parameters Muon takes (from their whole-model shapes: the model before any split)."""
    if cfg.optimizer != "muon":
        return no_decay
    return muon_options({n: tuple(p.shape) for n, p in model.named_parameters()}, no_decay)


def describe_split(model: torch.nn.Module, options: Callable[[str], dict]) -> str:
    """One line: how many tensors and elements go to Muon and to AdamW."""
    counts = {True: [0, 0], False: [0, 0]}
    for name, p in model.named_parameters():
        if p.requires_grad:
            c = counts[bool(options(name).get("muon"))]
            c[0], c[1] = c[0] + 1, c[1] + p.numel()
    return (f"optimizer: Muon on {counts[True][0]} hidden weight tensors ({counts[True][1]:,} "
            f"parameters), AdamW on {counts[False][0]} others ({counts[False][1]:,}: embeddings, "
            "output head, norms, biases)")


def optimizer_factory(cfg: TrainConfig, device: torch.device):
    """The optimizer, in its fastest implementation where it steps: fused AdamW on CUDA and on
    the host under --offload (the fused CPU kernel is several times faster than foreach there:
    docs/BENCHMARKS.md), the multi-tensor (foreach) kernels elsewhere; each computes the same
    update up to rounding. The fused kernels only where every parameter is contiguous: the fused
    CPU AdamW miscomputes strided ones (a ZeRO-1/2 shard of several buckets is a strided view).
    ``muon``: :class:`~trainmesh.data_parallel.muon.MuonAdamW` (AdamW's betas as here)."""
    lr = cfg.peak_lr
    on_host = cfg.parallel.offload != "none"
    if cfg.optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, foreach=True)
    if cfg.optimizer == "muon":
        return lambda params: MuonAdamW(params, lr=lr, betas=(0.9, 0.95))

    def adamw(params) -> torch.optim.Optimizer:
        params = list(params)
        fused = (device.type == "cuda" or on_host) and all(p.is_contiguous() for p in _tensors(params))
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95),
                                 **({"fused": True} if fused else {"foreach": True}))
    return adamw


def _tensors(params: list) -> list[torch.Tensor]:
    """The tensors of an optimizer's ``params`` argument (tensors or group dicts)."""
    return [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
