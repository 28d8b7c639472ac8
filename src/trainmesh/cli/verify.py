"""``trainmesh verify``: a layout against one process on the user's own model and data.

Takes every ``trainmesh train`` flag (the same generated parser) and runs ``--steps`` (default
:data:`STEPS`) of the layout and of one process with the same model, data, seed, global batch,
optimizer, schedule and precision; prints per step the loss and grad-norm differences beside
the bound rounding allows (:mod:`trainmesh.run.verify_bound`). ``--layers N`` with
``--model-dir`` cuts the model to its first N decoder layers (:mod:`trainmesh.models.hf_cut`).
Both configs are built and checked as ``trainmesh train`` checks one, before any worker starts.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from trainmesh.core.errors import ConfigError

STEPS = 5
"""``--steps`` of each run when not given."""
KEPT = ("precision", "reduce_dtype", "grad_clip", "timeout_s")
"""ParallelConfig fields the one-process run keeps: the arithmetic the user chose, not the
layout (every other one is reset to its default: one process, no ZeRO, eager, ...)."""
LAYOUT_ONLY = ("trace_out", "timeline_out", "tensorboard", "max_restarts", "metrics_out")
"""TrainConfig fields of the layout's run only (its outputs and restarts)."""
REFUSED = {
    "save_dir": ("--save-dir", "verify keeps nothing of its two runs; checkpoints come from "
                               "`trainmesh train` (valid: leave it out; --resume-from DIR starts "
                               "both runs from a checkpoint)"),
    "coordinator": ("--coordinator", "verify runs the layout and one process on this machine; "
                                     "a replica across hosts has no one-process twin here "
                                     "(valid: leave it out; --fault-tolerant on one host)"),
}
"""Flags whose meaning verify cannot honour: field -> (flag, why)."""
OTHER_ALGORITHM = {
    ("strategy", "diloco"): ("--strategy", "diloco is another algorithm than one process's (it "
                             "equals it only with one inner step, outer lr 1, no outer momentum "
                             "and SGD: docs/DILOCO.md); valid: mesh or ps"),
    ("ps_mode", "async"): ("--ps-mode", "async applies stale gradients, another algorithm than "
                           "one process's; valid: sync"),
}
"""Flag values that ask for another algorithm than one process runs: verify would only report
that it is; (field, value) -> (flag, why)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    from .train import add_train_flags
    p = sub.add_parser(
        "verify", help="a layout against one process on your model: per step the loss and "
                       "grad-norm differences beside the bound rounding allows",
        usage="trainmesh verify [--config FILE.toml] [FLAG VALUE ...]",
        description="Run --steps (default 5) of the given layout and of one process on the same "
                    "model, data, seed and global batch, and print per step the loss and "
                    "grad-norm differences beside the bound that reduction-order rounding allows "
                    "(docs/VERIFY.md derives it); exit 0 when every step is within it, 1 naming "
                    "the first step and quantity that is not. Takes every `trainmesh train` flag; "
                    "--layers N with --model-dir cuts the model to its first N decoder layers.")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file setting any of these flags "
                   "(keys: the flag names without '--'); flags win")
    add_train_flags(p)
    own = {"--steps": f"optimizer steps of each run (default {STEPS})",
           "--layers": "with --model-dir: cut the model to its first N decoder layers; without: "
                       "the built-in GPT's layer count (default: the model's)"}
    for action in p._actions:
        for flag in set(action.option_strings) & set(own):
            action.help = own[flag]
    p.set_defaults(run=run)


def refuse(values: dict[str, Any]) -> None:
    """ConfigError for a flag verify cannot honour."""
    for name, (flag, why) in REFUSED.items():
        if values.get(name) is not None:
            raise ConfigError(flag, why)
    for (name, value), (flag, why) in OTHER_ALGORITHM.items():
        if values.get(name) == value:
            raise ConfigError(flag, why)


def one_process_values(values: dict[str, Any]) -> dict[str, Any]:
    """The one-process run's flags: ``values`` with the layout reset (the ParallelConfig
    fields but :data:`KEPT`) and the layout's own outputs left out."""
    from trainmesh.config.train import PARALLEL_FIELDS
    return {k: v for k, v in values.items()
            if (k not in PARALLEL_FIELDS or k in KEPT) and k not in LAYOUT_ONLY}


def beside(path: str) -> str:
    """The one-process run's metrics file beside the layout's ``path``: ``run.one-process.jsonl``."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.one-process{p.suffix or '.jsonl'}"))


def terms(cfg: Any) -> int:
    """The longest sum of a step of ``cfg``'s run: its global batch's tokens, or the widest
    dimension of a weight (:class:`~trainmesh.run.verify_bound.Bound`)."""
    if cfg.model_dir is not None:
        from trainmesh.models.hf import build_on_meta
        model = build_on_meta(cfg.model_dir, buffers=False)   # shapes alone: wholly on meta
    else:
        from trainmesh.models.gpt import GPT
        model = GPT(cfg.gpt_config(), device="meta")
    widest = max((max(p.shape) for p in model.parameters() if p.dim()), default=1)
    return max(cfg.global_batch * cfg.gpt_config().seq_len, widest)


def run(args: argparse.Namespace) -> int:
    from trainmesh.config.train import build_train_config
    from trainmesh.observe.layout import layout_text
    from trainmesh.run.verify import Run, say, verify
    from trainmesh.run.verify_bound import Bound

    from .logs import configure_worker_logging
    from .train import collect, launcher_world, preflight
    if launcher_world() is not None:
        raise ConfigError("verify", "starts the layout's processes and one process itself on "
                          "this machine; run it directly, not under torchrun or srun")
    values = collect(args, True)
    values.setdefault("steps", STEPS)
    refuse(values)
    layers = values.pop("layers", None) if values.get("model_dir") is not None else None
    build_train_config(values)   # every flag checked before the model is cut
    with tempfile.TemporaryDirectory(prefix="trainmesh-verify-") as tmp:
        if layers is not None:
            from trainmesh.models.hf_cut import cut_model_dir
            total = cut_model_dir(values["model_dir"], layers, Path(tmp) / "model")
            say(f"{values['model_dir']} cut to its first {layers} of {total} decoder layers")
            values["model_dir"] = str(Path(tmp) / "model")
        out = values.get("metrics_out") or str(Path(tmp) / "layout.jsonl")
        layout = build_train_config({**values, "metrics_out": out})
        one = build_train_config({**one_process_values(values), "metrics_out": beside(out)})
        for cfg in (layout, one):
            preflight(cfg, local_ranks=cfg.parallel.world_size, launching=True)
        what = layout_text(layout.parallel.layout_record())
        bound = Bound(layout.parallel.precision, terms(layout))
        return verify(Run(layout, f"the layout ({what})", Path(tmp) / "layout.log"),
                      Run(one, "one process", Path(tmp) / "one-process.log"), bound,
                      what=what, worker_setup=configure_worker_logging)
