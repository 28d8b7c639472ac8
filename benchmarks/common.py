"""Shared benchmark plumbing: the model, the data, timing and the result table."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from trainmesh.data.corpus import SyntheticCorpus
from trainmesh.models.gpt import GPTConfig

# The benchmarks' common model: a small GPT, 2048 tokens per step.
BENCH_GPT = GPTConfig(vocab_size=1024, seq_len=128, d_model=256, n_layers=4, n_heads=4)
GLOBAL_BATCH = 16


def gpt_round_arguments(ap, *, layers: int, vocab: int, rounds: int) -> None:
    """The GPT shape, global batch and timed-rounds flags the pipeline benchmarks share."""
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--d-model", dest="d_model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=vocab)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    ap.add_argument("--rounds", type=int, default=rounds, help="timed rounds")
    ap.add_argument("--warmup-rounds", dest="warmup_rounds", type=int, default=2)
    ap.add_argument("--json", dest="json_out", help="also write the raw results here")


def batches(steps: int, seed: int = 0):
    data = SyntheticCorpus(BENCH_GPT.vocab_size, BENCH_GPT.seq_len)
    return [data.batch(seed, k, GLOBAL_BATCH) for k in range(steps)]


def timed(fn: Callable[[], float]) -> tuple[float, float]:
    """(seconds, loss) of one call, with a barrier so the slowest rank sets the time."""
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    loss = fn()
    dist.barrier()
    return time.perf_counter() - t0, loss


def interleaved(impls: dict[str, Callable], steps: int, warmup: int, *, rank: int, world: int
                ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(step times after ``warmup``, losses of every step) of each step function, run on this
    rank's DP slice of the same batches, alternating their order each step (no position bias)."""
    from trainmesh.data.corpus import dp_slice
    times: dict[str, list[float]] = {k: [] for k in impls}
    losses: dict[str, list[float]] = {k: [] for k in impls}
    for k, batch in enumerate(batches(steps + warmup)):
        mine = dp_slice(batch, rank, world)
        order = list(impls) if k % 2 == 0 else list(reversed(impls))
        for name in order:
            t, loss = timed(lambda: impls[name](mine))
            if k >= warmup:
                times[name].append(t)
            losses[name].append(loss)
    return times, losses


def report(name_a: str, times_a: list[float], name_b: str, times_b: list[float], tokens: int,
           losses: tuple[list[float], list[float]] | None = None) -> str:
    ma, mb = statistics.median(times_a), statistics.median(times_b)
    lines = [f"| implementation | median step (s) | tokens/s |", "|---|---|---|",
             f"| {name_a} | {ma:.4f} | {tokens / ma:,.0f} |",
             f"| {name_b} | {mb:.4f} | {tokens / mb:,.0f} |",
             "", f"ratio {name_a} / {name_b} tokens/s: **{mb / ma:.3f}x**"]
    if losses:
        diff = max(abs(a - b) for a, b in zip(*losses))
        lines.append(f"max |loss difference| over all steps: {diff:.2e}")
    return "\n".join(lines)


def native_step(module: torch.nn.Module, opt: torch.optim.Optimizer, world: int, *,
                set_to_none: bool = False) -> Callable[[dict], float]:
    """One step of a PyTorch-native baseline: mean loss, backward, clip 1.0, step; the loss
    averaged over ranks (as trainmesh's engine reports it)."""
    import torch.distributed as dist

    def step(batch: dict) -> float:
        loss_sum, count = module(**batch)
        loss = loss_sum / count
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / world
    return step
