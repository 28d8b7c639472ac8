"""A Hugging Face model's dropout and router noise, drawn where no layout changes them.

transformers draws dropout masks and router noise from the process's generator: a rank holding
part of the batch, the sequence, the heads or the features draws other numbers for the same
element than one process does. :func:`install_draws` makes every such draw a function of the
element's place in the single-process computation (:mod:`trainmesh.core.randomness`: the seed,
the step, the site, the global row, token, head, feature or expert), the family's own
probability set to 0 and the same operation applied from those numbers:

- **attention dropout** (``attention_dropout``, GPT-2's ``attn_pdrop``: the ``dropout``
  transformers passes its attention function): the attention is registered again (:mod:`.hf_attention`) as the math
  path (scores, mask, softmax) whose probabilities (b, h, s_q, s_k) are dropped by (row, head,
  query position, key position) — heads tensor parallelism splits are this rank's share;
  without dropout (evaluation) the model's own implementation runs; under cp the ring's blocks
  draw it by the same key (:mod:`trainmesh.context_parallel.hf_attention`);
- **hidden dropout**: ``nn.Dropout`` modules, the ``residual_dropout`` of a module's output
  (Seed-OSS, Starcoder2) and the ``embedding_dropout`` of a base model's token embeddings
  (Starcoder2) by (row, token, feature) of the (batch, seq, features) output; a width other
  than the model's (or tensor parallelism's share of it) is keyed as whole;
- **router noise**: the multiplicative jitter ``uniform(1 - j, 1 + j)`` of a mixture of experts'
  input (Mixtral's ``router_jitter_noise``, PhiMoE's ``input_jitter_noise``) by (row, token,
  feature); PhiMoE's router (its sparse mixer's Gumbel sampling and its coin per token) by (row,
  token, expert): the router's forward runs with its ``exponential_``, ``rand_like`` and
  ``uniform_`` calls answered from the numbers, each call its own key (:class:`_DrawnCalls`).

Where an attention draws (its site, the head count its heads are numbered in) is recorded per
module before any layout changes the modules, in the :class:`InstalledDraws` that
:func:`install_draws` returns: whoever installs the draws holds it and hands it to what draws by
module (the drawn attention here, context parallelism's ring). Outside the engine's
microbatches (no :func:`~trainmesh.core.randomness.current`) the family's own draws run.
Imports core and models.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from trainmesh.core.dtypes import wide
from trainmesh.core.randomness import current, keep_mask, site_of

from .hf_attention import current as current_attention
from .hf_attention import implementation, use_attention

ATTENTION_NAME = "trainmesh_dropout"
ATTENTION_DROPOUTS = ("attn_dropout", "attention_dropout")
"""``nn.Dropout`` modules whose ``p`` an attention passes its attention function (GPT-2's):
drawn there, left as they are."""
SAMPLING_ROUTERS = ("PhimoeTopKRouter",)
"""Routers that sample their experts in training (PhiMoE's sparse mixer)."""


@dataclass(frozen=True)
class DrawSite:
    """Where a module draws: its site (:func:`~trainmesh.core.randomness.site_of` its name) and
    the head count its config declares (None: none), which tensor parallelism later divides in
    the module: its heads are numbered among the whole."""

    site: int
    heads: int | None = None


@dataclass
class InstalledDraws:
    """What :func:`install_draws` did to a model: what it replaced, one line each, and each
    module's :class:`DrawSite`, recorded before any layout is applied (held weakly: the
    model's lifetime is its owner's)."""

    replaced: list[str] = field(default_factory=list)
    sites: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    """{module: DrawSite}."""

    def attention_key(self, module: nn.Module, heads: int) -> tuple[int, int]:
        """(site, whole head count) of the attention ``module`` holding ``heads`` heads: (0,
        ``heads``) for a module not recorded (its heads are the whole)."""
        place = self.sites.get(module)
        if place is None:
            return 0, heads
        return place.site, heads if place.heads is None else place.heads


def install_draws(model: nn.Module) -> InstalledDraws:
    """Every dropout and router noise of the Hugging Face ``model`` drawn by position (module
    docstring), in place, before any layout is applied; returns what was replaced and where
    each module draws (nothing for a model without randomness)."""
    installed = InstalledDraws()
    config = getattr(model, "config", None)
    if not hasattr(config, "_attn_implementation"):
        return installed
    width = int(getattr(config, "hidden_size", 0) or 0)
    done = installed.replaced
    for name, module in model.named_modules():
        site = site_of(name)
        if isinstance(module, nn.Dropout) and module.p > 0 and not name.endswith(ATTENTION_DROPOUTS):
            module.register_forward_hook(_OutputDropout(module.p, site, width))
            done.append(f"{name}: dropout {module.p}")
            module.p = 0.0
        p = getattr(module, "residual_dropout", 0.0)
        if isinstance(p, float) and p > 0:
            module.register_forward_hook(_OutputDropout(p, site, width))
            done.append(f"{name}: residual dropout {p}")
            module.residual_dropout = 0.0
        p = getattr(module, "embedding_dropout", 0.0)
        embed = getattr(module, "embed_tokens", None)
        if isinstance(p, float) and p > 0 and isinstance(embed, nn.Module):
            embed.register_forward_hook(_OutputDropout(p, site, width))  # the embeddings' dropout
            done.append(f"{name}: embedding dropout {p}")
            module.embedding_dropout = 0.0
        for attr in ("jitter_noise", "input_jitter_noise"):
            j = getattr(module, attr, 0.0)
            if isinstance(j, float) and j > 0:
                module.register_forward_pre_hook(_InputJitter(j, site, width))
                done.append(f"{name}: {attr} {j}")
                setattr(module, attr, 0.0)
        if type(module).__name__ in SAMPLING_ROUTERS:
            module.forward = _DrawnCalls(module.forward, site)
            done.append(f"{name}: router sampling")
        heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
        installed.sites[module] = DrawSite(site, heads if isinstance(heads, int) else None)
    p = max(float(getattr(config, attr, 0.0) or 0.0) for attr in ("attention_dropout", "attn_pdrop"))
    if p > 0 and current_attention(model) in ("sdpa", "eager"):
        inner = current_attention(model)
        name = f"{ATTENTION_NAME}_{id(installed):x}"   # one per model: two may share a process
        use_attention(model, name, _DroppedAttention(inner, installed), mask_like="eager")
        done.append(f"attention dropout {p}")
    return installed


class _OutputDropout:
    """Forward hook: dropout ``p`` of the module's output (its first element if a tuple),
    drawn by (row, token, feature)."""

    def __init__(self, p: float, site: int, width: int) -> None:
        self.p, self.site, self.width = p, site, width

    @torch.compiler.disable   # eager: the keys (site, step, rows) are not graph constants
    def __call__(self, module: nn.Module, _args: Any, output: Any) -> Any:
        if not module.training:
            return output
        x = output[0] if isinstance(output, tuple) else output
        draws = current()
        if draws is None:
            y = F.dropout(x, self.p, True)
        else:
            u = draws.hidden_uniform(self.site, x.shape, _width(x.shape[-1], self.width, draws.tp))
            y = x * keep_mask(u, self.p).to(x.dtype)
        return (y, *output[1:]) if isinstance(output, tuple) else y


class _InputJitter:
    """Forward pre-hook: the first input times ``uniform(1 - j, 1 + j)`` drawn by (row, token,
    feature)."""

    def __init__(self, j: float, site: int, width: int) -> None:
        self.j, self.site, self.width = j, site, width

    @torch.compiler.disable   # eager: the keys (site, step, rows) are not graph constants
    def __call__(self, module: nn.Module, args: tuple) -> tuple | None:
        if not module.training or not args:
            return None
        x = args[0]
        draws = current()
        if draws is None:
            u = torch.rand_like(x, dtype=torch.float32)
        else:
            u = draws.hidden_uniform(self.site, x.shape, _width(x.shape[-1], self.width, draws.tp))
        noise = (1.0 - self.j) + (2.0 * self.j) * u
        return (x * noise.to(x.dtype), *args[1:])


def _width(f: int, width: int, tp: int) -> int:
    """The whole feature count of an activation of ``f`` features: the model's width when ``f``
    is it or tensor parallelism's share of it, else ``f`` itself."""
    return width if width and (f == width or f * tp == width) else f


class _DroppedAttention:
    """The attention function with dropout drawn by (row, head, query, key) (module
    docstring), each module at its site in ``installed``; without dropout, ``inner``'s
    implementation."""

    def __init__(self, inner: str, installed: InstalledDraws) -> None:
        self.inner, self.installed = inner, installed

    @torch.compiler.disable   # eager: the keys (site, step, rows) are not graph constants
    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: Any, *, scaling: float | None = None,
                 dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
        draws = current()
        if not dropout or draws is None:
            fn = implementation(self.inner, module)
            return fn(module, query, key, value, attention_mask, scaling=scaling,
                      dropout=dropout, **kwargs)
        b, h, sq, hd = query.shape                                    # (b, h, s_q, hd)
        sk = key.shape[2]
        if key.shape[1] != h:                                         # grouped-query k/v
            key = key.repeat_interleave(h // key.shape[1], dim=1)
            value = value.repeat_interleave(h // value.shape[1], dim=1)
        scores = (query @ key.transpose(2, 3)) * (scaling if scaling is not None else hd ** -0.5)
        softcap = kwargs.get("softcap")
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = _masked(scores, attention_mask, getattr(module, "is_causal", True))
        logits = scores.to(wide(scores.dtype))
        sinks = kwargs.get("s_aux")
        if sinks is not None:   # attention sinks (gpt-oss): one more logit per head, in the softmax only
            sink = sinks.to(logits.dtype).reshape(1, -1, 1, 1).expand(b, -1, sq, 1)
            logits = torch.cat([logits, sink], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :sk]              # (b, h, s_q, s_k)
        site, whole = self.installed.attention_key(module, h)
        rows, heads = draws.row_ids(b).view(b, 1, 1, 1), draws.split(h, whole)
        qpos, kpos = draws.tokens(sq).view(1, 1, sq, 1), draws.tokens(sk).view(1, 1, 1, sk)
        keep = torch.empty_like(probs)
        step = max(1, (1 << 24) // max(1, b * sq * sk))   # heads per hash: its int64 temporaries bounded
        for i in range(0, h, step):
            u = draws.uniform(site, rows, heads[i:i + step].view(1, -1, 1, 1), qpos, kpos)
            keep[:, i:i + step] = keep_mask(u, dropout)
        probs = (probs * keep).to(value.dtype)
        return (probs @ value).transpose(1, 2).contiguous(), None    # (b, s_q, h, hd)


def _masked(scores: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """``scores`` (b, h, s_q, s_k) with the model's mask: additive (eager's), boolean (True
    attends), or none (causal when the module is)."""
    sq, sk = scores.shape[-2:]
    if mask is None:
        if not causal or sq == 1:
            return scores
        mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).tril(sk - sq)
    mask = mask[..., :sk]
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return scores + mask


class _DrawnCalls(TorchFunctionMode):
    """Runs ``forward`` with its random calls on (tokens, k) tensors answered by position:
    the ``c``-th call's element (i, j) drawn by (row, token of flattened row i, j, c)."""

    RANDOM = {torch.Tensor.exponential_, torch.Tensor.uniform_, torch.rand_like}

    def __init__(self, forward: Any, site: int) -> None:
        super().__init__()
        self.inner, self.site, self.calls = forward, site, 0

    @torch.compiler.disable   # eager: the keys (site, step, rows) are not graph constants
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if current() is None:
            return self.inner(*args, **kwargs)
        self.calls = 0
        with self:
            return self.inner(*args, **kwargs)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in self.RANDOM:
            return func(*args, **kwargs)
        out = args[0] if func is not torch.rand_like else torch.empty_like(args[0])
        low, high = (args[1:3] + (0.0, 1.0)[len(args[1:3]):]) if func is torch.Tensor.uniform_ else (0.0, 1.0)
        draws = current()
        u = draws.hidden_uniform(self.site ^ self.calls, out.shape, out.shape[-1])
        u = u + 2.0 ** -25                                        # (0, 1): a finite log
        self.calls += 1
        with torch.no_grad():
            value = -torch.log1p(-u) if func is torch.Tensor.exponential_ else low + (high - low) * u
            return out.copy_(value.to(out.dtype))
