"""Hugging Face causal LMs from a local model directory, built so each rank holds only its part.

Any Hugging Face causal LM (``AutoModelForCausalLM``) works under dp and every ZeRO stage,
under tp where it declares a plan. A model directory is what ``save_pretrained`` writes: ``config.json`` and
``model.safetensors`` (or its shards and ``model.safetensors.index.json``).
:func:`from_pretrained` builds the model from its config with every parameter on the meta
device (buffers, such as Llama's rotary frequencies, are built for real: they are small and
derived from the config) and gives it ``init_parameter`` reading the weights slice by slice
(:func:`pretrained_init`: under the names the model holds, converted as transformers converts
them on load, e.g. a mixture of experts saved expert by expert and held stacked). The engine then materialises each rank's part
after the tensor-parallel split — a column shard of a GPT-2 ``Conv1D`` is a slice of its
``(in, out)`` weight, a shard of the fused ``c_attn`` one slice of each of q, k and v — so no
rank ever holds the whole model::

    model = tm.from_pretrained("path/to/dir")
    engine = tm.Engine(model, optimizer, tm.causal_lm_loss, config=tm.ParallelConfig(tp=2))

transformers is an optional dependency (``pip install 'trainmesh[hf]'``), imported only here and
only when a model is built. :func:`check_model_dir` reads ``config.json`` alone (no
transformers) so ``trainmesh train --model-dir`` refuses a bad directory before any worker starts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainmesh.core.errors import ConfigError
from trainmesh.engine.materialize import InitFn
from trainmesh.models.hf import FIELD, build_on_meta, weight_files
from trainmesh.models.hf_router import (
    add_router_loss,
    attach_router_stats,
    router_loss_enabled,
    router_modules,
)
from trainmesh.models.hf_weights import CheckpointView


def from_pretrained(path: str, *, field: str = FIELD) -> nn.Module:
    """The causal LM of model directory ``path`` (any ``AutoModelForCausalLM`` type), float32
    parameters on the meta device, with ``init_parameter(name, shape, index)`` reading its
    weights slice by slice (the engine calls it for what each rank holds)."""
    model = build_on_meta(path, field=field)
    model.init_parameter = pretrained_init(path, model, field=field)
    attach_router_stats(model)        # a mixture of experts that asks for its router's aux loss
    return model


def pretrained_init(path: str, model: nn.Module, *, field: str = FIELD) -> InitFn:
    """``init(name, shape, index)`` reading ``full[index]`` of a parameter from the directory's
    weights under the model's names, converted as transformers converts them on load (e.g. a
    mixture of experts saved expert by expert, held stacked: read whole, then sliced)."""
    view = CheckpointView(weight_files(path, field), model, field=field)
    return view.read


def check_model_dir(path: str, model: nn.Module | None = None, *, field: str = FIELD,
                    tp: int = 1, ep: int = 1) -> None:
    """Every parameter of the model (built from ``path`` on meta unless given) is in
    ``model.safetensors`` with its shape, with ``tp`` > 1 the model has a plan trainmesh
    maps (GPT-2's, or the one its config declares; its experts' styles included), with ``ep``
    > 1 an expert-parallel plan trainmesh honours, and a router aux loss the config asks for
    can be formed: checked before any worker starts."""
    model = model if model is not None else build_on_meta(path, field=field)
    CheckpointView(weight_files(path, field), model, field=field).check(model)
    if router_loss_enabled(model):
        router_modules(model)
    if ep > 1:
        from trainmesh.expert_parallel.hf import check_hf_ep
        check_hf_ep(model, ep)
    if tp > 1:
        from trainmesh.tensor_parallel.hf_experts import check_expert_tp
        check_expert_tp(model, tp, ep=ep)
        from trainmesh.tensor_parallel.hf import (
            declared_plan,
            hf_model_type,
            hf_tp_plan,
        )
        if hf_model_type(model) != "gpt2" and declared_plan(model) is None:
            raise ConfigError("--tp", f"{type(model).__name__} declares no tensor-parallel plan "
                              "(config.base_model_tp_plan); valid for it: --tp 1 (dp and ZeRO)")
        try:
            hf_tp_plan(model)              # a declared style trainmesh cannot map: ConfigError
        except ConfigError as exc:
            raise ConfigError("--tp", f"{hf_model_type(model)}: {exc.message}") from None


def causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """``(loss_sum, tokens)`` of a Hugging Face causal LM on a batch whose ``labels`` are the
    next tokens already (trainmesh's data): cross-entropy over every token, as the built-in GPT.

    A mixture of experts whose config asks for its router's load-balancing loss
    (``output_router_logits``, ``router_aux_loss_coef``) gets it in its gradient, per sequence
    (:mod:`trainmesh.models.hf_router`: transformers' formula over each sequence's tokens, so the
    same under every split of the batch); the returned loss stays the cross-entropy, the aux is
    reported in ``model.moe_stats``. Otherwise its router logits are not asked for."""
    routes = _routes(model)
    aux = routes and router_loss_enabled(model)
    extra = {"output_router_logits": aux} if routes else {}
    out = model(input_ids=batch["input_ids"], use_cache=False, **extra)
    logits = out.logits                                                  # (b, s, vocab)
    if aux:
        logits = add_router_loss(model, out.router_logits, logits)
    labels = batch["labels"]                                             # (b, s)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    return loss, labels.numel()


def _routes(model: nn.Module) -> bool:
    """The model's forward takes ``output_router_logits`` (a Hugging Face mixture of experts)."""
    return hasattr(getattr(model, "config", None), "output_router_logits")
