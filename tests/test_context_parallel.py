"""Ring attention's math in one process: the CP ranks emulated by threads exchanging blocks
through queues (the same ring code as a real CP group), against plain causal attention in
float64, forward and backward; the fused per-block kernels against the math path; the zigzag
partition and the traffic formula's arithmetic.

Planted bugs this module catches (each seen failing with an assertion): the mask without the
zigzag reorder (key chunks taken as contiguous ranks' chunks), a wrong log-sum-exp merge
(max instead of logaddexp), the last dK/dV hop missing (gradients of K/V land one rank off).
"""
from __future__ import annotations

import math
import queue
import threading

import pytest
import torch
from tolerances import assert_fp32_close, fp64_atol, scale_of

from trainmesh.context_parallel import (
    attend_block,
    attend_block_backward,
    chunk_ids,
    cp_bytes_per_layer,
    fused_available,
    ring_attention,
    shard_sequence,
    unshard_sequence,
    zigzag_positions,
)

pytestmark = pytest.mark.timeout(60)


class ThreadRing:
    """CP rank ``index`` of ``size`` emulated in a thread: blocks pass through queues."""

    def __init__(self, index: int, size: int, inboxes: list[queue.Queue], gathered: list,
                 barrier: threading.Barrier) -> None:
        self.index, self.size = index, size
        self.inboxes, self.gathered, self.barrier = inboxes, gathered, barrier
        self.sent = 0

    def shift(self, t):
        self.inboxes[(self.index + 1) % self.size].put(t.clone())
        self.sent += t.numel()
        return lambda: self.inboxes[self.index].get(timeout=20)

    def _exchange(self, t):
        self.barrier.wait(timeout=20)
        self.gathered[self.index] = t.clone()
        self.barrier.wait(timeout=20)
        every = list(self.gathered)
        self.barrier.wait(timeout=20)
        return every

    def all_gather(self, t):
        return torch.stack(self._exchange(t))

    def reduce_scatter(self, t):
        return sum(part[self.index] for part in self._exchange(t))


def reference(q, k, v):
    """Plain causal attention in float64 (explicit softmax)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(s.shape[-2:], dtype=torch.bool).triu(1)
    return torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ v


def emulate_ranks(cp: int, body) -> list[torch.Tensor]:
    """Run ``body(r, ring)`` for the ``cp`` emulated ranks, each in a thread with its
    :class:`ThreadRing`; each returns its (out, dq, dk, dv) shares; the whole sequence's four
    tensors, unsharded. A rank's error is raised here (the others' barrier aborted)."""
    inboxes = [queue.Queue() for _ in range(cp)]
    gathered: list = [None] * cp
    barrier = threading.Barrier(cp)
    results: list = [None] * cp
    errors: list = []

    def rank(r: int) -> None:
        try:
            results[r] = body(r, ThreadRing(r, cp, inboxes, gathered, barrier))
        except BaseException as exc:   # reported by the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    if errors:
        raise errors[0]
    return [unshard_sequence([res[i] for res in results], dim=2) for i in range(4)]


def run_ring(q, k, v, dout, cp: int, mode: str, fused: bool = False):
    """(out, dq, dk, dv) of the whole sequence, computed by ``cp`` emulated ranks."""
    def body(r, ring):
        mine = [shard_sequence(t, r, cp, dim=2).detach().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*mine, ring, mode=mode, fused=fused)
        out.backward(shard_sequence(dout, r, cp, dim=2))
        return (out.detach(), *(t.grad for t in mine))
    return emulate_ranks(cp, body)


def _inputs(seq: int, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, seq, 8, generator=g, dtype=dtype) for _ in range(4)]


@pytest.mark.parametrize("cp,mode", [(2, "ring"), (3, "ring"), (4, "ring"), (2, "allgather"),
                                     (4, "allgather")])
def test_ring_equals_causal_attention_float64(cp, mode):
    q, k, v, dout = _inputs(8 * cp)
    want = [t.requires_grad_() for t in (q.clone(), k.clone(), v.clone())]
    ref = reference(*want)
    ref.backward(dout)
    got = run_ring(q, k, v, dout, cp, mode)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, [ref.detach()] + [t.grad for t in want]):
        atol = fp64_atol(scale_of([w]), q.shape[2])
        err = float((g - w).abs().max())
        assert err <= atol, f"cp {cp} {mode}: {name} max error {err:.3e} > {atol:.3e}"


@pytest.mark.parametrize("fused", [False, True] if fused_available(torch.device("cpu")) else [False])
def test_grouped_query_ring_equals_causal_attention(fused):
    """k/v with fewer heads than q (each serving 2 query heads, as Hugging Face's repeat_kv):
    the ring passes them at their own head count; dK/dV sum over the heads each serves. Bug:
    the k/v heads repeated in another order (tiled) than the query heads' groups."""
    g = torch.Generator().manual_seed(1)
    dtype = torch.float32 if fused else torch.float64
    q, dout = (torch.randn(2, 4, 16, 8, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, 16, 8, generator=g, dtype=dtype) for _ in range(2))
    want = [t.clone().double().requires_grad_() for t in (q, k, v)]
    ref = reference(want[0], *(t.repeat_interleave(2, dim=1) for t in want[1:]))
    ref.backward(dout.double())
    got = run_ring(q, k, v, dout, 2, "ring", fused=fused)
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, [ref.detach()] + [t.grad for t in want]):
        if fused:
            assert_fp32_close(a, w, scale=scale_of([w]), terms=q.shape[2], what=name)
        else:
            assert float((a - w).abs().max()) <= fp64_atol(scale_of([w]), q.shape[2]), name


@pytest.mark.skipif(not fused_available(torch.device("cpu")), reason="no fused CPU kernel with lse")
def test_ring_with_fused_blocks_equals_causal_attention():
    q, k, v, dout = _inputs(16)
    want = [t.requires_grad_() for t in (q.clone(), k.clone(), v.clone())]
    ref = reference(*want)
    ref.backward(dout)
    got = run_ring(q, k, v, dout, 2, "ring", fused=True)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, [ref.detach()] + [t.grad for t in want]):
        atol = fp64_atol(scale_of([w]), q.shape[2])
        assert float((g - w).abs().max()) <= atol, name


def _devices():
    out = [torch.device("cpu")]
    if torch.cuda.is_available():
        out.append(torch.device("cuda"))
    return out


@pytest.mark.parametrize("device", _devices(), ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_fused_blocks_equal_the_math_path(device, causal):
    """The device's fused kernel (CPU flash, CUDA memory-efficient) returns the same block
    output, log-sum-exp and gradients as the math path, within float32 rounding."""
    if not fused_available(device):
        pytest.skip(f"no fused kernel returning the log-sum-exp on {device.type}")
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(2, 4, 40, 16, generator=g).to(device) for _ in range(4))
    o_m, l_m = attend_block(q, k, v, causal=causal)
    o_f, l_f = attend_block(q, k, v, causal=causal, fused=True)
    terms = k.shape[2] * k.shape[3]
    assert_fp32_close(o_f.cpu(), o_m.cpu(), scale=scale_of([v]), terms=terms, what="out")
    assert_fp32_close(l_f.cpu(), l_m.cpu(), scale=scale_of([l_m]), terms=terms, what="lse")
    grads_m = attend_block_backward(dout, q, k, v, o_m, l_m, causal=causal)
    grads_f = attend_block_backward(dout, q, k, v, o_m, l_m, causal=causal, fused=True)
    for name, f, m in zip(("dq", "dk", "dv"), grads_f, grads_m):
        assert_fp32_close(f.float().cpu(), m.cpu(), scale=scale_of([m]), terms=terms, what=name)


def test_zigzag_partition():
    x = torch.arange(16).view(1, 16)
    assert chunk_ids(0, 4) == (0, 7) and chunk_ids(3, 4) == (3, 4)
    parts = [shard_sequence(x, r, 4) for r in range(4)]
    assert parts[1].tolist() == [[2, 3, 12, 13]]
    assert torch.equal(unshard_sequence(parts), x)
    assert zigzag_positions(4, 1, 4).tolist() == [2, 3, 12, 13]
    from trainmesh.core.errors import ConfigError
    with pytest.raises(ConfigError, match="divisible by 2 x cp = 8"):
        shard_sequence(torch.zeros(1, 12), 0, 4)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_sends_what_the_formula_says(cp):
    """The emulated ring's elements sent, forward and backward, equal the traffic formula."""
    b, h, hd, seq = 2, 3, 8, 8 * cp
    q, k, v, dout = _inputs(seq)
    counters = []
    original = ThreadRing.shift

    def counting(self, t):
        counters.append(t.numel())
        return original(self, t)

    ThreadRing.shift = counting
    try:
        run_ring(q, k, v, dout, cp, "ring")
    finally:
        ThreadRing.shift = original
    want = cp_bytes_per_layer(cp=cp, micro_batch=b, seq_len=seq, d_model=h * hd, elem_bytes=8,
                              grad_bytes=8)
    assert sum(counters) * 8 == cp * want["send"]


# ---------------------------------------------------------------- planner
LLAMA3_8B = dict(params=8_030_261_248, layers=32, hidden=4096, heads=32, vocab=128256)


def test_planner_divides_activations_by_cp_and_adds_the_ring():
    from trainmesh.config.parallel import ParallelConfig
    from trainmesh.planner import Cluster, ModelShape
    from trainmesh.planner.candidate import evaluate
    model = ModelShape(**{**LLAMA3_8B, "vocab": None}, seq_len=32768)
    cluster = Cluster(gpus=8)
    one, four = (evaluate(ParallelConfig(dp=8 // cp, cp=cp, zero=1, recompute="selective",
                                         precision="bf16", microbatches=4), model, cluster)
                 for cp in (1, 4))
    assert four.memory.activations == pytest.approx(one.memory.activations / 4, rel=1e-12)
    want = cp_bytes_per_layer(cp=4, micro_batch=1, seq_len=32768, d_model=4096, elem_bytes=2,
                              forwards=2)
    assert four.traffic["cp"] == {op: b * 32 * 4 for op, b in want.items()}
    assert "cp" not in one.traffic or not one.traffic["cp"]


def test_planner_recommends_cp_when_activations_fit_no_other_way():
    """A 524,288-token sequence on 32 GPUs of 80 GB (at 131,072 tokens tp 8 with full recompute
    already holds it: full recompute keeps only the layer inputs)."""
    from trainmesh.planner import Cluster, ModelShape, plan
    result = plan(ModelShape(**LLAMA3_8B, seq_len=524288), Cluster(gpus=32, gpu_mem_bytes=80 * 10**9),
                  global_batch=4)
    assert result.recommended.layout.cp > 1 and result.recommended.fits
    assert not any(c.fits for c in result.candidates if c.layout.cp == 1)
    assert "context parallelism" in result.why
    short = plan(ModelShape(**LLAMA3_8B, seq_len=4096), Cluster(gpus=8, gpu_mem_bytes=80 * 10**9))
    assert short.recommended.layout.cp == 1      # fits without it: no cp
