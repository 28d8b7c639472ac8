"""The ``trainmesh train --strategy ps`` worker: a trainer or a server of the built-in GPT."""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from trainmesh.config.train import TrainConfig
from trainmesh.data.corpus import dp_slice, make_datasets
from trainmesh.models.gpt import GPT
from trainmesh.observe.layout import layout_record
from trainmesh.observe.metrics import MetricsWriter, memory_now, memory_peak
from trainmesh.observe.progress import print_summary, run_header, timed_steps
from trainmesh.parameter_server import PSEngine
from trainmesh.run.optimizers import no_decay, optimizer_factory
from trainmesh.run.schedule_lr import warmup_cosine

log = logging.getLogger("trainmesh")


def train_ps(cfg: TrainConfig, device: torch.device) -> int:
    """Ranks 0..dp-1 train, the rest serve; rank 0 writes the metrics."""
    p = cfg.parallel
    rank = dist.get_rank()
    engine = PSEngine(GPT(cfg.gpt_config(), seed=cfg.seed, device=device), optimizer_factory(cfg, device),
                      lambda m, batch: m(**batch), p, param_groups=no_decay,
                      lr_scheduler=lambda opt: warmup_cosine(opt, warmup_steps=cfg.warmup_steps,
                                                             total_steps=cfg.steps))
    if engine.is_server:
        engine.serve()
        return 0
    setup_mem = memory_now(device)
    gpt = cfg.gpt_config()
    dataset, _ = make_datasets(cfg.data, vocab_size=gpt.vocab_size, seq_len=gpt.seq_len,
                               held_out=False, **cfg.data_options())
    metrics = MetricsWriter(cfg.metrics_out if rank == 0 else None)
    tokens, last = cfg.global_batch * gpt.seq_len, cfg.exit_after or cfg.steps
    log.info(run_header(params=gpt.num_params(), world=p.world_size, layout=layout_record(cfg),
                        steps=last, start=1, device=device.type))
    first_loss = loss = float("nan")
    def batch_of(step: int) -> dict[str, torch.Tensor]:
        batch = dp_slice(dataset.batch(cfg.seed, step, cfg.global_batch), rank, p.dp)
        return {k: v.to(device) for k, v in batch.items()}

    for step, loss, _, dt in timed_steps(engine.train_step, batch_of, start=1, last=last,
                                         tokens=tokens, enabled=rank == 0):
        first_loss = loss if step == 1 else first_loss
        metrics.write({"event": "step", "step": step, "tokens": tokens, "step_time_s": dt,
                       "tokens_per_s": tokens / dt if dt > 0 else 0.0, "mfu": None, **engine.last})
    summary = _summary(cfg, engine, device, setup_mem, loss)
    metrics.write(summary)
    if rank == 0:
        print_summary(summary, first_loss=first_loss)
    engine.close()
    return 0


def _summary(cfg: TrainConfig, engine: PSEngine, device: torch.device, setup_mem: int,
             final_loss: float) -> dict[str, Any]:
    p = cfg.parallel
    axes = ("dp", "tp", "pp", "other", "ps")
    mine = {"rank": engine.rank, "role": "trainer", "coords": {"dp": engine.rank, "pp": 0, "tp": 0},
            "setup_mem_bytes": setup_mem, "peak_mem_bytes": memory_peak(device),
            "model_state_bytes": engine.state_bytes, "comm_buffer_peak_bytes": 0,
            "comm_bytes_per_step": engine.ledger.bytes_per_step(axes), "max_staleness": engine.max_staleness}
    ranks: list[Any] = [None] * p.dp
    dist.all_gather_object(ranks, mine, group=engine.trainers)
    # servers: what they hold; their traffic mirrors the trainers' (each push in, each pull out)
    servers = [{"rank": p.dp + s, "role": "server", "coords": {"dp": "-", "pp": "-", "tp": "-"},
                "model_state_bytes": {k: held[k] for k in ("params", "grads", "optimizer")},
                "peak_mem_bytes": held["peak_mem_bytes"], "comm_bytes_per_step": {"ps": {}}}
               for s, held in enumerate(engine.server_bytes())] if engine.rank == 0 else []
    return {"event": "summary", "world_size": p.world_size, "layout": layout_record(cfg),
            "params": cfg.gpt_config().num_params(), "final_loss": final_loss,
            "steps": engine.step_count, "ranks": ranks + servers,
            "max_staleness": max(r["max_staleness"] for r in ranks)}
