"""One ``trainmesh train`` worker: build the GPT, the engine and the data; loop; report."""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from .data import dp_slice, make_datasets
from .distributed import init_distributed, shutdown
from .engine import Engine
from .evaluation import make_evaluator
from .mesh import ParallelMesh
from .metrics import MetricsWriter, memory_now, memory_peak
from .models.gpt import GPT
from .progress import Progress, print_summary
from .resume import check_resume, run_record, schedule_changed
from .schedule_lr import warmup_cosine
from .tensorboard_log import TensorBoardLog
from .trace import make_tracer
from .train_config import TrainConfig

log = logging.getLogger("trainmesh")


def no_decay(name: str) -> dict[str, float]:
    """Parameter groups: no weight decay on biases, norms and embeddings."""
    skip = name.endswith("bias") or ".ln" in name or "embed." in name
    return {"weight_decay": 0.0 if skip else 0.1}


def optimizer_factory(cfg: TrainConfig):
    lr = cfg.peak_lr
    if cfg.optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr)
    return lambda params: torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95))


def build_engine(cfg: TrainConfig, device: torch.device, mesh: ParallelMesh) -> Engine:
    model = GPT(cfg.gpt_config(), seed=cfg.seed, device=device)
    return Engine(
        model, optimizer_factory(cfg), lambda m, batch: m(**batch), cfg.parallel, mesh=mesh,
        param_groups=no_decay,
        lr_scheduler=lambda opt: warmup_cosine(opt, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps),
        broadcast_init=False)  # the GPT's init is a function of (seed, name): already identical


@record
def worker_main(cfg: TrainConfig) -> int:
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    torch.set_num_threads(threads)
    device = init_distributed(timeout_s=cfg.parallel.timeout_s, device=cfg.device)
    try:
        code = _train(cfg, device)
    except BaseException:
        shutdown(barrier=False)  # peers learn of the failure from the launcher, not a barrier
        raise
    shutdown()
    return code


def _train(cfg: TrainConfig, device: torch.device) -> int:
    p = cfg.parallel
    mesh = ParallelMesh(dp=p.dp, pp=p.pp, tp=p.tp, timeout_s=p.timeout_s)
    rank0 = mesh.rank == 0
    logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING, format="%(message)s",
                        stream=sys.stdout)
    engine = build_engine(cfg, device, mesh)
    gpt = cfg.gpt_config()
    dataset, held_out = make_datasets(cfg.data, vocab_size=gpt.vocab_size, seq_len=gpt.seq_len,
                                      held_out=cfg.eval_every is not None, tokenizer=cfg.tokenizer)
    evaluator = make_evaluator(engine, held_out, cfg)
    start = _resume(cfg, engine) + 1
    setup_mem = memory_now(device)
    metrics = MetricsWriter(cfg.metrics_out if rank0 else None, keep_steps_before=start)
    board = TensorBoardLog(cfg.tensorboard if rank0 else None)
    tokens = cfg.global_batch * gpt.seq_len
    last = cfg.exit_after or cfg.steps
    tracer = make_tracer(engine, cfg, start, last)
    log.info("trainmesh: %s params, world %d %s, %d steps", f"{gpt.num_params():,}", mesh.world_size,
             {k: v for k, v in p.layout().items()}, cfg.steps)
    first_loss = loss = float("nan")
    with Progress(total=last, enabled=rank0, start=start - 1) as bar:
        for step in range(start, last + 1):
            batch = dp_slice(dataset.batch(cfg.seed, step, cfg.global_batch), mesh.index("dp"), p.dp)
            batch = {k: v.to(device) for k, v in batch.items()}
            if tracer is not None:
                tracer.before_step(step)
            t0 = time.perf_counter()
            loss = engine.train_step(batch)
            dt = time.perf_counter() - t0
            if tracer is not None:
                tracer.after_step(step, t0, t0 + dt)
            first_loss = loss if step == 1 else first_loss
            row = {"event": "step", "step": step, "loss": loss, "grad_norm": engine.last["grad_norm"],
                   "lr": engine.last["lr"], "tokens": tokens, "step_time_s": dt,
                   "tokens_per_s": tokens / dt if dt > 0 else 0.0,
                   **{k: v for k, v in engine.last.items() if k not in ("loss", "grad_norm", "lr")}}
            metrics.write(row)
            board.step(row, engine.comm.ledger.steps[-1], memory_now(device))
            bar.update(step, loss=loss, tokens_per_s=row["tokens_per_s"])
            if evaluator is not None and evaluator.due(step):
                record = evaluator.run(step)
                metrics.write(record)
                board.eval(record)
            if cfg.save_dir and ((cfg.save_every and step % cfg.save_every == 0) or step == last):
                engine.save(cfg.save_dir, {"run": run_record(cfg)})
    if tracer is not None:   # collective: every rank's spans, written by rank 0
        tracer.write()
    if cfg.timeline_out:   # collective: every rank's measured actions, drawn by rank 0
        from .pipeline_parallel.timeline import write_timeline
        write_timeline(engine.executor, engine.comm, cfg.timeline_out)
    summary = _summary(cfg, engine, mesh, device, setup_mem, loss)
    metrics.write(summary)
    board.close(summary)
    if rank0:
        print_summary(summary, first_loss=first_loss)
    return 0


def _resume(cfg: TrainConfig, engine: Engine) -> int:
    """The last step already done: from the newest checkpoint when resuming (asked for with
    --resume, or implied by an elastic restart), else 0."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if not cfg.save_dir or not (cfg.resume or restarted):
        return 0
    from .checkpoint import latest
    if latest(cfg.save_dir) is None:
        if cfg.resume and not restarted:
            log.warning("trainmesh: no checkpoint under %s yet; starting from step 1", cfg.save_dir)
        return 0
    notice = check_resume(cfg)  # a checkpoint of another model or optimizer: ConfigError
    changed = schedule_changed(cfg)
    state = engine.load(cfg.save_dir)
    if changed:
        _apply_new_schedule(engine)
    log.info("trainmesh: resumed from step %d of %s", state["step"], cfg.save_dir)
    if notice:
        log.info(notice)
    return int(state["step"])


def _apply_new_schedule(engine: Engine) -> None:
    """After loading: the LR of the next step from this run's schedule, not the checkpoint's."""
    sched = engine.lr_scheduler
    for group, base, factor in zip(engine.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * factor(sched.last_epoch)


def _summary(cfg: TrainConfig, engine: Engine, mesh: ParallelMesh, device: torch.device,
             setup_mem: int, final_loss: float) -> dict[str, Any]:
    mine = {"rank": mesh.rank, "coords": mesh.coords, "setup_mem_bytes": setup_mem,
            "peak_mem_bytes": memory_peak(device), "model_state_bytes": engine.state_bytes,
            "comm_buffer_peak_bytes": engine.grad_sync.comm_buffer_peak_bytes,
            "comm_bytes_per_step": engine.comm.ledger.bytes_per_step()}
    ranks = engine.comm.all_gather_object(mine)
    return {"event": "summary", "world_size": mesh.world_size, "layout": cfg.parallel.layout(),
            "params": cfg.gpt_config().num_params(), "final_loss": final_loss,
            "steps": engine.step_count, "ranks": ranks}
