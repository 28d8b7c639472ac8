"""One ``trainmesh train`` worker: build the GPT, the engine and the data; loop; report."""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from trainmesh.checkpoint.async_save import AsyncSaver, SaveRecord
from trainmesh.checkpoint.resume import (
    check_resume,
    elastic_job,
    run_record,
    same_job,
    schedule_changed,
)
from trainmesh.checkpoint.savedir import SaveDirLock, remove_stale_tmp
from trainmesh.config.train import TrainConfig
from trainmesh.core.compat import load_lazy_imports
from trainmesh.core.distributed import init_distributed, shutdown, worker_threads
from trainmesh.core.mesh import ParallelMesh
from trainmesh.core.step import LossFn
from trainmesh.data.corpus import make_datasets
from trainmesh.engine.engine import Engine
from trainmesh.engine.materialize import InitFn, returning_freed_memory
from trainmesh.models.gpt import GPT
from trainmesh.observe.flops import device_peak_tflops, mfu, packed_flops_per_token
from trainmesh.observe.layout import layout_record
from trainmesh.observe.metrics import MetricsWriter, memory_now, memory_peak
from trainmesh.observe.progress import (
    outputs_of,
    print_outputs,
    print_summary,
    run_header,
)
from trainmesh.observe.summary import summary_record
from trainmesh.observe.tensorboard import TensorBoardLog
from trainmesh.run import elastic
from trainmesh.run.evaluation import make_evaluator
from trainmesh.run.optimizers import describe_split, optimizer_factory, param_groups
from trainmesh.run.schedule_lr import warmup_cosine
from trainmesh.run.steps import LocalSteps, Records, StepPolicy, nonfinite_ends_run
from trainmesh.run.trace import make_tracer
from trainmesh.strategies.table import strategy_of

log = logging.getLogger("trainmesh")


class NonFiniteError(RuntimeError):
    """A non-finite loss, gradient norm or model state: the run stops, nothing of it is saved."""


def build_model(cfg: TrainConfig) -> tuple[torch.nn.Module, LossFn, InitFn | None]:
    """(model on the meta device, loss_fn, init_fn): the built-in GPT, or the Hugging Face causal
    LM of --model-dir. Each rank then materialises only what it holds (sharded initialisation),
    from the GPT's seeded init (a function of seed, name and row), the --init-from file or the
    model directory's weights."""
    if cfg.model_dir:
        from trainmesh.engine.pretrained import causal_lm_loss, from_pretrained
        return from_pretrained(cfg.model_dir, plans=cfg.plan_files()), causal_lm_loss, None
    model = GPT(cfg.gpt_config(), seed=cfg.seed, device="meta")
    init_fn = None
    if cfg.init_from:
        from trainmesh.engine.materialize import safetensors_init
        init_fn = safetensors_init(cfg.init_from)
    return model, lambda m, batch: m(**batch), init_fn


def build_engine(cfg: TrainConfig, device: torch.device, mesh: ParallelMesh) -> Engine:
    model, loss_fn, init_fn = build_model(cfg)
    groups = param_groups(cfg, model)
    if cfg.optimizer == "muon" and mesh.rank == 0:
        log.info(describe_split(model, groups))
    return Engine(
        model, optimizer_factory(cfg, device), loss_fn, cfg.parallel, mesh=mesh,
        param_groups=groups,
        lr_scheduler=lambda opt: warmup_cosine(opt, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps),
        init_fn=init_fn, device=device, seed=cfg.seed,
        first_layer_checked=True)   # by the preflight, before any worker started (cli/train.py)


@record
def worker_main(cfg: TrainConfig, *, lock_save_dir: bool = True) -> int:
    """One worker: join the job, train, leave. ``lock_save_dir``: rank 0 takes the --save-dir
    lock itself (torchrun/srun; a local launcher already holds it)."""
    _exit_quietly_on_signals()
    torch.set_num_threads(worker_threads())
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    cfg = _elastic_layout(cfg, rank)
    if cfg is None:
        return 0
    elastic_world = cfg.parallel.world_size if cfg.parallel.min_dp is not None else None
    with SaveDirLock(cfg.save_dir) if lock_save_dir and cfg.save_dir and rank == 0 else nullcontext():
        device = init_distributed(timeout_s=cfg.parallel.timeout_s, device=cfg.device,
                                  world_size=elastic_world)
        try:
            # a strategy whose ranks are not all trainers (the parameter server) runs its own worker
            worker = strategy_of(cfg.parallel).load("worker")
            code = _train(cfg, device) if worker is None else worker(cfg, device, _train)
        except BaseException:
            shutdown(barrier=False)  # peers learn of the failure from the launcher, not a barrier
            raise
        shutdown()
    return code


def _elastic_layout(cfg: TrainConfig, rank: int) -> TrainConfig | None:
    """``cfg`` fitted to this attempt's world size (elastic resize, --min-dp); None for a rank the
    layout leaves out. No layout left: one line naming the reason, exit 1."""
    world = int(os.environ.get("WORLD_SIZE", cfg.parallel.world_size))
    try:
        fitted, takes_part = elastic.join(cfg, rank=rank, world=world)
    except elastic.ResizeError as exc:
        sys.stderr.write(f"trainmesh train: rank {rank}: {exc}\n")
        raise SystemExit(1) from None
    if not takes_part:
        print(f"trainmesh: rank {rank} idle: the layout (dp {fitted.parallel.dp}) uses "
              f"{fitted.parallel.world_size} of {world} processes", flush=True)
        return None
    if (rank == 0 and cfg.parallel.min_dp is not None
          and os.environ.get("TORCHELASTIC_MAX_RESTARTS") == "0"):
        print("trainmesh: note: --min-dp with --max-restarts 0: a lost node ends the job (the agent "
              "may not restart the workers); a returning node is still admitted", flush=True)
    return fitted


def _exit_quietly_on_signals() -> None:
    """SIGINT/SIGTERM (from the launcher, or Ctrl-C on the terminal's process group) end the
    worker at once with 128 + signal, without a traceback per rank."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: os._exit(128 + signum))


PolicyFactory = Callable[[Engine, Any], StepPolicy]
"""(engine, training set) -> the step policy of a fault-tolerant replica."""


def _train(cfg: TrainConfig, device: torch.device, policy_of: PolicyFactory | None = None, *,
           engine: Any = None) -> int:
    """The training loop, the same for every run: ``policy_of`` gives the steps of a
    fault-tolerant replica (:mod:`trainmesh.run.ft_steps`), else every step once; ``engine``:
    one the caller built (a parameter-server trainer's :class:`~trainmesh.parameter_server.
    PSEngine`, which keeps no checkpoint), else the mesh's, built here."""
    p = cfg.parallel
    began = time.perf_counter()
    mesh = p.build_mesh() if engine is None else None
    load_lazy_imports()             # in the base however the worker started
    base_mem = memory_now(device)   # runtime's own footprint (torch, gloo), before the model
    resumes = engine is None
    if engine is None:
        with returning_freed_memory():
            engine = build_engine(cfg, device, mesh)
    rank0, world = engine.rank == 0, engine.world_size
    init_peak = memory_peak(device)   # process start to model built, sharded, optimizer made
    gpt = cfg.gpt_config()
    dataset, held_out = make_datasets(cfg.data, vocab_size=gpt.vocab_size, seq_len=gpt.seq_len,
                                      held_out=cfg.eval_every is not None, **cfg.data_options())
    evaluator = make_evaluator(engine, held_out, cfg)
    tokens = cfg.global_batch * gpt.seq_len
    policy: StepPolicy = (policy_of(engine, dataset) if policy_of is not None else LocalSteps(
        engine, dataset, seed=cfg.seed, global_batch=cfg.global_batch, device=device,
        tokens=tokens, resumes=resumes,
        records=lambda start, board: _open_metrics(cfg, start, world, rank0, board)))
    start = (_resume(cfg, engine, clean=policy_of is None) if policy.resumes() else 0) + 1
    setup_mem = memory_now(device)
    # TensorBoard from the process writing the metrics file (a fault-tolerant run on one host:
    # its launcher, beside the coordinator), each record of it the listener's
    board = TensorBoardLog(cfg.tensorboard if rank0 and policy.summary else None, layout_record(cfg))
    metrics = policy.records(start, board)
    elastic_run = p.min_dp is not None   # the world size can change: recorded per step
    last = cfg.exit_after or cfg.steps
    tracer = make_tracer(engine, cfg, start, last)
    if policy_of is None:   # a fault-tolerant run's launcher prints it
        log.info(run_header(params=cfg.num_params(), world=world,
                            layout=layout_record(cfg), steps=last, start=start,
                            device=device.type))
    peak = device_peak_tflops(device, p.precision, cfg.peak_tflops, cfg.gpu)
    first_loss = loss = eval_loss = float("nan")
    first_step = start
    saver = engine.async_saver() if cfg.async_save else None
    timed: list = [0, 0.0, 0.0]  # tokens, seconds, FLOPs: the run's throughput for the summary
    for done in policy.run(start, last, enabled=rank0 and policy.summary,
                           before_step=tracer.before_step if tracer else None):
        step, report, t0, dt = done.step, done.report, done.t0, done.dt
        loss = report.loss
        if tracer is not None:
            tracer.after_step(step, t0, t0 + dt)
        if timed[1] == 0.0:
            first_loss, first_step = loss, step
        timed[0], timed[1] = timed[0] + tokens, timed[1] + dt
        tps = tokens / dt if dt > 0 else 0.0
        flops = packed_flops_per_token(engine.flops_per_token, n_layers=gpt.n_layers,   # a packed
                                       seq_len=gpt.seq_len, d_model=gpt.d_model,        # step: its
                                       attended=done.row.get("document_len"))           # documents
        timed[2] = None if flops is None or timed[2] is None else timed[2] + tokens * flops
        row = {"event": "step", "step": step, "loss": loss, "grad_norm": report.grad_norm,
               "lr": report.lr, "tokens": tokens, "step_time_s": dt, "tokens_per_s": tps,
               "mfu": mfu(tps, flops, peak, world),
               **{k: v for k, v in report.metrics().items() if k not in ("loss", "grad_norm", "lr")},
               **done.row}
        if elastic_run:
            row.update(world_size=world, dp=p.dp)
        eval_loss = _publish(row, engine, device, metrics, board,
                             evaluator if done.lead else None) or eval_loss
        _check_finite(cfg, engine, step, report.nonfinite)
        if done.lead and cfg.save_dir and ((cfg.save_every and step % cfg.save_every == 0)
                                           or step == last):
            _save(cfg, engine, step, saver, metrics, ft=policy_of is not None)
        if saver is not None:
            _saves_done(cfg, engine, saver, metrics)
    if saver is not None:   # the last write finishes before the run reports
        saver.wait()
        _saves_done(cfg, engine, saver, metrics)
    if policy.led_last:
        _draw(cfg, engine, tracer)
    ranks, fields = engine.summary_ranks({"base_mem_bytes": base_mem, "init_peak_mem_bytes": init_peak,
                                          "setup_mem_bytes": setup_mem,
                                          "peak_mem_bytes": memory_peak(device)})
    tps = timed[0] / timed[1] if timed[1] > 0 else 0.0
    per_token = engine.flops_per_token          # a packed run: the mean of its steps' counts
    if cfg.documents == "packed" and timed[0] and timed[2] is not None:
        per_token = timed[2] / timed[0]
    summary = summary_record(cfg, final_loss=loss, steps=engine.step_count, ranks=ranks,
                             world_size=world, **fields, tokens_per_s=tps,
                             mfu=mfu(tps, per_token, peak, world))
    summary = policy.summarize(summary)
    metrics.write(summary)
    board.close(summary)
    if rank0 and policy.summary:
        print_summary(summary, first_loss=first_loss, first_step=first_step, eval_loss=eval_loss
                      if evaluator is not None else None, wall_s=time.perf_counter() - began)
        print_outputs(outputs_of(cfg))
    return 0


def _open_metrics(cfg: TrainConfig, start: int, world: int, rank0: bool,
                  board: TensorBoardLog) -> MetricsWriter:
    """The metrics file of a run starting at ``start`` (appended to by an elastic job's every
    attempt), with the ``resize`` record when the layout changed since the checkpoint; every
    record also goes to ``board``."""
    p = cfg.parallel
    if rank0 and start > 1 and cfg.metrics_out:
        from trainmesh.checkpoint.resume import drop_partial_line
        notice = drop_partial_line(cfg.metrics_out)
        if notice:
            log.info(notice)
    metrics = MetricsWriter(cfg.metrics_out if rank0 else None, keep_steps_before=start,
                            append=p.min_dp is not None and start > 1, also=board.record)
    resized = elastic.resize_record(cfg, step=start, world=world) if rank0 else None
    if resized is not None:
        metrics.write(resized)
        log.info("trainmesh: resized to world %d: dp %d, microbatches %d (were %s, %s) from step %d",
                 world, p.dp, p.microbatches, resized["from"]["dp"], resized["from"]["microbatches"],
                 start)
    return metrics


def _publish(row: dict[str, Any], engine: Engine, device: torch.device, metrics: Records,
             board: TensorBoardLog, evaluator: Any) -> float | None:
    """A step's record to the metrics file (and by it to TensorBoard), this rank's traffic and
    memory to TensorBoard; the held-out loss when it is due (collective; ``evaluator``: None
    where another replica evaluates the step), returned."""
    metrics.write(row)
    board.traffic(row["step"], engine.last_step_traffic(), memory_now(device))
    if evaluator is not None and evaluator.due(row["step"]):
        scored = evaluator.run(row["step"])
        metrics.write(scored)
        log.info("step %d  eval loss %.4f", row["step"], scored["loss"])
        return float(scored["loss"])
    return None


def _draw(cfg: TrainConfig, engine: Engine, tracer: Any) -> None:
    """The trace and the pipeline timeline (collectives: every rank's spans and actions,
    written by rank 0)."""
    if tracer is not None:
        tracer.write()
    if cfg.timeline_out:
        engine.write_timeline(cfg.timeline_out)


def _check_finite(cfg: TrainConfig, engine: Engine, step: int, what: str | None) -> None:
    """Apply --on-nonfinite to this step (``what``: why it is non-finite; the engine did not
    apply it), counting non-finite steps in a row in the training state. Raises NonFiniteError
    to stop."""
    if what is None:
        engine.nonfinite_run = 0
        return
    engine.nonfinite_run += 1
    ends = nonfinite_ends_run(cfg.on_nonfinite, engine.nonfinite_run)
    if ends is None:
        log.warning("trainmesh: step %d skipped: non-finite %s (--on-nonfinite skip, %d in a row)",
                    step, what, engine.nonfinite_run)
        return
    raise NonFiniteError(f"step {step}: non-finite {what} (--on-nonfinite {ends}); "
                         "the run stops, the newest checkpoint is from before it")


def _save(cfg: TrainConfig, engine: Engine, step: int, saver: AsyncSaver | None,
          metrics: Records, *, ft: bool = False) -> None:
    """Checkpoint, unless some rank's weights or optimizer states are not all finite: at once,
    or (--async-save) a snapshot written in the background (its record comes when written).
    ``ft``: a fault-tolerant replica's (no elastic job to continue)."""
    if not engine.state_is_finite():
        raise NonFiniteError(f"step {step}: non-finite weights or optimizer states; not saved, "
                             "the newest checkpoint is from before it")
    state = {"run": run_record(cfg), "job": None if ft else elastic_job()}
    if saver is not None:
        engine.save(cfg.save_dir, state, saver=saver)
        return
    started, memory = time.perf_counter(), {}
    path = engine.save(cfg.save_dir, state, measure=memory)
    took = time.perf_counter() - started
    metrics.write(SaveRecord(step, took, took, str(path), memory).event())
    _prune(cfg, engine, path)


def _saves_done(cfg: TrainConfig, engine: Engine, saver: AsyncSaver, metrics: Records) -> None:
    """The records of the background saves that completed (rank 0's are the published ones)."""
    for done in saver.finished():
        metrics.write(done.event())
        _prune(cfg, engine, Path(done.path))


def _prune(cfg: TrainConfig, engine: Engine, written: Path) -> None:
    """--keep-last: rank 0 removes the oldest checkpoints once ``written`` is in place."""
    if cfg.keep_last and engine.mesh.rank == 0:
        from trainmesh.checkpoint.sharded import prune
        prune(cfg.save_dir, cfg.keep_last, protect=written)


def _resume(cfg: TrainConfig, engine: Engine, *, clean: bool = True) -> int:
    """The last step already done: from the newest checkpoint when resuming (asked for with
    --resume, or implied by an elastic restart: a failed worker, or a node lost or joining,
    restarts every worker of the job), else 0. ``clean``: remove what interrupted saves left
    (not a fault-tolerant replica: a peer may be writing; its launcher cleans on one host)."""
    restarted = (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
                 or bool(cfg.save_dir and same_job(cfg.save_dir)))   # a node lost or joined
    if cfg.save_dir and engine.mesh.rank == 0 and clean:   # this run holds the --save-dir lock
        for path in remove_stale_tmp(Path(cfg.save_dir)):
            log.info("trainmesh: removed %s, left by an interrupted save", path)
    if cfg.resume_from and not restarted:
        return _start_from(cfg, engine)
    if not cfg.save_dir or not (cfg.resume or restarted):
        return 0
    from trainmesh.checkpoint.sharded import latest
    if latest(cfg.save_dir) is None and not any(Path(cfg.save_dir).glob("step-*")):
        if cfg.resume and not restarted:
            log.warning("trainmesh: no checkpoint under %s yet; starting from step 1", cfg.save_dir)
        return 0
    notice = check_resume(cfg)  # a checkpoint of another model or optimizer: ConfigError
    changed = schedule_changed(cfg)
    state = engine.load(cfg.save_dir)
    if changed:   # the next step's LR from this run's schedule, not the checkpoint's
        engine.state.apply_lr_schedule()
    log.info("trainmesh: resumed from step %d of %s", state["step"], cfg.save_dir)
    if notice:
        log.info(notice)
    return int(state["step"])


def _start_from(cfg: TrainConfig, engine: Engine) -> int:
    """--resume-from: the checkpoint's weights and optimizer states, this run's own trainer
    state (step 1, its LR schedule, a fresh loss scale). Returns 0 (no step done)."""
    fresh = engine.state.state_dict()
    engine.load(cfg.resume_from)
    engine.state.load_state_dict(fresh)
    log.info("trainmesh: starting from the weights and optimizer states of %s", cfg.resume_from)
    return 0
