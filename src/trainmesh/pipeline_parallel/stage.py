"""What one pipeline rank holds: its stage chunks, the module of its parameters, the stage I/O.

The bring-your-own-model protocol (docs/PIPELINE.md, "Running a pipeline"):

* the layers: ``model.pipeline_layers()`` (ordered), or the model is an ``nn.Sequential`` /
  a list of modules; each layer takes one tensor and returns one tensor, or the model's
  ``pipeline_forward(names, layers, x, microbatch)`` runs a stage's layers (a Hugging Face
  model, :mod:`.hf`, whose layers also take the position state it derives from the microbatch);
* the first stage's input: ``model.pipeline_input(batch)`` if defined, else ``batch["input_ids"]``
  (dict batch), ``batch[0]`` (tuple/list batch) or the batch itself (a tensor);
* the loss: the engine's own ``loss_fn(model, microbatch)``, run on the last stage with a
  stand-in for the model (:class:`LastStageModel`) whose call returns what the whole model's
  forward would: ``model.pipeline_output(output, *args, **kwargs)`` when the model defines it
  (the built-in GPT: the loss when labels are given), else the last layer's output. A
  ``loss_fn`` that never calls the model, or calls it on tensors that are not the
  microbatch's, cannot be split into stages and is refused with a ConfigError naming ``pp``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainmesh.core.errors import ConfigError
from trainmesh.core.step import LossFn, as_sum_and_count, tensors_in

from .partition import NamedLayer


class Chunk:
    """One (virtual) stage: consecutive layers run in order, one tensor in, one tensor out;
    with ``run`` (the model's ``pipeline_forward``), ``run(names, layers, x, microbatch)`` runs
    them instead (a Hugging Face model: its layers take the position state too).

    Holds references only; the parameters are registered (with their names) in :class:`LocalModule`.
    """

    def __init__(self, stage: int, layers: list[NamedLayer],
                 run: Callable[..., torch.Tensor] | None = None) -> None:
        self.stage, self.run = stage, run
        self.names = [name for name, _ in layers]
        self.layers = [layer for _, layer in layers]

    def __call__(self, x: Any, batch: Any = None) -> torch.Tensor:
        if self.run is not None:
            return self.run(self.names, self.layers, x, batch)
        for name, layer in zip(self.names, self.layers):
            x = layer(x)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"pipeline layer {name!r} returned {type(x).__name__}; every "
                                "pipeline layer must return a single tensor")
        return x


class LocalModule(nn.Module):
    """The layers this rank holds, registered under their names in the full model.

    ``named_parameters()`` therefore yields ``blocks.3.attn.q.weight`` etc., so checkpoints,
    parameter groups and the gradient norm see the full model's names.
    """

    def __init__(self, layers: list[NamedLayer]) -> None:
        super().__init__()
        for name, layer in layers:
            _attach(self, name, layer)


def _attach(root: nn.Module, name: str, layer: nn.Module) -> None:
    """Register ``layer`` at dotted path ``name`` under ``root``, creating empty containers."""
    *parents, leaf = name.split(".")
    node = root
    for part in parents:
        child = dict(node.named_children()).get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    node.add_module(leaf, layer)


@torch.no_grad()
def release_layers(dropped: list[nn.Module], kept: list[nn.Module]) -> None:
    """Move the parameters and buffers of layers this rank does not hold to the meta device.

    Parameters shared with a kept layer (tied weights) stay. The storage is freed, so a rank
    really holds ~1/pp of the model (the user's model object keeps meta placeholders).
    """
    keep = {id(t) for m in kept for t in (*m.parameters(), *m.buffers())}
    for layer in dropped:
        for mod in layer.modules():      # setattr on a registered name replaces the entry
            for name, p in list(mod.named_parameters(recurse=False, remove_duplicate=False)):
                if id(p) not in keep and not p.is_meta:
                    setattr(mod, name, nn.Parameter(p.to("meta"), requires_grad=p.requires_grad))
            for name, b in list(mod.named_buffers(recurse=False, remove_duplicate=False)):
                if id(b) not in keep and not b.is_meta:
                    setattr(mod, name, b.to("meta"))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                      and bool(torch.equal(a, b)))


class LastStageModel:
    """The model as ``loss_fn`` sees it on the last stage: calling it on the microbatch returns
    what the whole model's forward returns (see the module docstring); any other attribute is
    the model's."""

    def __init__(self, model: Any, output: torch.Tensor, microbatch: Any) -> None:
        self._model, self._output, self._microbatch = model, output, microbatch
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        given, batch = tensors_in([args, kwargs]), tensors_in(self._microbatch)
        if not any(_same(a, b) for a in given for b in batch):
            raise ConfigError("pp", "loss_fn called the model on tensors that are not the "
                                    "microbatch's; under a pipeline the model's output comes from "
                                    "its stages, so loss_fn must call the model on its batch")
        self.calls += 1
        finish = getattr(self._model, "pipeline_output", None)
        return finish(self._output, *args, **kwargs) if callable(finish) else self._output

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class StageIO:
    """How the pipeline feeds the first stage and scores the last (see the module docstring)."""

    def __init__(self, model: Any, loss_fn: LossFn) -> None:
        self.model, self.loss_fn = model, loss_fn

    def input_of(self, batch: Any) -> torch.Tensor:
        """The first stage's input tensor of one microbatch."""
        fn = getattr(self.model, "pipeline_input", None)
        if callable(fn):
            return fn(batch)
        if isinstance(batch, dict):
            if "input_ids" not in batch:
                raise ConfigError("pp", "a dict batch needs an 'input_ids' entry for the first "
                                        "stage (or define model.pipeline_input(batch))")
            return batch["input_ids"]
        if isinstance(batch, (tuple, list)):
            return batch[0]
        if isinstance(batch, torch.Tensor):
            return batch
        raise ConfigError("pp", f"cannot find the first stage's input in a {type(batch).__name__} "
                                "batch; define model.pipeline_input(batch)")

    def loss(self, output: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's (loss_sum, count) of one microbatch: ``loss_fn`` on the stand-in."""
        model = LastStageModel(self.model, output, batch)
        result = as_sum_and_count(self.loss_fn(model, batch))
        if model.calls == 0:
            raise ConfigError("pp", "loss_fn never called the model; under a pipeline the last "
                                    "stage scores the model's output, so loss_fn must call it")
        return result


class ActivationTracker:
    """Bytes of activations kept alive for a later backward, per (stage, microbatch).

    A pair's bytes are the distinct storages autograd saved during its forward (parameters
    excluded) plus its kept input and output. ``peak_bytes`` is the high-water mark of the sum
    over live pairs within a step. Off by default (a Python hook per saved tensor).
    """

    def __init__(self) -> None:
        self.param_storages: set[int] = set()
        self.live: dict[tuple[int, int], int] = {}
        self.current = self.peak_bytes = 0
        self._seen: dict[int, int] | None = None

    def reset(self, params: list[torch.Tensor]) -> None:
        """Start a step; ``params`` are excluded (their storage may move, e.g. into flat buffers)."""
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.live.clear()
        self.current = self.peak_bytes = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._seen is not None:
            s = t.untyped_storage()
            if s.data_ptr() not in self.param_storages:
                self._seen[s.data_ptr()] = s.nbytes()
        return t

    def record(self, key: tuple[int, int], fn: Callable[[], tuple[torch.Tensor, ...]]) -> tuple:
        """Run ``fn`` (a forward returning its kept tensors) and book what it saved under ``key``."""
        self._seen = {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                out = fn()
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._pack(t)
            nbytes = sum(self._seen.values())
        finally:
            self._seen = None
        self.live[key] = nbytes
        self.current += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current)
        return out

    def free(self, key: tuple[int, int]) -> None:
        self.current -= self.live.pop(key, 0)
