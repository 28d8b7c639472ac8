"""``trainmesh train``: validate, then launch local workers (or be one worker under torchrun)."""
from __future__ import annotations

import argparse
import os
from typing import Any

from ..errors import ConfigError

DEMO = {"dp": 2}  # a bare `trainmesh train`: the 2-process demo layout

# flag -> (type, help); every flag defaults to None so that "given" is visible
FLAGS: dict[str, tuple[Any, str]] = {
    "--dp": (int, "data-parallel degree"),
    "--pp": (int, "pipeline-parallel degree"),
    "--tp": (int, "tensor-parallel degree"),
    "--zero": (int, "ZeRO stage: 0 (DDP), 1, 2, 3"),
    "--microbatches": (int, "gradient accumulation (pp=1) or pipeline microbatches"),
    "--global-batch": (int, "sequences per optimizer step over all DP ranks"),
    "--schedule": (str, "pipeline schedule: naive, gpipe, 1f1b, interleaved"),
    "--virtual-stages": (int, "model chunks per pipeline rank (interleaved)"),
    "--precision": (str, "fp32, bf16 or fp16"),
    "--reduce-dtype": (str, "fp32 or the compute dtype"),
    "--recompute": (str, "none, full or selective"),
    "--recompute-segment": (int, "with full: recompute K layers from every K-th layer's input"),
    "--offload": (str, "none, cpu or nvme"),
    "--offload-dir": (str, "directory for nvme offload"),
    "--bucket-mb": (float, "gradient bucket size in MiB"),
    "--model": (str, "preset: tiny, small"),
    "--layers": (int, "override the preset's layer count"),
    "--d-model": (int, "override the preset's hidden size"),
    "--heads": (int, "override the preset's attention heads"),
    "--seq-len": (int, "override the preset's sequence length"),
    "--vocab-size": (int, "override the preset's vocabulary size"),
    "--data": (str, "'synthetic', or a text file / token file (.npy, .bin)"),
    "--optimizer": (str, "adamw or sgd"),
    "--lr": (float, "peak learning rate"),
    "--warmup-steps": (int, "linear warm-up steps before cosine decay"),
    "--grad-clip": (float, "global gradient-norm clip (0 = off)"),
    "--steps": (int, "total optimizer steps"),
    "--seed": (int, "seed of weights and data"),
    "--metrics-out": (str, "JSON-lines metrics file"),
    "--save-dir": (str, "checkpoint directory"),
    "--save-every": (int, "save every N steps"),
    "--exit-after": (int, "stop cleanly after this step (planned preemption)"),
    "--max-restarts": (int, "restarts of failed workers (local runs)"),
    "--timeline-out": (str, "SVG/PNG of the measured per-rank timeline (pipeline runs)"),
    "--device": (str, "auto, cpu or cuda"),
    "--timeout": (float, "collective timeout in seconds"),
    "--on-nonfinite": (str, "stop (exit 1) or skip (bounded) on a non-finite loss or gradient norm"),
}
BOOL_FLAGS = {"--sequence-parallel": "Megatron sequence parallelism inside TP groups",
              "--resume": "continue from the newest checkpoint in --save-dir"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model under a parallel layout",
                       description="Train the built-in GPT under a dp x pp x tp layout.")
    p.add_argument("--config", help="TOML file setting any of these flags (flags win)")
    for flag, (typ, text) in FLAGS.items():
        p.add_argument(flag, type=typ, default=None, help=text)
    for flag, text in BOOL_FLAGS.items():
        p.add_argument(flag, action="store_const", const=True, default=None, help=text)
    p.set_defaults(run=run)


def collect(args: argparse.Namespace, argv_given: bool) -> dict[str, Any]:
    """TOML values, overridden by the flags given; the bare demo's layout when nothing is."""
    from ..train_config import read_toml
    values: dict[str, Any] = read_toml(args.config) if args.config else {}
    for flag in [*FLAGS, *BOOL_FLAGS]:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            values[flag[2:].replace("-", "_")] = value
    if "timeout" in values:
        values["timeout_s"] = values.pop("timeout")
    if not argv_given:
        values.update(DEMO)
    return values


def preflight(cfg) -> None:
    """Refuse, before any worker starts, what this build cannot run."""
    from ..data import make_dataset
    from ..data_parallel import SUPPORTED_ZERO
    p = cfg.parallel
    if p.offload != "none":
        raise ConfigError("offload", f"{p.offload} is planned but not yet supported; valid now: none")
    if p.zero not in SUPPORTED_ZERO:
        raise ConfigError("zero", f"stage {p.zero} is not yet supported; valid now: "
                          f"{', '.join(map(str, SUPPORTED_ZERO))}")
    for axis, module in (("tp", "tensor_parallel"), ("pp", "pipeline_parallel.runtime")):
        if getattr(p, axis) > 1 and not _has_module(module):
            raise ConfigError(axis, "values > 1 are not yet supported in this build; valid now: 1")
    if p.recompute != "none" and not _has_module("recompute"):
        raise ConfigError("recompute", "not yet supported in this build; valid now: none")
    import torch

    from ..precision import Precision
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda was asked for but no CUDA device is available; valid: auto, cpu")
    Precision(p, torch.device("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu"))
    if cfg.save_dir or cfg.resume:
        if not _has_module("checkpoint"):
            raise ConfigError("save-dir" if cfg.save_dir else "resume",
                              "checkpointing is not yet supported in this build")
    if cfg.resume and not cfg.save_dir:
        raise ConfigError("resume", "needs --save-dir")
    if cfg.timeline_out and p.pp == 1:
        raise ConfigError("timeline-out", "draws pipeline runs; needs --pp > 1")
    if cfg.timeline_out and not cfg.timeline_out.endswith((".svg", ".png")):
        raise ConfigError("timeline-out", f"must end in .svg or .png; got {cfg.timeline_out!r}")
    gpt = cfg.gpt_config()
    make_dataset(cfg.data, vocab_size=gpt.vocab_size, seq_len=gpt.seq_len)


def _has_module(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(f"trainmesh.{name}") is not None


def run(args: argparse.Namespace) -> int:
    from ..train_config import build_train_config
    given = any(getattr(args, f[2:].replace("-", "_")) is not None for f in [*FLAGS, *BOOL_FLAGS]) \
        or args.config is not None
    cfg = build_train_config(collect(args, given))
    preflight(cfg)
    if "RANK" in os.environ or ("SLURM_PROCID" in os.environ and "MASTER_ADDR" in os.environ):
        from ..trainer import worker_main
        return worker_main(cfg)
    from ..launch import launch_local
    return launch_local(cfg, nproc=cfg.parallel.world_size, max_restarts=cfg.max_restarts)
