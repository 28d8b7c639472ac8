"""Pipeline stages of a Hugging Face causal LM, cut from the plan it declares.

The model's ``pp_plan`` (:mod:`trainmesh.core.hf_plan`) names its data flow: the input
module (``model.embed_tokens``), the layer list, the final norm, the head. The pipeline layers
are those modules in that order — the input module, each decoder layer, the norm, the head — and
the stages cut that list (:mod:`.partition`), so a stage holds the parameters of its layers only
and checkpoints keep the model's own names.

A decoder layer takes more than the hidden states: the plan names the attention mask, and the
model's forward hands every layer its position state too (the rotary ``position_embeddings``
computed from ``position_ids``, per-layer masks of sliding-window families). Each stage computes
them for every microbatch with the model's own code, :meth:`HFPipeline._capture`: the base
model's forward runs on the microbatch's ``input_ids`` with each decoder layer replaced by a
recorder of the arguments it is called with (a stage without the input module gets zeros of the
hidden size from a stand-in: its parameters live on the first stage), and stops at the last
layer it needs. The first stage takes the hidden states entering the first layer from the same
run, so whatever the model does between the embedding and the layers (Gemma's scaling by
``sqrt(hidden_size)``) is done. Context parallelism's global positions and sequence
parallelism's split reach the layers through the model's forward as in one process.

The last stage scores the model: the loss function calls the model (:class:`.stage.
LastStageModel`), and :meth:`HFPipeline.pipeline_output` runs the causal LM's own forward on
the norm's output, its base model standing in with that output — so the head, anything the
model applies to the logits (soft-capping) and its own loss (``labels=``) are the model's.
Imports core only.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from trainmesh.core.errors import ConfigError
from trainmesh.core.hf_plan import HFStructure, first_output, hf_structure, swapped
from trainmesh.core.hf_routing import router_loss_enabled

from .hf_routing import RouterTap, empty, pack, router_stats, unpack


def is_hf_model(model: Any) -> bool:
    """A Hugging Face model (a module with a ``config.model_type``) without ``pipeline_layers()``."""
    return (isinstance(model, nn.Module) and not hasattr(model, "pipeline_layers")
            and isinstance(getattr(getattr(model, "config", None), "model_type", None), str))


def pipeline_model(model: Any) -> Any:
    """What the pipeline runtime cuts: a Hugging Face model's :class:`HFPipeline`, else ``model``."""
    return HFPipeline(model) if is_hf_model(model) else model


BASE_INPUTS = ("position_ids", "attention_mask")
"""Entries of a dict microbatch that the base model's forward takes besides the token ids."""


class _Captured(Exception):
    """Raised by the last recorder a stage needs: the rest of the model's forward is skipped."""


class _Recorder(nn.Module):
    """Stands in for decoder layer ``index`` during :meth:`HFPipeline._capture`: records the
    arguments the model's forward calls it with; any other attribute is the layer's."""

    def __init__(self, layer: nn.Module, index: int, calls: dict[int, tuple], last: int) -> None:
        super().__init__()
        object.__setattr__(self, "layer", layer)      # not a submodule: no parameters here
        self.index, self.calls, self.last = index, calls, last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls[self.index] = (args, kwargs)
        if self.index >= self.last:
            raise _Captured
        return args[0] if args else kwargs.get("hidden_states")

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "layer"), name)


class _Zeros(nn.Module):
    """Stands in for the input module on a stage that does not hold it: zeros of its width."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.width, self.dtype = width, dtype
        self.weight = torch.empty(0, width, dtype=dtype, device=device)
        """Not a parameter: where the model's code looks for the device (Llama 4 moves the
        token ids to ``embed_tokens.weight.device``)."""

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.width, dtype=self.dtype, device=ids.device)  # (b, s, h)




class HFPipeline:
    """A Hugging Face causal LM as the pipeline runtime sees it (module docstring); every other
    attribute is the model's."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stands_for = model
        """The model this view stands for: its record (:mod:`trainmesh.core.hub_state`) is
        this view's, and that of the last stage's view of it that ``loss_fn`` is handed."""
        self.structure: HFStructure = hf_structure(model)
        self.base = model.get_submodule(self.structure.base)
        self._layer_index = {name: i for i, name in enumerate(self.structure.layer_names(model))}
        self.routers: RouterTap | None = None
        """A mixture of experts asking for its router's aux loss: its routing is carried."""
        if router_loss_enabled(model):
            self.routers = RouterTap(model, self.structure.layer_names(model))

    def __getattr__(self, name: str) -> Any:
        if "model" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["model"], name)

    # ---------------------------------------------------------------- the runtime's protocol
    def pipeline_layers(self) -> list[nn.Module]:
        """The planned modules in data-flow order: input module, each layer, norm, head."""
        return [self.model.get_submodule(name) for name in self.structure.ordered(self.model)]

    def pipeline_input(self, batch: Any) -> torch.Tensor:
        """The first stage's input: the microbatch's token ids."""
        return self._ids(batch)

    def pipeline_forward(self, names: Sequence[str], layers: Sequence[nn.Module], x: Any,
                         batch: Any) -> torch.Tensor:
        """One chunk: ``x`` (token ids into the first chunk, else the hidden states the previous
        one sent, (b, s, h)) through the planned modules ``names``."""
        s = self.structure
        needed = [self._layer_index[n] for n in names if n in self._layer_index]
        holds_input = s.pre[0] in names
        routing = None
        if self.routers is not None:                  # the routing so far (module docstring)
            if holds_input:
                ids = self._ids(batch)
                routing = empty(self.model, ids.shape[0], ids.device)
            else:
                x, routing = unpack(x, router_stats(self.model).n_experts)
        calls: dict[int, tuple] = {}
        if needed or holds_input:
            first_hidden, calls = self._capture(batch, holds_input, max(needed, default=0))
            if holds_input:
                x = first_hidden                          # (b, s, h): what enters layer 0
        with self.routers.tapped(names) if self.routers is not None else nullcontext([]) as seen:
            for name, layer in zip(names, layers):
                if name in self._layer_index:
                    args, kwargs = calls[self._layer_index[name]]
                    x = first_output(layer(x, *args[1:], **kwargs))
                elif name in s.post:
                    x = layer(x)
                # the input modules ran in the capture; the head runs in pipeline_output
        if self.routers is None or routing is None:
            return x
        return pack(x, self.routers.add(routing, seen, x.shape[0]))   # (b, s + r, h)

    def pipeline_output(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """What the causal LM's forward returns (logits, its loss with ``labels=``) when its base
        model's output is ``hidden`` (the final norm's, (b, s, h)); a mixture of experts
        asking for its router's aux loss: its ``router_logits`` are the
        :class:`~trainmesh.core.hf_routing.Routing` the stages carried (the model's own aux
        term, over its layers' logits, is not formed)."""
        from transformers.modeling_outputs import BaseModelOutputWithPast
        routing = None
        if self.routers is not None:
            hidden, routing = unpack(hidden, router_stats(self.model).n_experts)
            kwargs = {**kwargs, "output_router_logits": False}

        def stand_in(*_a: Any, **_k: Any) -> Any:
            out = BaseModelOutputWithPast(last_hidden_state=hidden)
            out.router_logits = None       # what a mixture of experts' causal LM reads of it
            return out

        self.base.__dict__["forward"] = stand_in
        try:
            out = self.model(*args, **kwargs)
        finally:
            del self.base.__dict__["forward"]
        if routing is not None:
            out["router_logits"] = routing
        return out

    # ---------------------------------------------------------------- the model's own state
    def _ids(self, batch: Any) -> torch.Tensor:
        if isinstance(batch, dict) and "input_ids" in batch:
            return batch["input_ids"]
        if isinstance(batch, torch.Tensor):
            return batch
        raise ConfigError("pp", "a Hugging Face model's pipeline needs its batch as a tensor of "
                          "token ids or a dict with 'input_ids'")

    def _capture(self, batch: Any, holds_input: bool, last: int
                 ) -> tuple[torch.Tensor | None, dict[int, tuple]]:
        """The base model's forward on the microbatch up to decoder layer ``last``: (the hidden
        states entering layer 0, {layer index: (args, kwargs) the model calls it with})."""
        s = self.structure
        layers = self.model.get_submodule(s.layers)
        calls: dict[int, tuple] = {}
        recorders = nn.ModuleList(_Recorder(layer, i, calls, last) for i, layer in enumerate(layers))
        parent, _, leaf = s.layers.rpartition(".")
        with swapped(self.model.get_submodule(parent) if parent else self.model, leaf, recorders):
            if holds_input:
                self._run_base(batch)
            else:
                embed = self.model.get_submodule(s.pre[0])
                weight = next(iter(embed.parameters()))
                e_parent, _, e_leaf = s.pre[0].rpartition(".")
                with swapped(self.model.get_submodule(e_parent) if e_parent else self.model,
                              e_leaf, _Zeros(weight.shape[-1], weight.dtype, self._ids(batch).device)):
                    self._run_base(batch)
        if last not in calls:
            raise ConfigError("pp", f"the {s.family} model's forward did not call decoder layer "
                              f"{last} of {s.layers}: its pipeline plan cannot be honoured")
        first = calls[0][0][0] if calls[0][0] else calls[0][1].get("hidden_states")
        return first, calls

    def _run_base(self, batch: Any) -> None:
        """The base model's forward as the whole model's would run it on the microbatch: its
        token ids and, where the batch has them, its positions and padding mask."""
        given = {k: batch[k] for k in BASE_INPUTS if isinstance(batch, dict) and k in batch}
        try:
            self.base(input_ids=self._ids(batch), use_cache=False, **given)
        except _Captured:
            return


def check_hf_pipeline(model: nn.Module) -> HFStructure:
    """Before any worker: the model declares a pipeline plan trainmesh honours (ConfigError
    naming ``--pp`` and the family otherwise)."""
    return hf_structure(model)
