"""The ``trainmesh train --strategy ps`` worker: a trainer or a server of the built-in GPT.

Every rank builds the :class:`~trainmesh.parameter_server.PSEngine`; the servers serve until the
trainers close, the trainers run the one training loop of :mod:`trainmesh.run.trainer` with it
(each step once, on the trainer's slice of the global batch; rank 0 writes the metrics and the
summary). What its loop does not produce is refused before any worker starts (the table's
rows of :mod:`trainmesh.strategies.parameter_server`): checkpoints, evaluation, a trace,
TensorBoard (and a pipeline timeline, which needs --pp > 1).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from trainmesh.config.train import TrainConfig
from trainmesh.models.gpt import GPT
from trainmesh.parameter_server import PSEngine
from trainmesh.run.optimizers import optimizer_factory, param_groups
from trainmesh.run.schedule_lr import warmup_cosine


def train_ps(cfg: TrainConfig, device: torch.device, loop: Callable[..., int]) -> int:
    """Ranks 0..dp-1 train, the rest serve (module docstring); ``loop``: the training loop
    (:func:`trainmesh.run.trainer._train`), run by the trainers with this rank's engine."""
    model = GPT(cfg.gpt_config(), seed=cfg.seed, device=device)
    engine = PSEngine(model, optimizer_factory(cfg, device), lambda m, batch: m(**batch), cfg.parallel,
                      param_groups=param_groups(cfg, model),
                      lr_scheduler=lambda opt: warmup_cosine(opt, warmup_steps=cfg.warmup_steps,
                                                             total_steps=cfg.steps),
                      seed=cfg.seed)
    if engine.is_server:
        engine.serve()
        return 0
    code = loop(cfg, device, engine=engine)
    engine.close()
    return code
