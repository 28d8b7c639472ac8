"""Published training runs: their layouts, what they measured, and where it is written.

Each :class:`Reference` is a run as its source gives it: the model (:mod:`.published`), the
accelerator and how many, the layout, the kernels' conventions (what their selective
recompute keeps), the throughput figure quoted as the source words it, the step time that figure
implies, and the peak memory where the source reports one. They serve three purposes:

* the efficiency the time model assumes without ``--calibrate`` (:mod:`.efficiency`): each
  bf16 run's compute efficiency (stored, ``efficiency``) is what makes the planner's step time
  equal the published one; a plan takes the median over the runs on its accelerator;
* the memory model's check against published peaks (the CUDA allocator's reserve is fitted to
  torchtitan's context-parallel runs, :data:`~.peak.CUDA_FRAGMENTATION`);
* the test that every run's own layout is predicted to fit and its step time comes out within
  1.25x of the published one (tests/test_planner.py, docs/PLANNER.md).

Runs in FP8 (``fp8=True``) are listed for their layout and memory; the time model has no FP8 rate,
so their step time is shown, not checked, and they stay out of the efficiency table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .activations import TRAINMESH, Kernels

GIB = 2**30
LLAMA_ASSUMED = ("the table gives tp, cp, pp, dp and the batch; assumed: the interleaved schedule with 2 "
                 "virtual stages, ZeRO-1, full recomputation (without it the activations exceed 80 GB)")
TORCHTITAN = Kernels(attention="flash", selective="op")
"""torchtitan: PyTorch's flash attention, op-level selective recompute."""
MEGATRON_2021 = Kernels(attention="math", selective="attention", dropout=True)
"""Megatron-LM in 2021: unfused attention and dropout (Korthikanti et al. 2022's accounting)."""
KERNELS = {"trainmesh": TRAINMESH, "torchtitan": TORCHTITAN, "megatron-2021": MEGATRON_2021}
"""The conventions ``trainmesh plan --kernels`` names."""
TORCHTITAN_H100 = ("torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (commit 9dec370, "
                   "December 2024): H100 96GB HBM2e at the default 500 W limit")
H100_500W = "h100-hbm2e-500w"
"""torchtitan's H100s: 96 GB HBM2e at a 500 W limit (peak between the SXM's and the NVL's; MFU
taken against the SXM's 989 TFLOP/s, as torchtitan does)."""
TORCHTITAN_A100 = "torchtitan, docs/performance.md (December 2024), 64 A100 80GB"


@dataclass(frozen=True)
class Reference:
    """One published run."""

    name: str
    source: str
    model: str
    """Key of :data:`~.published.MODELS`."""
    gpu: str
    """Row of :data:`trainmesh.core.gpus.GPUS` whose peak and links apply."""

    gpus: int
    layout: dict[str, Any]
    """:class:`~trainmesh.config.parallel.ParallelConfig` fields (precision bf16 unless given)."""
    micro_batch: int
    global_batch: int
    seq_len: int
    figure: str
    """The throughput as the source gives it."""
    step_time_s: float
    """The step time the figure implies (tokens per step / tokens per second, or FLOPs / FLOP/s)."""
    kernels: Kernels = TRAINMESH
    peak_mem_bytes: float | None = None
    """Peak memory per GPU as the source reports it (torchtitan: the allocator's reserved peak)."""
    gpu_mem_bytes: float | None = None
    """Memory of the cards used where it is not the row's."""
    cluster: dict[str, Any] = field(default_factory=dict)
    """Other :class:`~.cluster.Cluster` fields where the machines differ from the row."""
    fp8: bool = False
    note: str = ""
    efficiency: float | None = None
    """The compute efficiency the run implies (:func:`~.calibrate.implied_efficiency`; a test
    recomputes it); None for FP8 runs, which stay out of the table."""
    card: str = ""
    """The accelerator as run, the efficiency table's key (empty: the ``gpu`` row itself)."""

    @property
    def accelerator(self) -> str:
        return self.card or self.gpu


def _tps(tokens_per_gpu_step: float, tps: float) -> float:
    """Step time from tokens per GPU per step and the tokens per second per GPU."""
    return tokens_per_gpu_step / tps


def _titan_h100(name: str, gpus: int, tps: float, gib: float, table: str, efficiency: float) -> Reference:
    return Reference(name, f"{TORCHTITAN_H100}, table {table}", "llama3-8b", "h100", gpus,
                     dict(dp=gpus, zero=3, recompute="selective"), 2, 2 * gpus, 8192,
                     f"{tps:,.0f} tokens/s per GPU, {gib} GiB", _tps(2 * 8192, tps),
                     kernels=TORCHTITAN, peak_mem_bytes=gib * GIB, gpu_mem_bytes=96e9,
                     card=H100_500W, efficiency=efficiency)


def _titan_cp(cp: int, tps: float, gib: float) -> Reference:
    seq = 32768 * cp
    return Reference(f"torchtitan Llama 3.1 8B, FSDP {8 // cp} x CP {cp}, {seq:,} tokens",
                     f"{TORCHTITAN_H100}, table 2 (with torch.compile and Float8)", "llama3-8b",
                     "h100", 8, dict(dp=8 // cp, cp=cp, zero=3, recompute="full"), 1, 8 // cp, seq,
                     f"{tps:,.0f} tokens/s per GPU, {gib} GiB", _tps(seq / cp, tps),
                     kernels=TORCHTITAN, peak_mem_bytes=gib * GIB, gpu_mem_bytes=96e9, fp8=True,
                     card=H100_500W)


REFERENCES: list[Reference] = [
    Reference("Megatron-LM GPT-3 175B, 1024 A100",
              "Narayanan et al. 2021, \"Efficient Large-Scale Language Model Training on GPU "
              "Clusters Using Megatron-LM\", section 5.1", "gpt3-175b", "a100-80gb", 1024,
              dict(dp=8, tp=8, pp=16, microbatches=192, recompute="full", precision="fp16"),
              1, 1536, 2048, "140 teraFLOP/s per GPU (45% of peak), FLOPs counted with recomputation",
              # their FLOPs per step: 96 B s l h^2 (1 + s/6h + V/16lh)
              96 * 1536 * 2048 * 96 * 12288**2 * (1 + 2048 / (6 * 12288) + 51200 / (16 * 96 * 12288))
              / (1024 * 140e12), kernels=MEGATRON_2021, efficiency=0.5242,
              note="1F1B without interleaving assumed; activation recomputation as the paper runs it"),
    _titan_h100("torchtitan Llama 3.1 8B, FSDP, 8 H100", 8, 5762, 82.4, "1", 0.3855),
    _titan_h100("torchtitan Llama 3.1 8B, FSDP, 128 H100", 128, 5605, 67.0, "3", 0.375),
    _titan_cp(1, 3890, 83.9), _titan_cp(2, 2540, 84.2), _titan_cp(4, 1071, 84.0), _titan_cp(8, 548, 84.5),
    Reference("torchtitan Llama 3 8B, FSDP, 64 A100", TORCHTITAN_A100, "llama3-8b", "a100-80gb", 64,
              dict(dp=64, zero=3, recompute="selective"), 1, 64, 8192,
              "2973 WPS, 58.2% MFU (selective op)", _tps(8192, 2973), kernels=TORCHTITAN,
              efficiency=0.6305),
    Reference("torchtitan Llama 3 70B, FSDP, 64 A100", TORCHTITAN_A100, "llama3-70b", "a100-80gb", 64,
              dict(dp=64, zero=3, recompute="full"), 1, 64, 8192,
              "331 WPS, 51.7% MFU (full AC)", _tps(8192, 331), kernels=TORCHTITAN, efficiency=0.6899),
    Reference("Llama 3 405B, 16384 H100", "Llama Team 2024, \"The Llama 3 Herd of Models\", table 4",
              "llama3-405b", "h100", 16384,
              dict(dp=128, tp=8, pp=16, zero=1, microbatches=16, recompute="full",
                   sequence_parallel=True, schedule="interleaved", virtual_stages=2),
              1, 2048, 8192, "400 TFLOPs/GPU, BF16 MFU 41%",
              2048 * 8192 * (6 * 405.853e9 + 12 * 126 * 16384 * 8192) / (16384 * 400e12),
              kernels=Kernels(attention="flash"), efficiency=0.9533, note=LLAMA_ASSUMED),
    Reference("Llama 3 405B, 8192 H100", "Llama Team 2024, \"The Llama 3 Herd of Models\", table 4",
              "llama3-405b", "h100", 8192,
              dict(dp=64, tp=8, pp=16, zero=1, microbatches=32, recompute="full",
                   sequence_parallel=True, schedule="interleaved", virtual_stages=2),
              1, 2048, 8192, "430 TFLOPs/GPU, BF16 MFU 43%",
              2048 * 8192 * (6 * 405.853e9 + 12 * 126 * 16384 * 8192) / (8192 * 430e12),
              kernels=Kernels(attention="flash"), efficiency=0.8378, note=LLAMA_ASSUMED),
    Reference("DeepSeek-V3, 2048 H800", "DeepSeek-AI 2024, DeepSeek-V3 README (2.664M H800 GPU hours "
              "of pre-training on 14.8T tokens); layout from the technical report, section 3.2 "
              "(not checked here)", "deepseek-v3", "h100", 2048,
              dict(dp=128, pp=16, ep=64, zero=1, microbatches=120, recompute="full"), 1, 15360, 4096,
              "2.664M H800 GPU hours for 14.8T tokens", 15360 * 4096 / (14.8e12 / (2.664e6 * 3600)) / 2048,
              kernels=Kernels(attention="flash"), cluster=dict(intra_node_bw=200e9), fp8=True,
              note="H800: the H100's compute with 400 GB/s NVLink; FP8 matmuls; the report's partial "
                   "recomputation and FP8 activation caching are outside the model: full recompute "
                   "assumed"),
]
"""Every published run the planner is checked against (docs/PLANNER.md)."""
