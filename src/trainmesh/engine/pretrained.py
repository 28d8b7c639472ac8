"""Hugging Face causal LMs from a local model directory, built so each rank holds only its part.

Any Hugging Face causal LM (``AutoModelForCausalLM``) works under dp and every ZeRO stage,
under tp where it declares a plan. A model directory is what ``save_pretrained`` writes: ``config.json`` and
``model.safetensors`` (or its shards and ``model.safetensors.index.json``).
:func:`from_pretrained` builds the model from its config with every parameter on the meta
device (buffers, such as Llama's rotary frequencies, are built for real: they are small and
derived from the config; a persistent one the weights hold, such as DeepSeek-V3's router
correction bias, then takes its saved value) and records the reader of its weights slice by
slice in its :class:`~trainmesh.core.hub_state.HubState` (no attribute on the model;
:func:`pretrained_init`: under the names the model holds, converted as transformers converts
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

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.dtypes import wide
from trainmesh.core.errors import ConfigError
from trainmesh.core.hf_infer import not_inferred, plan_source
from trainmesh.core.hf_plan import family
from trainmesh.core.hf_routing import router_loss_enabled, router_modules
from trainmesh.core.hub_state import hub_state
from trainmesh.engine.materialize import InitFn
from trainmesh.models.hf import FIELD, build_on_meta, weight_files
from trainmesh.models.hf_attention import routes_attention
from trainmesh.models.hf_plans import FLAGS, PlanFiles
from trainmesh.models.hf_router import add_router_loss, attach_router_stats
from trainmesh.models.hf_weights import CheckpointView


def from_pretrained(path: str, *, field: str = FIELD, plans: PlanFiles | None = None) -> nn.Module:
    """The causal LM of model directory ``path`` (any ``AutoModelForCausalLM`` type), float32
    parameters on the meta device, its weights reader ``init(name, shape, index)`` recorded in
    its :class:`~trainmesh.core.hub_state.HubState` (:func:`~trainmesh.core.hub_state.init_of`
    gives it; the engine calls it for what each rank holds), every persistent
    buffer the weights hold set to its saved value (a router's ``e_score_correction_bias``: as
    transformers' ``from_pretrained`` loads it; each whole, on every rank); its parallel plans
    from ``plans``' files, else declared, else inferred from its modules
    (:mod:`trainmesh.models.hf_plans`)."""
    model = build_on_meta(path, field=field, plans=plans)
    view = CheckpointView(weight_files(path, field), model, field=field)
    view.load_buffers(model)          # persistent buffers' trained values (a router's bias)
    hub_state(model).init = view.read     # the engine reads it (init_of)
    attach_router_stats(model)        # a mixture of experts that asks for its router's aux loss
    return model


def pretrained_init(path: str, model: nn.Module, *, field: str = FIELD) -> InitFn:
    """``init(name, shape, index)`` reading ``full[index]`` of a parameter from the directory's
    weights under the model's names, converted as transformers converts them on load (e.g. a
    mixture of experts saved expert by expert, held stacked: the experts a slice takes read
    whole, then sliced)."""
    view = CheckpointView(weight_files(path, field), model, field=field)
    return view.read


def check_model_dir(path: str, model: nn.Module | None = None, *, field: str = FIELD,
                    tp: int = 1, ep: int = 1, layout: ParallelConfig | None = None,
                    seq_len: int | None = None) -> None:
    """Every parameter of the model (built from ``path`` on meta unless given) is in
    ``model.safetensors`` with its shape, with ``tp`` > 1 the model has a plan trainmesh
    maps (GPT-2's, or the one its config declares; its experts' styles included), with ``ep``
    > 1 an expert-parallel plan trainmesh honours, a router aux loss the config asks for can be
    formed, and its plans allow the other axes of ``layout`` (:func:`check_hf_layout`; its tp
    and ep then those of ``layout``): checked before any worker starts."""
    model = model if model is not None else build_on_meta(path, field=field)
    CheckpointView(weight_files(path, field), model, field=field).check(model)
    if layout is not None:
        tp, ep = layout.tp, layout.ep
    if router_loss_enabled(model):
        router_modules(model)
    if ep > 1:
        from trainmesh.expert_parallel.hf import check_hf_ep
        with _naming_plan_file(model, "ep"):
            check_hf_ep(model, ep)
    if tp > 1:
        _check_tp_plan(model, tp, ep)
    if layout is not None:
        check_hf_layout(model, layout, seq_len)


@contextlib.contextmanager
def _naming_plan_file(model: nn.Module, axis: str) -> Iterator[None]:
    """A ConfigError inside names the plan file's flag (``--tp-plan``) when the plan came from
    one: the file is what the user can fix."""
    try:
        yield
    except ConfigError as exc:
        if plan_source(model, axis) != "file":
            raise
        raise ConfigError(FLAGS[axis], f"{exc.field}: {exc.message}") from None


def _check_tp_plan(model: nn.Module, tp: int, ep: int) -> None:
    """The model's tensor-parallel plan (declared, a file's, or inferred) maps onto trainmesh's
    styles at ``tp``; an inferred or a file's plan also splits the first layer as the unsplit
    layer computes (:func:`check_tp_first_layer`)."""
    from trainmesh.tensor_parallel.hf import declared_plan, hf_model_type, hf_tp_plan
    from trainmesh.tensor_parallel.hf_experts import check_expert_tp
    with _naming_plan_file(model, "tp"):
        check_expert_tp(model, tp, ep=ep)
        if hf_model_type(model) != "gpt2" and declared_plan(model) is None:
            raise ConfigError("--tp", f"{type(model).__name__} declares no tensor-parallel plan "
                              f"(config.base_model_tp_plan){not_inferred(model, 'tp')}; valid "
                              "for it: --tp 1 (dp and ZeRO), or a plan of your own (--tp-plan FILE)")
        try:
            hf_tp_plan(model)              # a declared style trainmesh cannot map: ConfigError
        except ConfigError as exc:
            raise ConfigError("--tp", exc.message) from None     # it names the family
    check_tp_first_layer(model, tp)


def check_tp_first_layer(model: nn.Module, tp: int) -> None:
    """A hub model's inferred or file's tensor-parallel plan splits the first layer at ``tp`` as
    the unsplit layer computes (:func:`trainmesh.tensor_parallel.hf_check.check_first_layer`),
    in this process. It runs once per run: ``trainmesh train``'s preflight runs it before any
    worker starts (the launcher's; under torchrun or srun each process's, before it joins the
    job), and its workers' engines are told so (``Engine(first_layer_checked=True)``);
    through the Python API the engine runs it before any collective (a model built by
    ``from_pretrained``), so the ConfigError names the plan (``--tp``, or ``--tp-plan`` for a
    file's) the same way in both. Its cost: the process that runs it holds the first decoder
    layer whole, once (one layer, whatever the model's depth, with random weights), and runs
    it ``tp + 1`` times on a batch of 2 x 8 tokens. Nothing to check at tp 1, for a declared
    plan, or a model whose plans trainmesh did not install."""
    if tp > 1 and plan_source(model, "tp") in ("inferred", "file"):
        from trainmesh.tensor_parallel.hf_check import check_first_layer
        with _naming_plan_file(model, "tp"):
            check_first_layer(model, tp)


def check_hf_layout(model: nn.Module, layout: ParallelConfig, seq_len: int | None = None) -> None:
    """A Hugging Face model's plans allow ``layout``'s axes: its pipeline plan ``--pp`` (with
    enough layers for every stage), its attention ``--cp`` (at ``seq_len``), its plans
    ``--sequence-parallel`` (a mixture of experts' with its experts split over tp, not spread
    over ep), its attention call ``--recompute selective`` (ConfigError naming the flag and the
    family). A router aux loss the config asks for composes with every one of them
    (:mod:`trainmesh.models.hf_router`: its counts summed over a split sequence's ranks,
    carried from pipeline stage to stage)."""
    if layout.sequence_parallel and layout.tp > 1:
        from trainmesh.tensor_parallel.hf import hf_tp_plan
        from trainmesh.tensor_parallel.hf_experts import check_expert_tp
        from trainmesh.tensor_parallel.hf_sequence import sequence_parallel_plan
        with _naming_plan_file(model, "tp"):
            sequence_parallel_plan(model, hf_tp_plan(model))
            check_expert_tp(model, layout.tp, ep=layout.ep, sequence_parallel=True)
    if layout.recompute == "selective" and not routes_attention(model):
        raise ConfigError("--recompute", f"selective checkpoints the attention call; the "
                          f"{family(model)} family's attention does not go through transformers' "
                          "attention interface; valid for it: none, full")
    if layout.cp > 1:
        from trainmesh.context_parallel.hf_attention import check_hf_context_parallel
        check_hf_context_parallel(model, seq_len)
    if layout.pp > 1:
        from trainmesh.pipeline_parallel.hf import check_hf_pipeline
        from trainmesh.pipeline_parallel.partition import check_stage_count
        with _naming_plan_file(model, "pp"):
            structure = check_hf_pipeline(model)
        check_stage_count(len(structure.ordered(model)), layout.pp * layout.virtual_stages)
        _check_ties_across_stages(model, structure.ordered(model), layout)


def _check_ties_across_stages(model: nn.Module, planned: list[str], layout: ParallelConfig) -> None:
    """The table's rules on the model's tied weights (:class:`~trainmesh.core.axes.Facts`):
    whether a weight is shared by two pipeline layers (tied embeddings: the input module's and
    the head's, whose gradient is summed over their stages before the DP reduction), and
    whether the cut puts two stages sharing one on the same rank."""
    from trainmesh.core.axes import Facts
    from trainmesh.pipeline_parallel.hf import pipeline_model
    from trainmesh.pipeline_parallel.partition import (
        named_pipeline_layers,
        partition,
        shared_stages,
        ties_on_one_rank,
    )
    from trainmesh.strategies import table
    owners: dict[int, set[str]] = {}
    for name in planned:
        for p in model.get_submodule(name).parameters():
            owners.setdefault(id(p), set()).add(name)
    ties = any(len(names) > 1 for names in owners.values())
    cut = pipeline_model(model)     # as the pipeline runtime cuts it
    stages = partition(named_pipeline_layers(cut), layout.pp * layout.virtual_stages,
                       getattr(cut, "pipeline_cuts", None))
    table.check(layout, Facts(ties=ties, ties_on_one_rank=ties_on_one_rank(shared_stages(stages),
                                                                           layout.pp)))


def causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """``(loss_sum, tokens)`` of a Hugging Face causal LM on a batch whose ``labels`` are the
    next tokens already (trainmesh's data): cross-entropy over every token whose label is not
    -100, as the built-in GPT. A packed batch's ``position_ids`` go to the model: its positions
    restart at each document, and transformers' mask builder keeps attention within each
    document it finds in them (sdpa, eager and the implementations that mask like them).

    A mixture of experts whose config asks for its router's load-balancing loss
    (``output_router_logits``, ``router_aux_loss_coef``) gets it in its gradient, per sequence
    (:mod:`trainmesh.models.hf_router`: transformers' formula over each sequence's tokens, so the
    same under every split of the batch); the returned loss stays the cross-entropy, the aux is
    reported in the model's MoE statistics (:func:`~trainmesh.core.hub_state.moe_stats_of`).
    Otherwise its router logits are not asked for."""
    routes = _routes(model)
    aux = routes and router_loss_enabled(model)
    extra = {"output_router_logits": aux} if routes else {}
    if "position_ids" in batch:   # packed documents: the family's mask keeps to each one
        extra["position_ids"] = batch["position_ids"]
    out = model(input_ids=batch["input_ids"], use_cache=False, **extra)
    logits = out.logits                                                  # (b, s, vocab)
    if aux:
        logits = add_router_loss(model, out.router_logits, logits)
    labels = batch["labels"]                                             # (b, s), -100 ignored
    logits = logits.flatten(0, 1)                        # at least float32 (float64 kept)
    loss = F.cross_entropy(logits.to(wide(logits.dtype)),
                           labels.flatten(), reduction="sum")
    return loss, (labels != -100).sum()


def _routes(model: nn.Module) -> bool:
    """The model's forward takes ``output_router_logits`` (a Hugging Face mixture of experts)."""
    return hasattr(getattr(model, "config", None), "output_router_logits")
