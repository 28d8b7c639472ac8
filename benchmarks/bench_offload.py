"""ZeRO-Offload: the CPU optimizer step, and what offload costs and buys.

On any machine:

- the CPU AdamW micro-benchmark: one step over a flat fp32 shard of ``--numel`` parameters (what
  a ZeRO rank's offloaded optimizer updates) with torch's for-loop, ``foreach`` and ``fused`` CPU
  kernels; seconds per step, per billion parameters, and the largest difference of the results
  against the for-loop (the three compute the same update up to rounding);
- world 1 throughput of the benchmark GPT at ZeRO-1 with ``--offload none``, ``cpu`` and
  ``nvme`` (alternating steps, medians): what offload costs where host and device are the same.

On CUDA, also the largest GPT (GPT-2 shapes, growing in width and depth) trainable with bf16
AdamW at world 1 without offload and with ``--offload cpu`` (ZeRO-3, ``--offload-params``), and
the host Adam step time per billion parameters at that size. Run from the repository root:

    python benchmarks/bench_offload.py                   # CPU parts
    python benchmarks/bench_offload.py --numel 50000000 --threads 16
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from common import BENCH_GPT, GLOBAL_BATCH, batches  # noqa: E402

from trainmesh import Engine, ParallelConfig, ParallelMesh  # noqa: E402
from trainmesh.models.gpt import GPT, GPTConfig  # noqa: E402

IMPLS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def adam_step_times(numel: int, steps: int) -> dict[str, tuple[float, float]]:
    """{impl: (median seconds per step, max |difference| of the weights vs the for-loop)}."""
    g = torch.Generator().manual_seed(0)
    start = torch.randn(numel, generator=g)
    grads = [torch.randn(numel, generator=g) * 1e-2 for _ in range(3)]
    out, finals = {}, {}
    for name, kw in IMPLS.items():
        p = torch.nn.Parameter(start.clone())
        opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **kw)
        times = []
        for k in range(steps):
            p.grad = grads[k % len(grads)]
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        finals[name] = p.detach()
        out[name] = statistics.median(times[1:])
    return {n: (t, (finals[n] - finals["for-loop"]).abs().max().item()) for n, t in out.items()}


def offload_throughput(steps: int) -> dict[str, float]:
    """Median step seconds of the benchmark GPT at world 1, ZeRO-1, per --offload setting."""
    data = batches(steps)
    engines = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("none", "cpu", "nvme"):
            cfg = ParallelConfig(zero=1, offload=kind, offload_dir=tmp if kind == "nvme" else None)
            engines[kind] = Engine(GPT(BENCH_GPT, seed=0), lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
                                   lambda m, b: m(**b), cfg, mesh=ParallelMesh(local=True))
        times: dict[str, list[float]] = {k: [] for k in engines}
        for batch in data:
            for kind, engine in engines.items():
                t0 = time.perf_counter()
                engine.train_step(batch)
                times[kind].append(time.perf_counter() - t0)
    return {k: statistics.median(v[2:]) for k, v in times.items()}


def fits(cfg: GPTConfig, offload: str) -> bool:
    """Whether two bf16 AdamW steps of ``cfg`` run on this GPU (world 1)."""
    layout = (ParallelConfig(precision="bf16", zero=3, offload="cpu", offload_params=True)
              if offload == "cpu" else ParallelConfig(precision="bf16"))
    try:
        model = GPT(cfg, seed=0, device="meta")
        engine = Engine(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=offload == "none"),
                        lambda m, b: m(**b), layout, mesh=ParallelMesh(local=True), device="cuda")
        ids = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), device="cuda")
        for _ in range(2):
            engine.train_step({"input_ids": ids, "labels": ids})
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()


def largest_gpt(offload: str) -> GPTConfig:
    """Grow a GPT (d_model = 64 * layers, 16 heads, GPT-2 vocabulary and context) by 8 layers at
    a time until it no longer fits; the last that did (None if none)."""
    best = None
    for layers in range(8, 257, 8):
        d = 64 * layers
        cfg = GPTConfig(vocab_size=50304, seq_len=1024, d_model=d, n_layers=layers, n_heads=16)
        if not fits(cfg, offload):
            break
        best = cfg
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=20_000_000, help="flat shard for the Adam step")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"## CPU AdamW step over a flat shard of {args.numel:,} fp32 parameters, "
          f"{args.threads} threads (torch {torch.__version__})\n")
    print("| implementation | s / step | s / step / 1e9 params | max abs diff vs for-loop |")
    print("|---|---|---|---|")
    for name, (t, diff) in adam_step_times(args.numel, args.steps).items():
        print(f"| {name} | {t:.4f} | {t * 1e9 / args.numel:.2f} | {diff:.1e} |")
    print(f"\n## World 1, ZeRO-1, the benchmark GPT ({BENCH_GPT.num_params():,} params, "
          f"{GLOBAL_BATCH} x {BENCH_GPT.seq_len} tokens per step)\n")
    times = offload_throughput(args.steps + 2)
    print("| --offload | median step (s) | vs none |")
    print("|---|---|---|")
    for kind, t in times.items():
        print(f"| {kind} | {t:.4f} | {t / times['none']:.2f}x |")
    if not torch.cuda.is_available():
        print("\n(no CUDA device: the largest-trainable-model comparison is GPU-only)")
        return
    for offload in ("none", "cpu"):
        cfg = largest_gpt(offload)
        size = f"{cfg.num_params() / 1e9:.2f}B ({cfg.n_layers} layers, d {cfg.d_model})" if cfg else "none"
        print(f"largest bf16 AdamW GPT at world 1, --offload {offload}: {size}")


if __name__ == "__main__":
    main()
