"""Will this run fit this machine? The planner's per-rank prediction against what the machine has.

Checked before any worker starts (``--force`` skips it), from the config alone: nothing is built.

* Host memory: on CPU the local ranks' predicted peaks (:func:`~.predict.predict_run`, process
  RSS) must sum to at most the machine's physical memory (``/proc/meminfo``-equivalent
  ``sysconf``, or the cgroup's ``memory.max`` when lower). Physical memory, not what is free
  now: the answer is the same on every call and in every worker. Each rank's data path adds
  :func:`~trainmesh.data.corpus.resident_bytes` (a few MiB whatever the file's size: files are read
  window by window, and the page cache they warm is not a process's own memory).
* GPU memory: on CUDA each rank's predicted peak must fit its GPU (the smallest local one): what
  the GPU holds, the caching allocator's reserve and the CUDA context included.
* Processes: a local launch may start at most :data:`PROCS_PER_CORE` processes per CPU core
  (gloo workers past that spend their time switching, and collectives time out). On CUDA each
  local rank needs its own GPU; the CLI refuses fewer (the ``--device`` rule, docs/CLI.md).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainmesh.core.errors import ConfigError

from .predict import measured_base_bytes, predict_run
from .units import fmt_bytes

PROCS_PER_CORE = 8
"""Most local worker processes per CPU core a launch may ask for."""
FIT_FLAG = "--dp x --pp x --tp"
MEMORY = "memory"


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def host_memory_bytes() -> int:
    """Physical memory of this machine, or the cgroup limit when it is lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = Path("/sys/fs/cgroup/memory.max")
    try:
        text = limit.read_text().strip()
        if text.isdigit():
            total = min(total, int(text))
    except OSError:
        pass
    return total


def gpu_memory_bytes(count: int) -> int:
    """Memory of the smallest of the first ``count`` CUDA devices."""
    import torch
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(count))


def check_processes(nproc: int) -> None:
    """Refuse a local launch of more processes than the machine's cores can run (ConfigError)."""
    cores = cpu_cores()
    if nproc > PROCS_PER_CORE * cores:
        raise ConfigError(FIT_FLAG, f"asks for {nproc} local processes; this machine has {cores} "
                          f"CPU cores (at most {PROCS_PER_CORE} per core: "
                          f"{PROCS_PER_CORE * cores}); --force to try anyway")


def data_bytes(cfg: Any) -> int:
    """One rank's resident memory for ``cfg.data`` (:func:`trainmesh.data.corpus.resident_bytes`)."""
    from trainmesh.data.corpus import resident_bytes
    gpt = cfg.gpt_config()
    return resident_bytes(cfg.data, vocab_size=gpt.vocab_size, seq_len=gpt.seq_len,
                          global_batch=cfg.global_batch)


def check_memory(cfg: Any, *, local_ranks: int, cuda: bool) -> None:
    """Refuse a run whose predicted memory exceeds what this machine has (ConfigError)."""
    ranks = predict_run(cfg, base_bytes=0 if cuda else measured_base_bytes(), reserved=cuda).ranks
    if cuda:
        need, have = max(r.peak_mem_bytes for r in ranks), gpu_memory_bytes(local_ranks)
        if need > have:
            raise ConfigError(MEMORY, f"the planner predicts {fmt_bytes(need)} per GPU at the "
                              f"peak; a GPU here has {fmt_bytes(have)}; shard more (--zero, --tp, "
                              "--pp), shrink the model or the batch, or --force to try anyway")
        return
    peaks = sorted((r.peak_mem_bytes for r in ranks), reverse=True)
    need = sum(peaks[:local_ranks]) + min(local_ranks, len(ranks)) * data_bytes(cfg)
    have = host_memory_bytes()
    if need > have:
        ranks_here = f"{local_ranks} local rank{'s' if local_ranks > 1 else ''}"
        raise ConfigError(MEMORY, f"the planner predicts {fmt_bytes(need)} at the peak for the "
                          f"{ranks_here}; this machine has "
                          f"{fmt_bytes(have)}; shard more (--zero, --tp, --pp), shrink the model "
                          "or the batch, or --force to try anyway")
