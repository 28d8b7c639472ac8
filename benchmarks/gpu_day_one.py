"""GPU day one: every CUDA path of trainmesh once, in one table, within about 8 minutes on one GPU.

Rows (each a check that passes, fails with its error, or is skipped with the reason):

1. ``compile``: ``Engine(compile=True)`` with fused AdamW on the built-in GPT at GPT-2 small's
   shape (12 x 768, 12 heads, seq 1024, vocab 50304, batch 16, bf16) against a compiled plain
   PyTorch loop of the same model in the same process (alternating steps): tokens/s, MFU, ratio.
2. ``cp kernels``: the context-parallel attention blocks' fused CUDA kernels against the math path
   (forward with its log-sum-exp, and backward), bf16, on one (4, 16, 2048, 64) block: the largest
   difference and the time of each.
3. ``precision``: bf16 and fp16 (dynamic loss scaling) against fp32 on a smaller GPT for 30 steps:
   tokens/s and the largest loss difference from fp32.
4. ``offload``: ZeRO-1 with ``--offload cpu`` (pinned host buffers) at world 1 on a model whose
   states are 3x the memory the GPU is allowed (``torch.cuda.set_per_process_memory_fraction``
   caps it at ``--offload-gpu-gib``): it must train where the same model without offload cannot.
5. ``planner``: ``trainmesh train`` on the GPU (the compile row's model, bf16, 4 steps) against
   ``trainmesh plan``'s predicted peak memory for that run.

Without CUDA it refuses with one line and exit 2. Run from the repository root:

    python benchmarks/gpu_day_one.py                  # everything (about 8 minutes on an H100)
    python benchmarks/gpu_day_one.py --only cp,precision --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROWS = ("compile", "cp", "precision", "offload", "planner")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):      # one line, exit 2 (no usage block)
        print(f"gpu_day_one: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = _Parser(description="Every CUDA path of trainmesh once, in one table.")
    ap.add_argument("--only", default=",".join(ROWS),
                    help=f"comma-separated rows to run, of: {', '.join(ROWS)} (default all)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps of the compile row (default 20)")
    ap.add_argument("--offload-gpu-gib", type=float, default=4.0,
                    help="GPU memory the offload row allows itself (default 4 GiB)")
    ap.add_argument("--json", default=None, help="also write the table as JSON to this file")
    a = ap.parse_args(argv)
    rows = [r.strip() for r in a.only.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        ap.error(f"--only: unknown row {', '.join(bad) or '(none)'}; valid: {', '.join(ROWS)}")
    if a.steps < 1 or not (0 < a.offload_gpu_gib < 1e4):
        ap.error("--steps must be >= 1 and --offload-gpu-gib in (0, 10000)")
    a.rows = rows
    return a


def cuda_or_exit() -> None:
    import torch
    if not torch.cuda.is_available():
        print("gpu_day_one: no CUDA device here (torch.cuda.is_available() is False); "
              "run it on a machine with a GPU", file=sys.stderr)
        raise SystemExit(2)


# ---------------------------------------------------------------- rows
def row_compile(a: argparse.Namespace) -> dict:
    import torch
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_gpu import engine_step, plain_step, timed

    from trainmesh.models.gpt import GPT, GPTConfig
    from trainmesh.observe.flops import device_peak_tflops, mfu
    cfg = GPTConfig(vocab_size=50304, seq_len=1024, d_model=768, n_layers=12, n_heads=12)
    device = torch.device("cuda")
    runs = {"trainmesh": engine_step(GPT(cfg, seed=0, device=device), "bf16"),
            "plain": plain_step(GPT(cfg, seed=0, device=device), torch.bfloat16)}
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {k: [] for k in runs}
    warmup = 3
    for k in range(warmup + a.steps):
        ids = torch.randint(0, cfg.vocab_size, (16, cfg.seq_len + 1), generator=g).to(device)
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        for name, fn in runs.items():
            t = timed(fn, batch)
            if k >= warmup:
                times[name].append(t)
    peak = device_peak_tflops(device, "bf16", None)
    out = {}
    for name, ts in times.items():
        tps = 16 * cfg.seq_len / statistics.median(ts)
        out[name] = {"tokens_per_s": round(tps),
                     "mfu": None if peak is None else round(mfu(tps, cfg.flops_per_token(), peak, 1), 3)}
    ratio = out["trainmesh"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    return {"ok": ratio >= 0.9, "ratio": round(ratio, 3), **out,
            "summary": f"trainmesh {out['trainmesh']['tokens_per_s']} tok/s (MFU "
                       f"{out['trainmesh']['mfu']}) vs plain {out['plain']['tokens_per_s']} "
                       f"(MFU {out['plain']['mfu']}): {ratio:.2f}x"}


def _cuda_time(fn: Callable[[], object], reps: int = 10) -> float:
    import torch
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def row_cp(a: argparse.Namespace) -> dict:
    import torch

    from trainmesh.context_parallel.blocks import attend_block, attend_block_backward, fused_available
    device = torch.device("cuda")
    if not fused_available(device):
        return {"ok": False, "summary": "no fused kernel with log-sum-exp in this torch"}
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(4, 16, 2048, 64, generator=g, device=device, dtype=torch.bfloat16)
                     for _ in range(4))
    res: dict = {}
    for causal in (True, False):
        fo, fl = attend_block(q, k, v, causal=causal, fused=True)
        mo, ml = attend_block(q, k, v, causal=causal, fused=False)
        fwd_err = max(float((fo - mo).abs().max()), float((fl - ml).abs().max()))
        fg = attend_block_backward(dout, q, k, v, mo, ml, causal=causal, fused=True)
        mg = attend_block_backward(dout, q, k, v, mo, ml, causal=causal, fused=False)
        bwd_err = max(float((x.float() - y.float()).abs().max() / (y.float().abs().max() + 1e-6))
                      for x, y in zip(fg, mg))
        t_fused = _cuda_time(lambda: attend_block_backward(
            dout, q, k, v, mo, ml, causal=causal, fused=True)) + \
            _cuda_time(lambda: attend_block(q, k, v, causal=causal, fused=True))
        t_math = _cuda_time(lambda: attend_block_backward(
            dout, q, k, v, mo, ml, causal=causal, fused=False)) + \
            _cuda_time(lambda: attend_block(q, k, v, causal=causal, fused=False))
        res["causal" if causal else "full"] = {"fwd_max_abs": fwd_err, "bwd_max_rel": bwd_err,
                                               "fused_ms": t_fused * 1e3, "math_ms": t_math * 1e3}
    # bf16 inputs: outputs agree to a few bf16 ulps of values of order 1 (2^-8 each)
    ok = all(r["fwd_max_abs"] < 0.05 and r["bwd_max_rel"] < 0.05 for r in res.values())
    c = res["causal"]
    return {"ok": ok, **res, "summary": f"causal fwd+bwd fused {c['fused_ms']:.2f} ms vs math "
            f"{c['math_ms']:.2f} ms; max diff fwd {c['fwd_max_abs']:.2e}, bwd {c['bwd_max_rel']:.2e} rel"}


def _train_losses(precision: str, steps: int) -> tuple[list[float], float]:
    import torch

    from trainmesh import Engine, ParallelConfig
    from trainmesh.models.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=8192, seq_len=512, d_model=512, n_layers=6, n_heads=8)
    model = GPT(cfg, seed=0, device=torch.device("cuda"))
    engine = Engine(model, lambda ps: torch.optim.AdamW(ps, lr=3e-4, fused=True),
                    lambda m, b: m(**b), broadcast_init=False,
                    config=ParallelConfig(precision=precision, grad_clip=1.0))
    g = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (16, cfg.seq_len + 1), generator=g).cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(engine.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return losses, 16 * cfg.seq_len / statistics.median(times[3:])


def row_precision(a: argparse.Namespace) -> dict:
    ref, ref_tps = _train_losses("fp32", 30)
    res = {"fp32": {"tokens_per_s": round(ref_tps)}}
    for p in ("bf16", "fp16"):
        losses, tps = _train_losses(p, 30)
        res[p] = {"tokens_per_s": round(tps), "finite": all(map(math.isfinite, losses)),
                  "max_loss_diff": max(abs(x - y) for x, y in zip(losses, ref))}
    # random tokens: the loss stays near log(8192) = 9.0; low precision moves it by ~1e-2
    ok = all(res[p]["finite"] and res[p]["max_loss_diff"] < 0.1 for p in ("bf16", "fp16"))
    return {"ok": ok, **res, "summary": "; ".join(
        f"{p} {res[p]['tokens_per_s']} tok/s" + (f", max loss diff {res[p]['max_loss_diff']:.3f}"
                                                if p != "fp32" else "") for p in res)}


def row_offload(a: argparse.Namespace) -> dict:
    import torch

    from trainmesh import Engine, ParallelConfig
    from trainmesh.models.gpt import GPT, GPTConfig
    total = torch.cuda.get_device_properties(0).total_memory
    allowed = a.offload_gpu_gib * 2**30
    torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total))
    # states of mixed-precision Adam: 16 bytes a parameter; 3x the allowed memory
    d, layers = 2048, 1
    while GPTConfig(vocab_size=8192, seq_len=256, d_model=d, n_layers=layers,
                    n_heads=16).num_params() * 16 < 3 * allowed:
        layers += 1
    cfg = GPTConfig(vocab_size=8192, seq_len=256, d_model=d, n_layers=layers, n_heads=16)
    n = cfg.num_params()
    out: dict = {"params": n, "states_gib": round(n * 16 / 2**30, 1), "gpu_gib": a.offload_gpu_gib}

    def attempt(offload: str) -> float:
        model = GPT(cfg, seed=0, device=torch.device("meta"))
        engine = Engine(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4), lambda m, b: m(**b),
                        config=ParallelConfig(zero=1, offload=offload, precision="bf16",
                                              grad_clip=1.0),
                        init_fn=model.init_parameter, device="cuda")
        ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1)).cuda()
        t0 = time.perf_counter()
        for _ in range(3):
            engine.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 3
    try:
        attempt("none")
        out["without"] = "fit (the cap did not bind)"
    except torch.OutOfMemoryError:
        out["without"] = "out of memory (as expected)"
    torch.cuda.empty_cache()
    out["step_s"] = round(attempt("cpu"), 2)
    out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    torch.cuda.set_per_process_memory_fraction(1.0)
    return {"ok": out["peak_gib"] <= a.offload_gpu_gib, **out,
            "summary": f"{n / 1e9:.2f}B params ({out['states_gib']} GiB of states) in "
                       f"{a.offload_gpu_gib} GiB of GPU: {out['step_s']} s/step, peak "
                       f"{out['peak_gib']} GiB; without offload: {out['without']}"}


def row_planner(a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--layers", "12", "--d-model", "768", "--heads", "12", "--seq-len", "1024",
                 "--vocab-size", "50304", "--global-batch", "16", "--precision", "bf16",
                 "--device", "cuda", "--steps", "4", "--warmup-steps", "1"]
        metrics = os.path.join(tmp, "m.jsonl")
        run = subprocess.run([sys.executable, "-m", "trainmesh", "train", *flags, "--metrics-out",
                              metrics], capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            return {"ok": False, "summary": f"train exited {run.returncode}: "
                    f"{(run.stderr or run.stdout).strip().splitlines()[-1:]}"}
        summary = next(json.loads(x) for x in open(metrics) if '"summary"' in x)
        from trainmesh.config.train import build_train_config
        from trainmesh.planner.predict import predict_run
        values = {"layers": 12, "d_model": 768, "heads": 12, "seq_len": 1024, "vocab_size": 50304,
                  "global_batch": 16, "precision": "bf16", "device": "cuda", "steps": 4}
        predicted = predict_run(build_train_config(values)).ranks[0].peak_mem_bytes
    measured = summary["ranks"][0]["peak_mem_bytes"]
    ratio = predicted / measured
    return {"ok": abs(ratio - 1) <= 0.15, "predicted": predicted, "measured": measured,
            "summary": f"predicted {predicted / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB "
                       f"({ratio:.2f}x)"}


RUNNERS: dict[str, Callable[[argparse.Namespace], dict]] = {
    "compile": row_compile, "cp": row_cp, "precision": row_precision, "offload": row_offload,
    "planner": row_planner}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cuda_or_exit()
    import torch
    table: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "date": time.strftime("%Y-%m-%d"), "rows": {}}
    print(f"gpu_day_one on {table['device']} (torch {table['torch']})", flush=True)
    for name in a.rows:
        t0 = time.perf_counter()
        try:
            result = RUNNERS[name](a)
        except Exception as exc:      # a day-one check reports what broke and goes on
            result = {"ok": False, "summary": f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                      "traceback": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - t0, 1)
        table["rows"][name] = result
        print(f"| {name:9} | {'ok  ' if result['ok'] else 'FAIL'} | {result['seconds']:6.1f} s | "
              f"{result['summary']} |", flush=True)
        torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(table, indent=1, default=str))
    return 0 if all(r["ok"] for r in table["rows"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
