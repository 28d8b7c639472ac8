"""The engine's state in and out: checkpoints, consolidated weights and the live state a
fault-tolerant replica copies (a :class:`Checkpointing` mixin of
:class:`~trainmesh.engine.engine.Engine`).

Checkpoints get the strategy, the communication layer, the placements and the trainer state
(:mod:`trainmesh.checkpoint.sharded`), never the engine.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainmesh.checkpoint import sharded as checkpoint
from trainmesh.checkpoint.async_save import AsyncSaver
from trainmesh.checkpoint.export_hf import model_record
from trainmesh.comm import Comm
from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.layout import Group
from trainmesh.core.placement import Placements
from trainmesh.data_parallel import untrained_state
from trainmesh.data_parallel.base import GradSync
from trainmesh.data_parallel.whole_params import LIVE, live_states, load_live_states
from trainmesh.engine.train_state import TrainState

Tensors = dict[str, torch.Tensor]


class Checkpointing:
    """Saving, loading and copying an engine's state (its ``grad_sync``, ``state`` and ``comm``)."""

    config: ParallelConfig
    grad_sync: GradSync
    comm: Comm
    state: TrainState
    placements: Placements
    model: nn.Module
    module: nn.Module

    def async_saver(self) -> AsyncSaver:
        """A saver for :meth:`save` that writes checkpoints in the background (``--async-save``)."""
        return AsyncSaver(self.comm)

    def save(self, path: str, trainer_state: dict[str, Any] | None = None, *,
             saver: Any | None = None, measure: dict[str, Any] | None = None):
        """Collective: write a checkpoint under ``path`` (:mod:`trainmesh.checkpoint.sharded`), return
        its directory; ``saver`` (an AsyncSaver): snapshot, write in the background, return the
        blocking seconds; ``measure``: filled on rank 0 with the memory the save added."""
        return (checkpoint.save if saver is None else saver.save)(
                     path, self.grad_sync, self.comm, step=self.state.step, measure=measure,
                     layout=self.config.layout_record(), placements=self.placements,
                     untrained=untrained_state(self.module),
                     # the whole model's record (tied aliases, a Hugging Face config): a stage too
                     trainer_state={**self.state.state_dict(), **model_record(self.model),
                                    **(trainer_state or {})})

    def load(self, path: str) -> dict[str, Any] | None:
        """Collective: resume from the newest checkpoint under ``path``, in this layout; returns
        the trainer state saved with it (None from a plain PyTorch one: left as it is)."""
        state = checkpoint.load(path, self.grad_sync, self.comm, self.placements,
                                untrained_state(self.module))
        if state is not None:
            self.state.load_state_dict(state)
        return state

    def full_state_dict(self) -> Tensors:
        """The consolidated, unsharded model weights (identical on every rank for DDP; under
        expert parallelism every expert, gathered over ep)."""
        gathered = self.grad_sync.full_state_dict()
        if gathered is None and self.comm.mesh.size(Group.tp) > 1:
            from trainmesh.tensor_parallel.state import full_state_dict
            gathered = full_state_dict(self.module, self.comm, self.placements)
        if gathered is None:
            gathered = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        if self.config.ep > 1:
            from trainmesh.expert_parallel.shard import gather_experts
            gathered = gather_experts(gathered, self.comm, self.placements)
        return gathered

    # ---------------------------------------------------------------- live state
    def trainer_state(self) -> dict[str, Any]:
        """The training state (step, learning rates, schedule, loss scaler, RNG) as JSON."""
        return self.state.state_dict()

    def load_trainer_state(self, record: dict[str, Any]) -> None:
        """Take a :meth:`trainer_state` record (another replica's, or a fresh one's)."""
        self.state.load_state_dict(record)

    @property
    def nonfinite_run(self) -> int:
        """Non-finite steps in a row so far (part of the training state)."""
        return self.state.nonfinite_run

    @nonfinite_run.setter
    def nonfinite_run(self, n: int) -> None:
        self.state.nonfinite_run = n

    def live_state(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Tensors]]:
        """What this rank hands a replica that copies the live state: the strategy's
        (:meth:`~trainmesh.data_parallel.base.GradSync.live_state`) and a user's
        whole-parameter optimizer's states (``whole/<name>`` entries,
        :func:`~trainmesh.data_parallel.whole_params.live_states`); with
        :meth:`trainer_state`, all a rejoining replica needs."""
        params, optim = self.grad_sync.live_state()
        return params, {**optim, **live_states(self.grad_sync)}   # a user's whole-param optimizer   # a user's whole-param optimizer   # a user's whole-param optimizer

    def load_live_state(self, params: Tensors, optim: dict[str, Tensors],
                        trainer: dict[str, Any]) -> None:
        """Take another replica's :meth:`live_state` (the same layout) and its trainer state
        (collective where the strategy makes its parameters whole again)."""
        self.grad_sync.load_live_state(params, {k: v for k, v in optim.items() if not k.startswith(LIVE)})
        load_live_states(self.grad_sync, optim)
        self.state.load_state_dict(trainer)
