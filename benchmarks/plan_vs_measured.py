"""`trainmesh plan`'s predictions against what `trainmesh train` measures, layout by layout.

Every row of :data:`MATRIX` is one `trainmesh train` run of a memory-heavy tiny GPT (:data:`MODEL`:
small widths, long sequences and a large vocabulary, so activations and logits rather than the
runtime's own footprint make up the peak, while a step stays cheap on a CPU). The run's summary
(``--metrics-out``) is compared with :func:`trainmesh.planner.predict.predict_run` rank by rank:
model-state bytes and traffic within 1%, peak memory within 10% (on the base the worker
measured, ``base_mem_bytes``).

    python benchmarks/plan_vs_measured.py                 # run every layout, print the table
    python benchmarks/plan_vs_measured.py --write         # ... and store the summaries
    python benchmarks/plan_vs_measured.py --stored        # the table from the stored summaries
    python benchmarks/plan_vs_measured.py --published     # the published runs' table (no run)

The stored summaries (:data:`STORED`, the fields the comparison reads) let the test suite check
the planner against every measured layout without running them (tests/test_planner_references.py); adding a
layout is one line in :data:`MATRIX` and a run with ``--write``. Peak memory does not depend on
the machine's load; the times of these runs are not used.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MODEL = ["--model", "tiny", "--layers", "4", "--d-model", "64", "--heads", "4", "--seq-len", "256",
         "--vocab-size", "4096", "--global-batch", "16", "--steps", "2", "--warmup-steps", "1"]
MOE = ["--experts", "4", "--top-k", "2"]
LAYOUT_16 = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "16", "--vocab-size", "64",
             "--global-batch", "8", "--steps", "20", "--warmup-steps", "5", "--optimizer", "adamw",
             "--experts", "4", "--moe-aux-loss", "0.1", "--dp", "2", "--zero", "3", "--tp", "2",
             "--sequence-parallel", "--pp", "2", "--microbatches", "2", "--cp", "2", "--ep", "2"]
"""Every axis at once, 16 processes, on a model of its own (its flags override :data:`MODEL`'s)."""

MATRIX: list[list[str]] = [
    [],                                                               # one process
    ["--dp", "2"],                                                    # DDP
    ["--dp", "2", "--zero", "1"],
    ["--dp", "2", "--zero", "2"],
    ["--dp", "2", "--zero", "3"],
    ["--dp", "2", "--zero", "2", "--microbatches", "2"],              # accumulation
    ["--dp", "4", "--dp-shard", "2", "--zero", "3"],                  # HSDP
    ["--tp", "2"],
    ["--tp", "2", "--sequence-parallel"],
    ["--pp", "2", "--microbatches", "4"],
    ["--pp", "2", "--microbatches", "4", "--schedule", "interleaved", "--virtual-stages", "2"],
    ["--cp", "2"],
    ["--cp", "2", "--cp-comm", "allgather"],
    ["--dp", "2", "--recompute", "selective"],
    ["--dp", "2", "--recompute", "full"],
    ["--tp", "2", "--sequence-parallel", "--recompute", "full"],
    ["--dp", "2", "--zero", "1", "--precision", "bf16"],
    ["--dp", "2", "--pp", "2", "--microbatches", "2", "--zero", "1"],
    ["--dp", "2", "--tp", "2", "--sequence-parallel", "--zero", "3"],
    [*MOE],
    [*MOE, "--dp", "2", "--ep", "2"],
    [*MOE, "--dp", "2", "--ep", "2", "--zero", "3", "--recompute", "full"],
    ["--dp", "4", "--dp-shard", "2", "--zero", "3", "--tp", "2"],     # HSDP x tp
    ["--dp", "4", "--dp-shard", "2", "--zero", "1", "--pp", "2", "--microbatches", "2"],
    ["--dp", "4", "--dp-shard", "2", "--zero", "2", "--cp", "2"],     # HSDP x cp: dp_shard_cp
    [*MOE, "--cp", "2", "--ep", "2"],                                 # experts under cp
    [*MOE, "--tp", "2"],                                              # experts under tp
    [*MOE, "--dp", "2", "--ep", "2", "--tp", "2", "--sequence-parallel"],
    ["--tp", "2", "--sequence-parallel", "--zero", "1", "--offload", "cpu"],
    LAYOUT_16,
]
"""The CPU matrix: one layout per line (dense and MoE; dp, ZeRO 1-3, HSDP, tp + SP, pp, cp, ep;
recompute none/selective/full)."""

STORED = Path(__file__).with_name("plan_vs_measured.json")
RANK_FIELDS = ("rank", "coords", "base_mem_bytes", "init_peak_mem_bytes", "setup_mem_bytes",
               "peak_mem_bytes", "model_state_bytes", "comm_bytes_per_step", "comm_buffer_peak_bytes",
               "offloaded_bytes", "moe_rows")


def name(layout: list[str]) -> str:
    return " ".join(layout) or "(one process)"


def measure(layout: list[str], tmp: Path, timeout: float = 900) -> dict[str, Any]:
    """The summary of one run of ``layout``, reduced to what the comparison reads."""
    out = tmp / "m.jsonl"
    proc = subprocess.run([sys.executable, "-m", "trainmesh", "train", *MODEL, *layout,
                           "--metrics-out", str(out)], capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{name(layout)}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    summary = json.loads(out.read_text().splitlines()[-1])
    return {"params": summary["params"], "steps": summary["steps"],
            "ranks": [{k: r[k] for k in RANK_FIELDS if k in r} for r in summary["ranks"]]}


def config(layout: list[str]) -> Any:
    """The TrainConfig ``trainmesh train`` builds from the benchmark's flags."""
    from trainmesh.cli import build_parser
    from trainmesh.cli.train import collect
    from trainmesh.config.train import build_train_config
    return build_train_config(collect(build_parser().parse_args(["train", *MODEL, *layout]), True))


def peak_errors(layout: list[str], measured: dict[str, Any]) -> list[tuple[int, float, float, float]]:
    """Per rank: (rank, predicted peak on the measured base, measured peak, relative error)."""
    from trainmesh.planner.predict import predict_run
    pred = predict_run(config(layout))
    out = []
    by_rank = {r["rank"]: r for r in measured["ranks"]}
    for r in pred.ranks:
        got = by_rank[r.rank]
        want = r.peak_mem_bytes + got["base_mem_bytes"] - r.base_mem_bytes
        out.append((r.rank, want, got["peak_mem_bytes"], want / got["peak_mem_bytes"] - 1))
    return out


def table(results: dict[str, dict[str, Any]]) -> tuple[list[str], int]:
    """Markdown rows (the worst rank of each layout) and the count of layouts off tolerance."""
    from trainmesh.planner.predict import compare, predict_run
    rows, bad = [], 0
    for layout in MATRIX:
        measured = results.get(name(layout))
        if measured is None:
            rows.append(f"| `{name(layout)}` | - | - | - | - | not measured |")
            continue
        problems = compare(predict_run(config(layout)), measured)
        bad += bool(problems)
        rank, want, have, err = max(peak_errors(layout, measured), key=lambda e: abs(e[3]))
        base = next(r["base_mem_bytes"] for r in measured["ranks"] if r["rank"] == rank)
        above = (want - base) / (have - base) - 1
        rows.append(f"| `{name(layout)}` | {len(measured['ranks'])} | {want / 2**20:,.0f} | "
                    f"{have / 2**20:,.0f} | {err:+.1%} ({above:+.1%}) | "
                    f"{'ok' if not problems else '; '.join(problems)[:100]} |")
    return rows, bad


def published_table() -> list[str]:
    """Markdown rows: each published run's own layout predicted (memory, fit, step time with the
    efficiency of the table) against what its source gives."""
    from dataclasses import replace

    from trainmesh.planner.candidate import evaluate
    from trainmesh.planner.calibrate import reference_setup
    from trainmesh.planner.efficiency import assumed_efficiency
    from trainmesh.planner.references import REFERENCES
    rows = []
    for ref in REFERENCES:
        layout, model, cluster = reference_setup(ref)
        assumed = assumed_efficiency(ref.accelerator, model.active_params)
        c = evaluate(layout, model, replace(cluster, efficiency=assumed.efficiency), ref.kernels)
        mem = c.memory.total / 2**30
        peak = (f"{mem:.1f} GiB vs {ref.peak_mem_bytes / 2**30:.1f} ({mem * 2**30 / ref.peak_mem_bytes - 1:+.0%})"
                if ref.peak_mem_bytes else f"{mem:.1f} GiB")
        ratio = c.time.total / ref.step_time_s
        timing = f"{c.time.total:.3g} s vs {ref.step_time_s:.3g} s ({ratio:.2f}x)" + \
            (", FP8: not checked" if ref.fp8 else "")
        others = assumed_efficiency(ref.accelerator, model.active_params, exclude=ref.name)
        loo = evaluate(layout, model, replace(cluster, efficiency=others.efficiency), ref.kernels)
        rows.append(f"| {ref.name} | {ref.figure} | {assumed.efficiency:.0%} | {peak}, "
                    f"{'fits' if c.fits else 'DOES NOT FIT'} | {timing} | "
                    f"{others.efficiency:.0%}: {loo.time.total / ref.step_time_s:.2f}x |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"store the summaries in {STORED.name}")
    ap.add_argument("--stored", action="store_true", help="compare the stored summaries, run nothing")
    ap.add_argument("--only", type=int, nargs="*", help="run only these rows of MATRIX")
    ap.add_argument("--published", action="store_true", help="the published runs' table only")
    args = ap.parse_args()
    if args.published:
        print("| run | published | efficiency (table) | predicted peak | predicted step time | "
              "without the run itself |")
        print("|---|---|---|---|---|---|")
        print("\n".join(published_table()))
        return 0
    results: dict[str, dict[str, Any]] = json.loads(STORED.read_text()) if STORED.exists() else {}
    if not args.stored:
        with tempfile.TemporaryDirectory() as tmp:
            for i, layout in enumerate(MATRIX):
                if args.only is None or i in args.only:
                    print(f"running {name(layout)}", file=sys.stderr, flush=True)
                    results[name(layout)] = measure(layout, Path(tmp))
                    if args.write:
                        STORED.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    rows, bad = table(results)
    print("| layout | ranks | peak predicted (MiB) | measured (MiB) | error (above the base) | "
          "within tolerance |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
