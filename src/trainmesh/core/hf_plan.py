"""The layer structure a Hugging Face causal LM declares in its pipeline plan.

transformers 5 models declare ``config.base_model_pp_plan``: the base model's children in the
order data flows through them, each with the inputs and outputs it takes (Llama::

    embed_tokens: (["input_ids"], ["inputs_embeds"])
    layers:       (["hidden_states", "attention_mask"], ["hidden_states"])
    norm:         (["hidden_states"], ["hidden_states"])

) and the causal LM adds its head (``lm_head: (["hidden_states"], ["logits"])``); the model's
``pp_plan`` holds both, prefixed. :func:`hf_structure` reads them into an :class:`HFStructure`:
the modules before the repeated layers (``pre``: the first takes ``input_ids``), the layer list,
the modules after it (``post``: the final norm) and the head. Pipeline stages cut the layer list
(:mod:`trainmesh.pipeline_parallel.hf`), sequence parallelism splits the sequence between the
first layer and the final norm (:mod:`trainmesh.tensor_parallel.hf`).

A plan trainmesh cannot honour — none declared, no layer list, a parameter outside every
planned module, a planned module with parameters that is not the first (the stages without it
could not run the model's code before the layers) — is a ConfigError naming the flag and the
family. Imports core only (transformers not at all: the plan is read from the model).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainmesh.core.errors import ConfigError
from trainmesh.core.hf_infer import not_inferred


@dataclass(frozen=True)
class HFStructure:
    """A Hugging Face causal LM's declared data flow, module names in the whole model."""

    family: str
    """``config.model_type`` (``llama``), for messages."""
    base: str
    """The base model's attribute (``model``): the module whose forward runs the layers."""
    pre: tuple[str, ...]
    """Planned modules before the layers (``model.embed_tokens``), the first taking input_ids."""
    layers: str
    """The layer list (``model.layers``, an ``nn.ModuleList``)."""
    post: tuple[str, ...]
    """Planned modules after the layers (``model.norm``)."""
    head: str
    """The causal LM's output layer (``lm_head``)."""

    def local(self, name: str) -> str:
        """``name`` relative to the base model (``model.norm`` -> ``norm``)."""
        return name[len(self.base) + 1:] if self.base else name

    def layer_names(self, model: nn.Module) -> list[str]:
        """Every layer of the list, in order (``model.layers.0`` ...)."""
        return [f"{self.layers}.{i}" for i in range(len(model.get_submodule(self.layers)))]

    def ordered(self, model: nn.Module) -> list[str]:
        """Every planned module in data-flow order: pre, each layer, post, head."""
        return [*self.pre, *self.layer_names(model), *self.post, self.head]


def family(model: nn.Module) -> str:
    """``config.model_type`` of a Hugging Face model (its class name otherwise)."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return kind if isinstance(kind, str) else type(model).__name__


def declared_pp_plan(model: nn.Module) -> dict[str, tuple] | None:
    """The model's ``pp_plan`` (base entries prefixed, the head's added), or None."""
    plan = getattr(model, "pp_plan", None)
    base = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    if not plan and base:
        plan = dict(base)
    if plan and not base and all("." not in name for name in plan):
        return None                  # the causal LM's head alone (OLMoE): its base declares none
    return dict(plan) if plan else None


def hf_structure(model: nn.Module, flag: str = "--pp") -> HFStructure:
    """The structure ``model`` declares (module docstring); ConfigError naming ``flag`` and the
    family when its plan cannot be honoured."""
    kind = family(model)
    plan = declared_pp_plan(model)
    valid = {"--sequence-parallel": "without --sequence-parallel",
             "--pp-plan": "a plan naming the token embedding, the layer list and the final norm"
             }.get(flag, f"{flag} 1")

    def refuse(why: str) -> ConfigError:
        return ConfigError(flag, f"the {kind} family's pipeline plan (config.base_model_pp_plan) "
                           f"cannot be honoured: {why}; valid for it: {valid}")

    if plan is None:
        raise ConfigError(flag, f"the {kind} family declares no pipeline plan "
                          f"(config.base_model_pp_plan){not_inferred(model, 'pp')}; valid for "
                          f"it: {valid}, or a plan of your own (--pp-plan FILE)")
    modules = dict(model.named_modules())
    missing = [name for name in plan if name not in modules]
    if missing:
        raise refuse(f"it names {missing}, not modules of {type(model).__name__}")
    lists = [name for name in plan if isinstance(modules[name], nn.ModuleList)]
    if len(lists) != 1:
        raise refuse(f"{len(lists)} layer lists ({lists}); it must name exactly one")
    layers = lists[0]
    base = layers.rpartition(".")[0]
    base_entries = [name for name in plan if name.rpartition(".")[0] == base]
    heads = [name for name in plan if name not in base_entries]
    if len(heads) != 1 or not base_entries or base_entries[0] == layers:
        raise refuse(f"expected the base model's modules (an input module first) and one head; "
                     f"got {list(plan)}")
    where = base_entries.index(layers)
    pre, post = tuple(base_entries[:where]), tuple(base_entries[where + 1:])
    inputs = plan[pre[0]][0] if plan[pre[0]] else []
    if "input_ids" not in inputs:
        raise refuse(f"its first module {pre[0]} takes {inputs}, not input_ids")
    with_params = [name for name in pre[1:] if any(True for _ in modules[name].parameters())]
    if with_params:
        raise refuse(f"{with_params} hold parameters before the layers besides {pre[0]}")
    planned = [*pre, layers, *post, heads[0]]
    outside = [n for n, _ in model.named_parameters()
               if not any(n.startswith(p + ".") for p in planned)]
    if outside:
        raise refuse(f"parameters {outside[:3]} lie outside every module it names")
    return HFStructure(kind, base, pre, layers, post, heads[0])


@contextmanager
def swapped(parent: nn.Module, leaf: str, stand_in: nn.Module) -> Iterator[None]:
    """``parent.<leaf>`` is ``stand_in`` inside (no hooks of the original run): a stage's or a
    check's stand-in for a child of the structure."""
    original = parent._modules[leaf]
    parent._modules[leaf] = stand_in
    try:
        yield
    finally:
        parent._modules[leaf] = original


def first_output(out: Any) -> torch.Tensor:
    """A decoder layer's hidden states (transformers 5 returns them; older ones a tuple)."""
    return out[0] if isinstance(out, (tuple, list)) else out
