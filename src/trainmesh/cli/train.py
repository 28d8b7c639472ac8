"""``trainmesh train``: validate, then launch local workers (or be one worker under torchrun).

The flags are generated from the config dataclasses (:data:`trainmesh.config.train.FLAGS`);
:func:`add_train_flags` gives ``plan`` the same ones. Validation of values happens once, in the
dataclasses; :func:`preflight` adds what depends on this machine (devices, files, memory, the
checkpoint to resume), before any worker starts.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from trainmesh.core.errors import ConfigError

DEMO = {"dp": 2}  # a bare `trainmesh train` run locally: the 2-process demo layout
LAYOUT_RULE = ("A bare `trainmesh train` runs the demo: dp 2 on 2 local processes. With any flag, "
               "layout flags left unset are 1 locally; under torchrun or srun they are derived from "
               "the world size (dp = world size / (pp x tp)).")


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_train_flags(parser: argparse.ArgumentParser, keep: Any = None,
                    titles: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``trainmesh train`` flags (those in ``keep`` when given) in their ``--help`` groups,
    each defaulting to None so that "given" is visible; returns the groups."""
    from .flags import add_flags
    return add_flags(parser, keep=keep, titles=titles)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from . import add_version
    p = sub.add_parser("train", help="train a model under a parallel layout",
                       usage="trainmesh train [--config FILE.toml] [FLAG VALUE ...]",
                       description="Train the built-in GPT (or a Hugging Face model, --model-dir) "
                                   "under a dp x cp x pp x tp layout. " + LAYOUT_RULE)
    p.add_argument("--config", metavar="FILE.toml", help="TOML file setting any of these flags "
                   "(keys: the flag names without '--'); flags win")
    add_version(p)
    p.add_argument("--verbose", action="store_true", help="under torchrun or srun: a failing rank "
                   "prints its traceback too, not only its one line (also TRAINMESH_DEBUG=1)")
    add_train_flags(p)
    p.set_defaults(run=run)


def given_flags(args: argparse.Namespace) -> dict[str, Any]:
    """{field: value} of the train flags given on the command line."""
    from trainmesh.config.train import FLAGS
    return {f.field: getattr(args, _dest(flag)) for flag, f in FLAGS.items()
            if getattr(args, _dest(flag), None) is not None}


def collect(args: argparse.Namespace, argv_given: bool, *, world: int | None = None) -> dict[str, Any]:
    """TOML values, overridden by the flags given; under torchrun/srun (``world``: its world
    size) the unset layout flags derived from it; else the bare demo's layout when nothing is
    given."""
    from trainmesh.config.train import read_toml
    values: dict[str, Any] = read_toml(args.config) if getattr(args, "config", None) else {}
    values.update(given_flags(args))
    if world is not None:
        return derive_layout(values, world)
    if not argv_given:
        values.update(DEMO)
    return values


def launcher_world() -> int | None:
    """The world size when this process is a worker of torchrun or srun, else None."""
    from trainmesh.core.distributed import launcher_job
    job = launcher_job()
    return None if job is None else job.world


def derive_layout(values: dict[str, Any], world: int) -> dict[str, Any]:
    """``values`` with the layout flags left unset derived from the launcher's ``world`` size
    (cp, pp and tp 1, dp = world / (cp x pp x tp), minus the servers under --strategy ps); a layout
    that cannot fill it raises ConfigError naming the flags and the size. An elastic job
    (--min-dp) may run below --dp: its own rules apply (:mod:`trainmesh.run.elastic`)."""
    out = dict(values)
    pp, tp, cp = out.get("pp", 1), out.get("tp", 1), out.get("cp", 1)
    servers = out.get("ps_servers", 1) if out.get("strategy") == "ps" else 0
    per_replica = cp * pp * tp
    if not isinstance(per_replica, int) or per_replica < 1 or not isinstance(servers, int):
        return out                       # a bad value: the config's own check names it
    trainers = world - servers
    elastic = out.get("min_dp") is not None
    if "dp" not in out:
        if elastic and (trainers < per_replica or trainers % per_replica):
            return out                   # the elastic rules say which axis cannot shrink
        if trainers < per_replica or trainers % per_replica:
            raise ConfigError("--pp" if pp > 1 else "--tp" if tp > 1 else "--cp",
                              f"cp {cp} x pp {pp} x tp {tp} = {per_replica} does not divide the "
                              f"{trainers} processes of this job (world size {world}"
                              f"{f' less {servers} servers' if servers else ''}); "
                              "give --cp, --pp and --tp whose product divides it")
        out["dp"] = trainers // per_replica
    elif not elastic and isinstance(out["dp"], int) \
            and out["dp"] * per_replica + servers != world:
        need = out["dp"] * per_replica + servers
        raise ConfigError("--dp", f"{out['dp']} x --cp {cp} x --pp {pp} x --tp {tp}"
                          f"{f' + {servers} servers' if servers else ''} = {need} processes, but "
                          f"this torchrun/srun job has world size {world}; leave --dp unset to derive it "
                          f"({world} / (cp x pp x tp)) or start {need} processes")
    return out


def warn_warmup(cfg) -> None:
    """One line when the warm-up is as long as the run (the learning rate never peaks)."""
    import sys
    if cfg.warmup_steps >= cfg.steps:
        sys.stderr.write(f"trainmesh train: warning: --warmup-steps {cfg.warmup_steps} >= --steps "
                         f"{cfg.steps}: the whole run is warm-up and the learning rate never "
                         f"reaches {cfg.peak_lr:g} (lower --warmup-steps)\n")


def preflight(cfg, *, local_ranks: int, launching: bool) -> None:
    """Refuse, before any worker starts, what this machine or build cannot run.

    ``local_ranks``: worker processes on this machine; ``launching``: this process starts them
    (a local launch) rather than being one of them.
    """
    from ..planner.fit import check_memory, check_processes
    from .paths import check_output_dir, check_output_file
    p = cfg.parallel
    import torch

    from trainmesh.core.distributed import choose_device, visible_gpus
    from trainmesh.engine.precision import Precision
    device, _ = choose_device(cfg.device, local_ranks=local_ranks, gpus=visible_gpus())
    Precision(p, torch.device(device))
    if p.compile:
        from trainmesh.engine.compile import check_compile
        check_compile(device, p.compile_backend)
    if launching and not cfg.force:
        check_processes(local_ranks)
    if not cfg.force:
        check_memory(cfg, local_ranks=local_ranks, cuda=device == "cuda")
    if cfg.tensorboard is not None:
        from trainmesh.observe.tensorboard import require_tensorboard
        require_tensorboard()
    for flag, path in (("--save-dir", cfg.save_dir), ("--offload-dir", p.offload_dir),
                       ("--tensorboard", cfg.tensorboard)):
        if path is not None:
            check_output_dir(flag, path)
    if p.offload == "nvme":
        _check_nvme_space(cfg, local_ranks)
    outputs = [(flag, path) for flag, path in (("--metrics-out", cfg.metrics_out),
                                                ("--timeline-out", cfg.timeline_out),
                                                ("--trace-out", cfg.trace_out)) if path is not None]
    for flag, path in outputs:
        check_output_file(flag, path)
    if cfg.resume:
        from trainmesh.checkpoint.resume import check_intact, check_resume
        check_intact(cfg.save_dir, verify=launching)   # checksums once, by the launcher
        check_resume(cfg)  # errors only; the worker that resumes prints the notice
    hub = None
    if cfg.model_dir:   # transformers present, every parameter in model.safetensors
        from trainmesh.engine.pretrained import check_model_dir
        from trainmesh.models.hf import build_on_meta
        hub = build_on_meta(cfg.model_dir, plans=cfg.plan_files())   # once: this check, --resume-from
        check_model_dir(cfg.model_dir, hub, layout=cfg.parallel, seq_len=cfg.gpt_config().seq_len)
    if cfg.resume_from:   # the model this run builds (on meta), shape by shape
        from trainmesh.checkpoint.resume import check_resume_from

        from ..models.gpt import GPT
        check_resume_from(cfg.resume_from, hub if hub is not None else GPT(cfg.gpt_config(), device="meta"))
    if cfg.init_from:   # every parameter of the GPT in the file, with its shape
        from trainmesh.engine.materialize import check_safetensors

        from ..models.gpt import GPT
        check_safetensors(cfg.init_from, GPT(cfg.gpt_config(), device="meta"))
    if cfg.data != "synthetic":
        from trainmesh.data.corpus import make_datasets
        from trainmesh.data.prepare import quiet
        from trainmesh.observe.progress import preparing
        gpt = cfg.gpt_config()
        # tokenising a large text takes a while before any step: the launcher (or rank 0 of a
        # torchrun/srun job, whose ranks all prepare the same cache) says what and how far
        shown = launching or int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0
        make_datasets(cfg.data, vocab_size=gpt.vocab_size, seq_len=gpt.seq_len,
                      held_out=cfg.eval_every is not None, progress=preparing if shown else quiet,
                      **cfg.data_options())
    for flag, path in outputs:   # every check passed: the files' directories, as the flags ask
        try:                         # (so no rank's writer meets a missing one at the end)
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(flag, f"cannot create the directory of {path!r}: "
                              f"{exc.strerror or exc}") from None


def _check_nvme_space(cfg, local_ranks: int) -> None:
    """Room under --offload-dir for what this machine's ranks write: the optimizer bytes per
    parameter (the planner's table: masters and states) times their share of the parameters."""
    from ..data_parallel.nvme import check_space
    from ..planner.memory import bytes_per_param
    p = cfg.parallel
    per_param = bytes_per_param(p.precision, cfg.optimizer)[2]
    share = min(1.0, local_ranks / p.layout.world)
    check_space(p.offload_dir, int(per_param * cfg.num_params() * share))


def run(args: argparse.Namespace) -> int:
    from trainmesh.config.train import build_train_config
    given = bool(given_flags(args)) or args.config is not None
    world = launcher_world()
    cfg = build_train_config(collect(args, given, world=world))
    if world is not None:
        from trainmesh.core.axes import Facts
        from trainmesh.strategies import table
        table.check_facts(cfg.parallel, Facts(launcher="torchrun"))   # a strategy's own launcher
        from trainmesh.core.distributed import launcher_job, local_world_size
        preflight(cfg, local_ranks=local_world_size(), launching=False)
        if launcher_job().rank == 0:
            warn_warmup(cfg)
        if "TORCHELASTIC_RUN_ID" in os.environ:   # under torchrun: die with its agent
            from trainmesh.run.worker import die_with_parent
            die_with_parent(os.getppid())
        from trainmesh.run.worker import run_as_worker

        from .logs import configure_worker_logging
        configure_worker_logging()
        return run_as_worker(cfg, verbose=args.verbose)
    here = cfg.parallel.replica_ranks if cfg.coordinator is not None else cfg.parallel.world_size
    preflight(cfg, local_ranks=here, launching=True)   # across hosts: one replica's ranks here
    warn_warmup(cfg)
    from trainmesh.run import launch
    from trainmesh.strategies import strategy_of

    from .logs import configure_worker_logging
    # the launcher the run's strategy declares (none: the plain one), looked up as the run starts
    launcher = strategy_of(cfg.parallel).load("launcher") or launch.launch_local
    return launcher(cfg, max_restarts=cfg.restart_limit, worker_setup=configure_worker_logging)
