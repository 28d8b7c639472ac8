"""Shared benchmark plumbing: the model, the data, timing and the result table."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from trainmesh.data.corpus import SyntheticCorpus
from trainmesh.models.gpt import GPTConfig

# The benchmarks' common model: a small GPT, 2048 tokens per step.
BENCH_GPT = GPTConfig(vocab_size=1024, seq_len=128, d_model=256, n_layers=4, n_heads=4)
GLOBAL_BATCH = 16


def gpt_round_arguments(ap, *, layers: int, vocab: int, rounds: int) -> None:
    """The GPT shape, global batch and timed-rounds flags the pipeline benchmarks share."""
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--d-model", dest="d_model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=vocab)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    ap.add_argument("--rounds", type=int, default=rounds, help="timed rounds")
    ap.add_argument("--warmup-rounds", dest="warmup_rounds", type=int, default=2)
    ap.add_argument("--json", dest="json_out", help="also write the raw results here")


def batches(steps: int, seed: int = 0):
    data = SyntheticCorpus(BENCH_GPT.vocab_size, BENCH_GPT.seq_len)
    return [data.batch(seed, k, GLOBAL_BATCH) for k in range(steps)]


def timed(fn: Callable[[], float]) -> tuple[float, float]:
    """(seconds, loss) of one call, with a barrier so the slowest rank sets the time."""
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    loss = fn()
    dist.barrier()
    return time.perf_counter() - t0, loss


def interleaved(impls: dict[str, Callable], steps: int, warmup: int, *, rank: int, world: int
                ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(step times after ``warmup``, losses of every step) of each step function, run on this
    rank's DP slice of the same batches, alternating their order each step (no position bias)."""
    from trainmesh.data.corpus import dp_slice
    times: dict[str, list[float]] = {k: [] for k in impls}
    losses: dict[str, list[float]] = {k: [] for k in impls}
    for k, batch in enumerate(batches(steps + warmup)):
        mine = dp_slice(batch, rank, world)
        order = list(impls) if k % 2 == 0 else list(reversed(impls))
        for name in order:
            t, loss = timed(lambda: impls[name](mine))
            if k >= warmup:
                times[name].append(t)
            losses[name].append(loss)
    return times, losses


def report(name_a: str, times_a: list[float], name_b: str, times_b: list[float], tokens: int,
           losses: tuple[list[float], list[float]] | None = None) -> str:
    ma, mb = statistics.median(times_a), statistics.median(times_b)
    lines = [f"| implementation | median step (s) | tokens/s |", "|---|---|---|",
             f"| {name_a} | {ma:.4f} | {tokens / ma:,.0f} |",
             f"| {name_b} | {mb:.4f} | {tokens / mb:,.0f} |",
             "", f"ratio {name_a} / {name_b} tokens/s: **{mb / ma:.3f}x**"]
    if losses:
        diff = max(abs(a - b) for a, b in zip(*losses))
        lines.append(f"max |loss difference| over all steps: {diff:.2e}")
    return "\n".join(lines)


def native_step(module: torch.nn.Module, opt: torch.optim.Optimizer, world: int, *,
                set_to_none: bool = False) -> Callable[[dict], float]:
    """One step of a PyTorch-native baseline: mean loss, backward, clip 1.0, step; the loss
    averaged over ranks (as trainmesh's engine reports it)."""
    import torch.distributed as dist

    def step(batch: dict) -> float:
        loss_sum, count = module(**batch)
        loss = loss_sum / count
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / world
    return step


# ---------------------------------------------------------------- PyTorch's side, measured alike
def _storage(t) -> int:
    """Where ``t``'s storage lives: a functional collective's output and its views alike."""
    return t.untyped_storage().data_ptr()


def _payload(t) -> int:
    return t.numel() * t.element_size() if t is not None else 0


# name -> (op as trainmesh's ledger names it, payload bytes of the call's arguments): the
# nccl-tests convention trainmesh's ledger follows (all_gather counts the gathered output,
# reduce_scatter the unreduced input, the others their tensor).
_DIST_OPS = {
    "all_reduce": ("all_reduce", lambda a, k: _payload(a[0] if a else k.get("tensor"))),
    "broadcast": ("broadcast", lambda a, k: _payload(a[0] if a else k.get("tensor"))),
    "all_gather_single": ("all_gather", lambda a, k: _payload(a[0] if a else k.get("output_tensor"))),
    "all_gather_into_tensor": ("all_gather", lambda a, k: _payload(a[0] if a else k.get("output_tensor"))),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: _payload(a[1] if len(a) > 1 else k["input"])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: _payload(a[1] if len(a) > 1 else k["input"])),
    "all_to_all_single": ("all_to_all", lambda a, k: _payload(a[1] if len(a) > 1 else k.get("input"))),
    "send": ("send", lambda a, k: _payload(a[0])), "recv": ("recv", lambda a, k: _payload(a[0])),
    "batch_isend_irecv": ("batch_p2p", lambda a, k: sum(_payload(op.tensor) for op in a[0])),
    "barrier": ("barrier", lambda a, k: 0),
}
_FUNCOL_OPS = {   # torch.distributed._functional_collectives (DTensor's redistributions)
    "all_reduce": ("all_reduce", lambda a, k: _payload(a[0])),
    "all_gather_single": ("all_gather", None), "all_gather_tensor": ("all_gather", None),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: _payload(a[0])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: _payload(a[0])),
    "all_to_all_single": ("all_to_all", lambda a, k: _payload(a[0])),
}


class TorchCommMeter:
    """Payload bytes and the seconds the calling thread spends blocked in PyTorch's collectives,
    by mesh axis, counted by wrapping ``torch.distributed``'s collectives, the functional
    collectives DTensor uses (``_functional_collectives``; their ``wait_tensor``) and the batches
    of sends and receives of ``torch.distributed.pipelining``: a blocking call counts whole, an
    async one its issue plus its ``wait()``, a functional one its issue plus its ``wait_tensor``. The same two quantities trainmesh's ledger books per op. Calls
    made inside a counted call are not counted again. ``axes`` maps a group's ranks to the axis
    name reported (a group not in it is reported as ``other``). Active only between
    ``start()`` and ``stop()``; the wrappers stay installed until ``uninstall()`` (one meter
    per process at a time)."""

    def __init__(self, axes: dict[frozenset, str]) -> None:
        import threading
        self.axes = axes
        self.active = False
        self.bytes: dict[str, dict[str, int]] = {}
        self.seconds: dict[str, float] = {}
        self._local = threading.local()
        self._installed = False
        self._originals: list[tuple[object, str, object]] = []
        self._pending: dict[int, tuple[str, str]] = {}
        """Storage of a functional collective's output -> its (axis, op), until waited on."""

    def reset(self) -> None:
        self.bytes, self.seconds, self._pending = {}, {}, {}

    def start(self) -> "TorchCommMeter":
        if not self._installed:
            self._install()
        self.active = True
        return self

    def stop(self) -> None:
        self.active = False

    # ------------------------------------------------------------ accounting
    def _axis(self, group) -> str:
        import torch.distributed as dist
        if group is None:
            group = dist.group.WORLD
        if isinstance(group, tuple):                       # (DeviceMesh, dim)
            mesh, dim = group
            group = mesh.get_group(dim)
        if isinstance(group, str):
            from torch.distributed._functional_collectives import _resolve_group_name
            import torch._C._distributed_c10d as c10d
            group = c10d._resolve_process_group(_resolve_group_name(group))
        try:
            ranks = frozenset(dist.get_process_group_ranks(group))
        except Exception:                                   # noqa: BLE001 (unknown kind of group)
            return "other"
        return self.axes.get(ranks, "other")

    def _book(self, axis: str, op: str, nbytes: int, seconds: float) -> None:
        ops = self.bytes.setdefault(axis, {})
        if nbytes:
            ops[op] = ops.get(op, 0) + nbytes
        self.seconds[axis] = self.seconds.get(axis, 0.0) + seconds

    def _counting(self) -> bool:
        return self.active and not getattr(self._local, "inside", False)

    def _wrap(self, fn, op: str, size, group_of):
        meter = self

        def wrapped(*args, **kwargs):
            if not meter._counting():
                return fn(*args, **kwargs)
            meter._local.inside = True
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                meter._local.inside = False
            axis = group_of(args, kwargs)
            nbytes = size(args, kwargs) if size else _payload(out)
            meter._book(axis, op, nbytes, time.perf_counter() - t0)
            if isinstance(out, torch.Tensor):      # a functional collective's: its wait books here
                meter._pending[_storage(getattr(out, "elem", out))] = (axis, op)
            if isinstance(out, list):
                return [meter._timed_work(w, axis, op) for w in out]
            return meter._timed_work(out, axis, op)
        return wrapped

    def _timed_work(self, work, axis: str, op: str):
        import torch.distributed as dist
        if not isinstance(work, dist.Work):
            return work
        meter = self

        class TimedWork(dist.Work):      # still a Work: FSDP2 tests isinstance before waiting
            def wait(self, timeout=None):
                t0 = time.perf_counter()
                ok = work.wait() if timeout is None else work.wait(timeout)
                if meter.active:
                    meter._book(axis, op, 0, time.perf_counter() - t0)
                return ok

            def is_completed(self):
                return work.is_completed()

            def is_success(self):
                return work.is_success()

            def exception(self):
                return work.exception()

            def source_rank(self):
                return work.source_rank()

            def result(self):
                return work.result()

            def get_future(self):
                return work.get_future()
        return TimedWork()

    def uninstall(self) -> None:
        """Put back every function the meter wrapped."""
        self.active = False
        for module, name, original in reversed(self._originals):
            setattr(module, name, original)
        self._originals, self._installed = [], False

    def _replace(self, module, name: str, wrapper) -> None:
        self._originals.append((module, name, getattr(module, name)))
        setattr(module, name, wrapper)

    def _install(self) -> None:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        def dist_group(args, kwargs, name=None):
            if "group" in kwargs:
                return self._axis(kwargs["group"])
            if name == "batch_isend_irecv":
                return self._axis(args[0][0].group) if args[0] else "other"
            positional = {"all_reduce": 2, "broadcast": 2, "all_gather_single": 2,
                          "all_gather_into_tensor": 2, "reduce_scatter_single": 3,
                          "reduce_scatter_tensor": 3, "all_to_all_single": 4, "send": 2,
                          "recv": 2, "barrier": 0}.get(name)
            return self._axis(args[positional] if positional is not None and len(args) > positional else None)

        for name, (op, size) in _DIST_OPS.items():
            if hasattr(dist, name):
                self._replace(dist, name, self._wrap(getattr(dist, name), op, size,
                                                     lambda a, k, n=name: dist_group(a, k, n)))
        group_pos = {"all_reduce": 2, "all_gather_single": 2, "all_gather_tensor": 2,
                     "reduce_scatter_single": 3, "reduce_scatter_tensor": 3, "all_to_all_single": 3}
        for name, (op, size) in _FUNCOL_OPS.items():
            if hasattr(funcol, name):
                pos = group_pos[name]
                self._replace(funcol, name, self._wrap(
                    getattr(funcol, name), op, size,
                    lambda a, k, p=pos: self._axis(k.get("group", a[p] if len(a) > p else None))))
        self._install_pipelining()
        wait = funcol.wait_tensor
        meter = self

        def wait_tensor(tensor):
            if not meter.active or getattr(meter._local, "inside", False):
                return wait(tensor)         # not waiting, or inside a call counted whole
            t0 = time.perf_counter()
            out = wait(tensor)
            axis, op = meter._pending.pop(_storage(tensor), ("other", "wait_tensor"))
            meter._book(axis, op, 0, time.perf_counter() - t0)
            return out
        self._replace(funcol, "wait_tensor", wait_tensor)
        self._installed = True


    def _install_pipelining(self) -> None:
        """``torch.distributed.pipelining`` issues a batch of sends only (or receives only) with
        ``isend``/``irecv`` themselves, not through ``batch_isend_irecv``: its batching helper
        is wrapped (each op booked as send or recv; the batch's issue and each ``wait()``) where
        ``pipelining`` is imported (start the meter after building the schedule)."""
        import sys

        import torch.distributed as dist
        schedules = sys.modules.get("torch.distributed.pipelining.schedules")   # only if in use
        batch = getattr(schedules, "_batch_p2p", None)
        if batch is None:
            return
        meter = self

        def batch_p2p(p2p_ops, desc=None):
            if not meter._counting() or not p2p_ops:
                return batch(p2p_ops, desc)
            meter._local.inside = True
            t0 = time.perf_counter()
            try:
                works = batch(p2p_ops, desc)
            finally:
                meter._local.inside = False
            axis = meter._axis(p2p_ops[0].group)
            for op in p2p_ops:
                meter._book(axis, "send" if op.op is dist.isend else "recv", _payload(op.tensor), 0.0)
            meter._book(axis, "send", 0, time.perf_counter() - t0)
            return [meter._timed_work(w, axis, "p2p") for w in works]
        self._replace(schedules, "_batch_p2p", batch_p2p)


def mesh_axes(mesh, names: dict[str, str] | None = None) -> dict[frozenset, str]:
    """{ranks of each of ``mesh``'s dimension groups: axis name} for :class:`TorchCommMeter`
    (``names`` renames PyTorch's dimension names to trainmesh's), the world as ``world``."""
    import torch.distributed as dist
    out = {frozenset(range(dist.get_world_size())): "world"}
    for dim in mesh.mesh_dim_names:
        group = mesh[dim].get_group() if mesh.ndim > 1 else mesh.get_group()
        out.setdefault(frozenset(dist.get_process_group_ranks(group)), (names or {}).get(dim, dim))
    return out


def local_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (a DTensor counts its local shard)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = getattr(t, "_local_tensor", t)
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def step_alloc_peak(fn: Callable[[], object]) -> int:
    """Peak bytes of one call of ``fn``'s own allocations still live, from the PyTorch
    profiler's CPU memory events (the allocator's records of this thread, in order). Blocks
    allocated before the call and freed in it are not seen (the profiler does not know their
    size), so this is an upper bound of the call's peak above its start."""
    import os

    from torch.profiler import ProfilerActivity, profile
    quiet = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(2)
    os.dup2(quiet, 2)           # the profiler's start/stop lines and its warning on blocks
    try:                        # allocated before it started
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(quiet)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    return peak
