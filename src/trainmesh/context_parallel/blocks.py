"""One block of attention (this rank's queries against one block of keys and values) with its
log-sum-exp, the merge of partial results, and the block's backward given the merged result.

A query chunk's attention over the whole sequence is assembled block by block (online
softmax): each block gives ``(out_i, lse_i)`` with ``out_i = softmax(s_i) v_i`` over its keys
only and ``lse_i = log Σ exp(s_i)``; two partials merge as

    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse)·out_a + exp(lse_b - lse)·out_b.

The backward of a block needs only the *merged* ``out`` and ``lse`` of its queries: with them
``p = exp(s - lse)`` are the true probabilities, and ``dS = p·(dO·V^T - rowsum(dO∘O))``.

Where the device has fused scaled-dot-product kernels that return the log-sum-exp (CPU:
``aten._scaled_dot_product_flash_attention_for_cpu``; CUDA: the memory-efficient kernel), a
block calls them (``fused=True``); the math path computes the same in plain tensor ops (float32
at least) and is the reference the tests hold the kernels to.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_aten = torch.ops.aten


def fused_available(device: torch.device) -> bool:
    """Whether this torch has a fused kernel returning the log-sum-exp for ``device``."""
    if device.type == "cpu":
        return hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu") and \
            hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
    if device.type == "cuda":
        return hasattr(_aten, "_scaled_dot_product_efficient_attention_backward")
    return False


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """(b, h, cq, hd) x (b, h, ck, hd) -> scaled scores (b, h, cq, ck), causal: upper -inf;
    ``mask`` (cq, ck) bool: -inf where False."""
    dt = _acc_dtype(q)
    s = torch.matmul(q.to(dt), k.to(dt).transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        upper = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(upper, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask.to(s.device), float("-inf"))
    return s


def _bias(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """The (cq, ck) bool mask as the fused kernels' additive bias (b, h, cq, ck), q's dtype;
    on CUDA its rows padded to 16 elements (the memory-efficient kernel's alignment), as
    ``scaled_dot_product_attention`` pads a mask it hands that kernel."""
    if mask is None:
        return None
    cq, ck = mask.shape
    pad = (-ck) % 16 if q.device.type == "cuda" else 0
    bias = torch.zeros((q.shape[0], q.shape[1], cq, ck + pad), dtype=q.dtype, device=q.device)
    bias[..., :ck].masked_fill_(~mask.to(q.device), float("-inf"))
    return bias[..., :ck]


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a query row with no key in the block) as 0, to subtract safely."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 fused: bool = False, mask: torch.Tensor | None = None,
                 keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries ``q`` over the keys ``k``/values ``v`` of one block, all
    (b, h, c, hd); ``causal``: the block is a diagonal one (same chunk); ``mask``: (cq, ck)
    bool, the pairs attended (packed documents, a sliding window). Returns (out (b, h, cq, hd)
    in the accumulation dtype, lse (b, h, cq)); a query row with no key attended gives out 0,
    lse -inf. ``keep`` (b, h, cq, ck): dropout's scaled keep mask on the probabilities (math
    path): the block's out is its kept probabilities times v and its lse the undropped one, so
    the merge gives the dropped attention over every key (its normalisation undropped)."""
    if fused and keep is None:
        bias = _bias(mask, q, k)
        if q.device.type == "cpu":
            out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, attn_mask=bias)
        else:
            out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, True, 0.0, causal)
            lse = lse[..., : q.shape[-2]]
        out, lse = out.to(_acc_dtype(q)), lse.to(_acc_dtype(q))
        if mask is not None:                      # rows with no key: whatever the kernel gave
            empty = ~mask.to(q.device).any(-1)    # (cq,)
            out = out.masked_fill(empty.unsqueeze(-1), 0.0)
            lse = lse.masked_fill(empty, float("-inf"))
        return out, lse
    s = _scores(q, k, causal, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.matmul(p if keep is None else p * keep.to(p.dtype), v.to(s.dtype)), lse


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: the partial ``(out, lse)`` so far (None: none yet) with one more block's."""
    if out is None or lse is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    safe = _finite(new_lse)                  # both -inf (no key yet): weights exp(-inf) = 0
    out = torch.exp(lse - safe).unsqueeze(-1) * out + \
        torch.exp(block_lse - safe).unsqueeze(-1) * block_out
    return out, new_lse


def attend_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, *, causal: bool, fused: bool = False,
                          mask: torch.Tensor | None = None, keep: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one block's share, given the queries' merged ``out`` and
    ``lse`` (over every block, hence finite) and ``dout`` = dL/d out; ``mask`` and ``keep`` as
    in :func:`attend_block`. With P the probabilities and D the keep mask (out = (D·P) v):
    dv = (D·P)ᵀ dout, dS = P·(D·(dout vᵀ) - rowsum(dout·out))."""
    if fused and keep is None:
        dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        bias = _bias(mask, q, k)
        if q.device.type == "cpu":
            return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse.to(_acc_dtype(q)).contiguous(), 0.0, causal,
                attn_mask=bias)
        pad = (-lse.shape[-1]) % 32          # the kernel's log-sum-exp is padded to 32 rows
        lse_p = F.pad(lse.float(), (0, pad)).contiguous()
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, lse_p, seed, seed, 0.0, [True, True, True, False], causal)
        return dq, dk, dv
    s = _scores(q, k, causal, mask)
    p = torch.exp(s - lse.unsqueeze(-1))                       # (b, h, cq, ck)
    dt = s.dtype
    dout, vv = dout.to(dt), v.to(dt)
    d = None if keep is None else keep.to(dt)
    dv = torch.matmul((p if d is None else p * d).transpose(-1, -2), dout)
    dp = torch.matmul(dout, vv.transpose(-1, -2))
    dp = dp if d is None else dp * d
    ds = p * (dp - (dout * out.to(dt)).sum(-1, keepdim=True)) * (1.0 / math.sqrt(q.shape[-1]))
    dq = torch.matmul(ds, k.to(dt))
    dk = torch.matmul(ds.transpose(-1, -2), q.to(dt))
    return dq, dk, dv
