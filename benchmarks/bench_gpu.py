"""trainmesh on one GPU vs a plain ``torch.compile``'d training loop of the same GPT.

The targets: trainmesh ``--compile`` at >= 1.0x the plain compiled loop's tokens/s and >= 50%
MFU on an H100 (bf16). Both live in this process and alternate steps, so clock and thermal
drift hit both alike; each reports the median of its timed steps. The plain loop is PyTorch's own
recipe in this file: same model, batch, AdamW (fused), bf16 autocast, clip 1.0.
Run from the repository root on a machine with a CUDA GPU (and triton):

    python benchmarks/bench_gpu.py --steps 30            # GPT-2 small shape, batch 16 x 1024
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from trainmesh import Engine, ParallelConfig
from trainmesh.core.distributed import init_distributed, shutdown
from trainmesh.models.gpt import GPT, GPTConfig
from trainmesh.observe.flops import device_peak_tflops, mfu
from trainmesh.run.trainer import no_decay


def plain_step(model: GPT, dtype: torch.dtype) -> Callable[[dict], float]:
    """The plain loop: whole model compiled, fused AdamW, autocast, clip 1.0."""
    groups: dict[float, list] = {}
    for name, p in model.named_parameters():
        groups.setdefault(no_decay(name)["weight_decay"], []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "weight_decay": wd} for wd, ps in groups.items()],
                            lr=3e-4, betas=(0.9, 0.95), fused=True)
    fwd = torch.compile(model)

    def step(batch: dict) -> float:
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            loss_sum, count = fwd(**batch)
            loss = loss_sum / count
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def engine_step(model: GPT, precision: str) -> Callable[[dict], float]:
    """trainmesh: per-block compile, fused AdamW (as ``trainmesh train`` builds it)."""
    adamw = lambda ps: torch.optim.AdamW(ps, lr=3e-4, betas=(0.9, 0.95), fused=True)  # noqa: E731
    engine = Engine(model, adamw, lambda m, b: m(**b), param_groups=no_decay, broadcast_init=False,
                    config=ParallelConfig(precision=precision, compile=True, grad_clip=1.0))
    return engine.train_step


def timed(fn: Callable[[dict], float], batch: dict) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(batch)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab-size", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--peak-tflops", type=float, default=None, help="default: the table's entry")
    a = ap.parse_args()
    device = init_distributed(device="cuda")
    cfg = GPTConfig(vocab_size=a.vocab_size, seq_len=a.seq_len, d_model=a.d_model,
                    n_layers=a.layers, n_heads=a.heads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.precision]
    runs = {"trainmesh": engine_step(GPT(cfg, seed=0, device=device), a.precision),
            "plain": plain_step(GPT(cfg, seed=0, device=device), dtype)}
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for k in range(a.warmup + a.steps):
        ids = torch.randint(0, cfg.vocab_size, (a.batch, cfg.seq_len + 1), generator=g).to(device)
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        for name, fn in runs.items():
            t = timed(fn, batch)
            if k >= a.warmup:
                times[name].append(t)
    peak = device_peak_tflops(device, a.precision, a.peak_tflops)
    tokens = a.batch * cfg.seq_len
    out = {"device": torch.cuda.get_device_name(device), "precision": a.precision,
           "params": cfg.num_params(), "peak_tflops": peak}
    for name, ts in times.items():
        tps = tokens / statistics.median(ts)
        out[name] = {"tokens_per_s": round(tps), "mfu": mfu(tps, cfg.flops_per_token(), peak, 1)}
    out["ratio"] = out["trainmesh"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    print(json.dumps(out))
    shutdown()


if __name__ == "__main__":
    main()
