#!/usr/bin/env python3
"""Context parallelism: activation memory per rank against cp, and step time of the ring against
the all-gather exchange (and PyTorch's own ``context_parallel`` where it runs).

A GPT whose activations dominate (a long sequence, a narrow model) trains through
``trainmesh.Engine`` with ``ParallelConfig(cp=N, cp_comm=...)``, fp32, one sequence per step:

- **activation memory per rank**: the bytes autograd keeps for the backward pass during one
  training forward, measured with ``torch.autograd.graph.saved_tensors_hooks`` (each storage
  once, parameters excluded), for every cp of ``--cps`` (one launch of cp processes each);
  with the ring it should fall as 1/cp (at cp 4 at most 0.35 of cp 1);
- **step time**: ring and allgather engines alternate step by step in the same processes
  (a load change on a shared machine hits both alike), median over ``--steps``; the ratio
  allgather / ring. Same weights, same batches: their losses must agree.
- PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` is tried on the same
  model and timed where it runs; where it does not (CPU), the first line of its error is shown.

    python benchmarks/bench_cp.py --seq 4096 --cps 1 2 4 --steps 6
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def _gpt(a: dict):
    from trainmesh.models import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=a["vocab"], seq_len=a["seq"], d_model=a["d_model"],
                    n_layers=a["layers"], n_heads=a["heads"])
    return GPT(cfg, seed=0)


def _batches(a: dict, n: int) -> list[dict]:
    from trainmesh.data.corpus import SyntheticCorpus
    corpus = SyntheticCorpus(a["vocab"], a["seq"])
    return [corpus.batch(0, k, 1) for k in range(n)]


def _engine(a: dict, cp: int, mode: str):
    import torch

    import trainmesh as tm
    return tm.Engine(_gpt(a), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                     loss_fn=lambda m, b: m(**b),
                     config=tm.ParallelConfig(cp=cp, cp_comm=mode if cp > 1 else "ring"))


def _saved_bytes(engine, batch: dict) -> int:
    """Bytes of the distinct non-parameter storages autograd saves during one training step."""
    import torch
    params = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.train_step(batch)
    return sum(seen.values())


def _torch_cp_step(a: dict, batch: dict):
    """A timed step of PyTorch's context_parallel on the same model, or the reason it fails."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    model = _gpt(a)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
    try:
        dist.barrier()
        t0 = time.perf_counter()
        with context_parallel(mesh, buffers=[ids, labels], buffer_seq_dims=[1, 1]):
            loss_sum, n = model(ids, labels)
            (loss_sum / n).backward()
        dist.barrier()
        return time.perf_counter() - t0
    except Exception as exc:   # reported, not raised: the benchmark's other figures stand
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def _worker(a: dict, cp: int) -> dict:
    import torch.distributed as dist
    batches = _batches(a, a["steps"] + 2)
    modes = ("ring", "allgather") if cp > 1 else ("ring",)
    engines = {m: _engine(a, cp, m) for m in modes}
    out: dict = {"activation_bytes": {m: _saved_bytes(engines[m], batches[0]) for m in modes}}
    times: dict[str, list[float]] = {m: [] for m in modes}
    losses: dict[str, list[float]] = {m: [] for m in modes}
    for k, batch in enumerate(batches[1:]):
        for i in range(len(modes)):
            mode = modes[(k + i) % len(modes)]       # rotating order
            dist.barrier()
            t0 = time.perf_counter()
            losses[mode].append(engines[mode].train_step(batch))
            dist.barrier()
            if k:   # the first step warms up
                times[mode].append(time.perf_counter() - t0)
    out["step_s"] = {m: statistics.median(v) for m, v in times.items()}
    out["losses"] = losses
    out["traffic"] = {m: engines[m].comm_bytes_per_step().get("cp", {}) for m in modes}
    if cp > 1:
        out["torch_cp"] = _torch_cp_step(a, batches[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--d-model", dest="d_model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per exchange")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    a = vars(args)
    from trainmesh.testing import run_distributed
    results = {cp: run_distributed(_worker, cp, a, cp, timeout_s=600)[0] for cp in args.cps}
    if args.json:
        print(json.dumps({str(cp): r for cp, r in results.items()}))
        return
    base = results[min(args.cps)]["activation_bytes"]["ring"] if 1 in args.cps else None
    print(f"GPT d_model {args.d_model}, {args.layers} layers, seq {args.seq}, vocab {args.vocab}, "
          f"1 sequence per step, fp32\n")
    print("| cp | exchange | activation MiB per rank | vs cp 1 | median step (s) | allgather / ring |")
    print("|---|---|---|---|---|---|")
    for cp, r in results.items():
        for mode, nbytes in r["activation_bytes"].items():
            rel = f"{nbytes / base:.3f}" if base else "-"
            ratio = (f"{r['step_s']['allgather'] / r['step_s']['ring']:.2f}x"
                     if mode == "allgather" else "")
            print(f"| {cp} | {mode} | {nbytes / 2**20:.2f} | {rel} | {r['step_s'][mode]:.3f} | {ratio} |")
    for cp, r in results.items():
        if "allgather" in r["losses"]:
            diff = max(abs(x - y) for x, y in zip(r["losses"]["ring"], r["losses"]["allgather"]))
            print(f"\ncp {cp}: max |loss ring - loss allgather| {diff:.1e}; cp bytes per step "
                  f"{json.dumps(r['traffic'])}")
        if "torch_cp" in r:
            t = r["torch_cp"]
            print(f"cp {cp}: PyTorch context_parallel: "
                  + (f"{t:.3f} s for one step" if isinstance(t, float) else f"does not run here ({t})"))
    if base and 4 in results:
        ratio = results[4]["activation_bytes"]["ring"] / base
        print(f"\ncp 4 ring activations / cp 1: {ratio:.3f} ({'within' if ratio <= 0.35 else 'ABOVE'} 0.35)")


if __name__ == "__main__":
    main()
