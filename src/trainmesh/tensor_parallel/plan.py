"""Tensor-parallel plans: data mapping module-name patterns to styles, and their validation.

A plan is data, generic over models: the model may carry its own (``model.tp_plan()``, and
``model.check_tp(tp, sequence_parallel=...)`` for shape checks that name its flags, as the
built-in GPT does), or the caller passes one. A plan is ``{pattern: style}`` (or ``{pattern: (style, style, ...)}``); patterns are
:func:`fnmatch` globs over ``model.named_modules()`` names (``"blocks.*.attn.q"``). Every
pattern must match at least one module. The styles:

``colwise``           nn.Linear -> ColumnParallelLinear (output features split, output stays split)
``colwise_gather``    the same, output all-gathered along the last dim (replicated)
``colwise_qkv``       a fused [q | k | v] projection (three equal output blocks): each block split,
                      so every rank holds whole heads of q, of k and of v (GPT-2's ``c_attn``)
``colwise_parts:A,B,..``  a fused projection of output blocks of sizes A, B, ... (unequal:
                      q, k, v of grouped-query attention; ``colwise_parts:3`` = three equal
                      blocks): each block split, every rank keeps its slice of each
``rowwise``           nn.Linear -> RowParallelLinear (input features split, output reduced)
``rowwise_split_input``  the same, taking a full (replicated) input it splits itself (after a
                      ``colwise_gather``)
``partial_grad``      any module with replicated parameters that each TP rank uses on its own
                      part (Qwen3's per-head q/k norms): their gradients are all-reduced over tp
``vocab_embedding``   nn.Embedding -> VocabParallelEmbedding (vocab rows split)
``vocab_head``        nn.Linear -> ColumnParallelLinear whose vocab-split logits feed ``vocab_ce``
``vocab_ce``          a ``(logits, labels) -> (loss_sum, count)`` criterion -> VocabParallelCrossEntropy
``parallel_input``    any module: its input (first argument, positional or by keyword) enters the
                      TP region once, for every column-parallel layer inside it (Attention: one f
                      for q, k and v; SP: one all-gather)
``local_heads``       an attention module that keeps head counts: those it has (``num_heads``,
                      ``num_key_value_heads``, ``split_size``, ``embed_dim``, ``hidden_size``)
                      become this rank's share (/ tp); its head counts (and its ``config``'s
                      ``num_attention_heads``, ``num_key_value_heads``) must divide by tp
``sequence_parallel`` any module with replicated parameters that runs on sequence shards under SP
                      (norms): their partial gradients are all-reduced over tp; no-op without SP
``sequence_scatter``  any module: under SP its (b, s, h) output is split along the sequence
                      (bwd all-gather); no-op without SP
``sequence_gather``   any module: under SP its (b, s/n, h) output is all-gathered along the
                      sequence for replicated consumers (bwd keeps own chunk); no-op without SP
``sequence_scatter_input``  any module: under SP its input (first argument, positional or by
                      keyword, (b, s, h)) is split along the sequence before it runs (bwd
                      all-gather): a Hugging Face model's first layer; no-op without SP
"""
from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase

from torch import nn

from trainmesh.core.errors import ConfigError

from .hf import declared_plan, head_counts, hf_model_type, hf_tp_plan
from .layers import features, is_conv1d

STYLES = ("colwise", "colwise_gather", "colwise_qkv", "colwise_parts:A,B,...", "rowwise",
          "rowwise_split_input", "vocab_embedding", "vocab_head", "vocab_ce", "parallel_input",
          "local_heads", "partial_grad", "sequence_parallel", "sequence_scatter", "sequence_gather",
          "sequence_scatter_input")
PARTS = "colwise_parts:"
LINEAR_STYLES = ("colwise", "colwise_gather", "colwise_qkv", "rowwise", "rowwise_split_input",
                 "vocab_head")
HEAD_ATTRS = ("num_heads", "num_key_value_heads", "split_size", "embed_dim", "hidden_size")
"""What ``local_heads`` divides by tp, where the module has it: head counts and head widths."""
REPLACING = (*LINEAR_STYLES, "vocab_embedding", "vocab_ce")


def fused_parts(style: str) -> int | tuple[int, ...] | None:
    """The parts of a ``colwise_parts:`` style (a count, or block sizes), else None."""
    if not style.startswith(PARTS):
        return None
    values = tuple(int(v) for v in style[len(PARTS):].split(","))
    return values[0] if len(values) == 1 else values


def is_layer_style(style: str) -> bool:
    """A style that replaces the module by a parallel layer."""
    return style in REPLACING or style.startswith(PARTS)

Plan = Mapping[str, "str | tuple[str, ...] | list[str]"]


def default_plan(model: nn.Module) -> dict[str, str | tuple[str, ...]]:
    """The plan the model carries: ``model.tp_plan()`` (the built-in GPT has one), or the plan a
    Hugging Face model declares (``config.base_model_tp_plan``; GPT-2's own, :mod:`.hf`)."""
    own = getattr(model, "tp_plan", None)
    if callable(own):
        return dict(own())
    if hf_model_type(model) == "gpt2" or declared_plan(model) is not None:
        return hf_tp_plan(model)
    raise ValueError(
        f"tensor parallelism needs a plan for {type(model).__name__}: pass tp_plan={{module-name "
        f"pattern: style}} (styles: {', '.join(STYLES)}), or give the model a tp_plan() method "
        "as the built-in GPT has")


def _styles(pattern: str, value: object) -> tuple[str, ...]:
    styles = (value,) if isinstance(value, str) else tuple(value)  # type: ignore[arg-type]
    if not styles:
        raise ValueError(f"tensor-parallel plan: pattern {pattern!r} has no style")
    for style in styles:
        if style.startswith(PARTS):
            try:
                parts = fused_parts(style)
            except ValueError:
                parts = None
            if not parts or min((parts,) if isinstance(parts, int) else parts) < 1:
                raise ValueError(f"tensor-parallel plan: {style!r} for {pattern!r}: give the part "
                                 "count or the sizes of the fused output blocks, e.g. "
                                 "'colwise_parts:512,128,128'")
        elif style not in STYLES:
            raise ValueError(f"tensor-parallel plan: unknown style {style!r} for {pattern!r}; "
                             f"valid: {', '.join(STYLES)}")
    if sum(is_layer_style(s) for s in styles) > 1:
        raise ValueError(f"tensor-parallel plan: {pattern!r} combines two layer styles {styles}")
    return styles


def resolve(model: nn.Module, plan: Plan) -> list[tuple[str, nn.Module, tuple[str, ...]]]:
    """(module name, module, styles) for every module a pattern matches, in model order.

    Raises ValueError for an unknown style, a pattern matching no module, a module matched by
    two patterns with conflicting layer styles, or a style applied to the wrong kind of module.
    """
    modules = dict(model.named_modules())
    matched: dict[str, list[str]] = {}
    for pattern, value in plan.items():
        styles = _styles(pattern, value)
        names = [n for n in modules if n and fnmatchcase(n, pattern)]
        if not names:
            sample = ", ".join(n for n in list(modules)[1:9])
            raise ValueError(f"tensor-parallel plan: pattern {pattern!r} matches no module of "
                             f"{type(model).__name__} (module names look like: {sample}, ...)")
        for name in names:
            merged = matched.setdefault(name, [])
            merged.extend(s for s in styles if s not in merged)
    out = []
    for name, module in modules.items():
        if name not in matched:
            continue
        styles = _styles(name, matched[name])
        _check_kind(name, module, styles)
        out.append((name, module, styles))
    kinds = {s for _, _, styles in out for s in styles}
    if ("vocab_head" in kinds) != ("vocab_ce" in kinds):
        raise ValueError("tensor-parallel plan: 'vocab_head' (vocab-split logits) and 'vocab_ce' "
                         "(the loss that reads them) must be used together")
    return out


def _check_kind(name: str, module: nn.Module, styles: tuple[str, ...]) -> None:
    for style in styles:
        if (style in LINEAR_STYLES or style.startswith(PARTS)) and type(module) is not nn.Linear \
                and not is_conv1d(module):
            raise ValueError(f"tensor-parallel plan: {name} is a {type(module).__name__}; "
                             f"style {style!r} needs an nn.Linear or a Hugging Face Conv1D")
        if style == "local_heads" and not head_counts(module):
            raise ValueError(f"tensor-parallel plan: {name} is a {type(module).__name__} without "
                             "head counts; style 'local_heads' needs an attention module with "
                             "num_heads (or a config with num_attention_heads)")
        if style == "vocab_embedding" and type(module) is not nn.Embedding:
            raise ValueError(f"tensor-parallel plan: {name} is a {type(module).__name__}; "
                             "style 'vocab_embedding' needs an nn.Embedding")


def check_divisible(resolved: list[tuple[str, nn.Module, tuple[str, ...]]], tp: int) -> None:
    """Every split dimension of the resolved plan must divide by ``tp`` (ConfigError)."""
    for name, module, styles in resolved:
        for style in styles:
            if style in LINEAR_STYLES or style.startswith(PARTS):
                in_f, out_f = features(module)
            if style in ("colwise", "colwise_gather") and out_f % tp:
                raise ConfigError("tp", f"{name} has {out_f} output features, "
                                  f"not divisible by --tp {tp}")
            parts = fused_parts(style)
            if parts is not None:
                sizes = [out_f // parts] * parts if isinstance(parts, int) else list(parts)
                if sum(sizes) != out_f or any(n % tp for n in sizes):
                    raise ConfigError("tp", f"{name} has {out_f} output features: not the blocks "
                                      f"{sizes} of {style!r}, each divisible by --tp {tp}")
            if style == "colwise_qkv" and out_f % (3 * tp):
                raise ConfigError("tp", f"{name} has {out_f} output features: not three equal "
                                  f"blocks (q, k, v) each divisible by --tp {tp}")
            if style in ("rowwise", "rowwise_split_input") and in_f % tp:
                raise ConfigError("tp", f"{name} has {in_f} input features, "
                                  f"not divisible by --tp {tp}")
            if style == "local_heads":
                for attr, count in head_counts(module).items():
                    if count % tp:
                        raise ConfigError("tp", f"{name} has {attr} = {count}, not divisible by "
                                          f"--tp {tp} (each rank holds whole heads)")
            if style == "vocab_head" and out_f % tp:
                raise ConfigError("vocab-size", f"{out_f} ({name}) must be divisible "
                                  f"by --tp {tp}")
            if style == "vocab_embedding" and module.num_embeddings % tp:
                raise ConfigError("vocab-size", f"{module.num_embeddings} ({name}) must be "
                                  f"divisible by --tp {tp}")
