"""Sequence parallelism for Hugging Face models: the entries it adds to their plan.

Under sequence parallelism (Megatron's SP) the activations between the tensor-parallel regions
are split along the sequence over the TP ranks: each region enters by an all-gather (the
``parallel_input`` of an attention or MLP, or a column layer) and leaves by a reduce-scatter
(its row layer); what runs in between — norms, residual additions — runs on 1/tp of the
tokens. For a Hugging Face model the stretch between the regions is where its pipeline plan
(:mod:`trainmesh.core.hf_plan`) says the layers are: the base model computes its position
state (rotary embeddings of the whole sequence, masks) before the first layer, so the sequence
is split at the first layer's input (``sequence_scatter_input``: a split, its backward an
all-gather) and gathered again after the last module before the head (``sequence_gather``: the
replicated head and loss see the whole sequence). :func:`sequence_parallel_plan` returns these
entries and a ``sequence_parallel`` entry (gradients summed over tp) for every module with
parameters that runs on sequence chunks: inside the layers, those outside every TP region (the
layer norms), and the final norm.

The plan allows SP when everything that runs on chunks is per token: a module with parameters
outside every region must hold 1-D parameters only (a norm), be a mixture of experts' router
(the module transformers records ``router_logits`` from: it scores each token alone; its
parts too, Ernie 4.5's correction bias), a linear layer of a mixture of experts' block (Llama
4's router, which transformers does not record) or hold its stacked experts (recognised by
their parameters, :func:`~trainmesh.core.hf_routing.stacked_experts`: each token through the
experts chosen for it) — each gets its gradient summed over tp like a norm's. Stacked experts
the plan splits over tp are a region of their own (:mod:`.hf_experts`); those it leaves whole (transformers 5.25
declares no tensor-parallel style for them) run on the rank's chunk. A module holding another
matrix (an attention or MLP the plan leaves whole, a convolution over the sequence) is a
ConfigError naming ``--sequence-parallel`` and the family, as is a family without a pipeline
plan.
"""
from __future__ import annotations

from torch import nn

from trainmesh.core.errors import ConfigError
from trainmesh.core.hf_plan import hf_structure
from trainmesh.core.hf_routing import router_logits_of, stacked_experts

from .hf_experts import expert_entries
from .plan import Plan, is_layer_style, resolve

FLAG = "--sequence-parallel"
REGION_STYLES = ("parallel_input",)
"""Styles that put a module's whole computation inside a TP region (besides layer styles)."""


def sequence_parallel_plan(model: nn.Module, plan: Plan) -> dict[str, tuple[str, ...]]:
    """The entries SP adds to ``plan`` (the model's tensor-parallel plan), by exact module name
    (module docstring)."""
    structure = hf_structure(model, FLAG)
    regions = [name for name, _, styles in resolve(model, plan)
               if any(is_layer_style(s) or s in REGION_STYLES for s in styles)]
    regions += expert_entries(model)[1]           # stacked experts split over tp: their region
    router, _ = router_logits_of(model)           # a mixture of experts' router: per token
    experts = stacked_experts(model)               # whole on every rank: per token too
    routers = [n for n, m in model.named_modules()
               if isinstance(router, type) and isinstance(m, router)]
    blocks = {e.rpartition(".")[0] for e in experts}     # an MoE block routes each token alone:
    routers += [n for n, m in model.named_modules()     # its linear layers (Llama 4's router)
                if isinstance(m, nn.Linear) and n.rpartition(".")[0] in blocks]
    routers += experts

    def within(name: str, names: list[str]) -> bool:
        return any(name == r or name.startswith(r + ".") for r in names)

    layers = structure.layer_names(model)
    out: dict[str, tuple[str, ...]] = {layers[0]: ("sequence_scatter_input",)}
    for layer in layers:
        for sub, module in model.get_submodule(layer).named_modules():
            name = f"{layer}.{sub}" if sub else layer
            own = list(module.parameters(recurse=False))
            if not own or within(name, regions):
                continue
            per_token = within(name, routers)     # a router and its parts, experts
            if any(p.dim() != 1 for p in own) and not per_token:
                raise ConfigError(FLAG, f"the {structure.family} family's {name} "
                                  f"({type(module).__name__}) runs on the whole sequence outside "
                                  "its tensor-parallel plan, so its tokens cannot be split over "
                                  "tp; valid for it: without --sequence-parallel")
            out[name] = ("sequence_parallel",)
    for name in structure.post:
        if any(True for _ in model.get_submodule(name).parameters()):
            out[name] = ("sequence_parallel",)
    last = structure.post[-1] if structure.post else layers[-1]
    out[last] = (*out.get(last, ()), "sequence_gather")
    return out
