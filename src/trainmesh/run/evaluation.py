"""Validation loss during training (``--eval-every N --eval-batches K``).

Every N steps the engine scores the same K global batches of the held-out split
(:func:`trainmesh.data.corpus.make_datasets`) forward only (``Engine.evaluate``: under every layout), and
the trainer logs ``{"event": "eval", "step", "loss", "tokens"}``. The batches are a function
of (seed, k) only, so every layout evaluates the same tokens and reports the same loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainmesh.core.layout import Group
from trainmesh.data.corpus import Batch, dp_slice
from trainmesh.engine.engine import Engine


@dataclass
class Evaluator:
    """Scores the held-out batches every ``every`` steps; one DP rank's slice of each."""

    engine: Engine
    dataset: Any
    """The held-out split: ``batch(seed, k, batch_size)``."""
    every: int
    batches: int
    seed: int
    global_batch: int
    tokens_per_batch: int
    _mine: list[Batch] = field(default_factory=list, repr=False)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def run(self, step: int) -> dict[str, Any]:
        """Collective: the eval record of ``step``."""
        if not self._mine:
            mesh, device = self.engine.mesh, self.engine.device
            for k in range(1, self.batches + 1):
                batch = dp_slice(self.dataset.batch(self.seed, k, self.global_batch),
                                 mesh.index(Group.dp), mesh.size(Group.dp))
                self._mine.append({n: t.to(device) for n, t in batch.items()})
        loss = self.engine.evaluate(self._mine)
        return {"event": "eval", "step": step, "loss": loss,
                "tokens": self.batches * self.tokens_per_batch}


def make_evaluator(engine: Engine, dataset: Any, cfg: Any) -> Evaluator | None:
    """The evaluator a TrainConfig asks for (``--eval-every``), else None."""
    if cfg.eval_every is None or dataset is None:
        return None
    return Evaluator(engine, dataset, cfg.eval_every, cfg.eval_batches, cfg.seed,
                     cfg.global_batch, cfg.global_batch * cfg.gpt_config().seq_len)
