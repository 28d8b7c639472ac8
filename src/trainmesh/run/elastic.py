"""Elastic resize: the layout a job runs at the world size it has now.

Under torch's elastic agent with a node range (``torchrun --nnodes MIN:MAX``) the agent
restarts every worker when a node is lost or joins; each worker then derives its layout from
``WORLD_SIZE`` with :func:`resize`: tp and pp are kept, dp becomes the largest valid degree that
fits, and the global batch is kept by raising the microbatches (the micro-batch size
``global / (dp x microbatches)`` never changes). The run then resumes from the newest checkpoint,
resharded to the new layout; since the batch of step k depends only on (seed, k) and the global
batch, the loss curve is the uninterrupted one.

``--dp`` is the largest layout (what a full job runs), ``--min-dp`` the smallest dp the job may
shrink to. A dp is valid when it divides ``dp x microbatches`` of the full layout (the same
micro-batch size then gives the same global batch) and, with the interleaved schedule, leaves
a multiple of pp microbatches.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainmesh.config.train import TrainConfig


class ResizeError(RuntimeError):
    """The processes left hold no valid layout: the job ends (exit 1) with this one line."""


@dataclass(frozen=True)
class Layout:
    """What changes with the world size: the dp degree and the microbatches per step."""

    dp: int
    microbatches: int
    world: int
    """Processes this layout uses: dp x cp x pp x tp (at most the world size)."""


def resize(world: int, *, dp: int, pp: int, tp: int, microbatches: int, min_dp: int,
           microbatch_multiple: int = 1, cp: int = 1) -> Layout:
    """The layout ``world`` processes run, from the full layout (``dp``, ``microbatches``).

    The largest dp in ``[min_dp, dp]`` with ``dp x cp x pp x tp <= world`` whose microbatches
    ``dp x microbatches / new dp`` is a whole multiple of ``microbatch_multiple``. Raises
    :class:`ResizeError` saying which axis cannot shrink when there is none.
    """
    per_replica = cp * pp * tp
    sequences = dp * microbatches   # micro-batches of the global batch: kept
    fits = min(dp, world // per_replica)
    for new_dp in range(fits, min_dp - 1, -1):
        if sequences % new_dp == 0 and (sequences // new_dp) % microbatch_multiple == 0:
            return Layout(new_dp, sequences // new_dp, new_dp * per_replica)
    if fits < min_dp:
        raise ResizeError(f"--min-dp: {world} processes left cannot hold pp {pp} x tp {tp} with "
                          f"dp >= --min-dp {min_dp} (needs {min_dp * per_replica})")
    raise ResizeError(f"--min-dp: {world} processes left hold dp {min_dp}..{fits} with pp {pp} x "
                      f"tp {tp}, but none keeps the global batch: dp must divide dp x microbatches "
                      f"= {sequences} of the full layout"
                      + (f" and leave a multiple of pp {pp} microbatches (interleaved)"
                         if microbatch_multiple > 1 else ""))


def fit_world(cfg: TrainConfig, world: int) -> TrainConfig:
    """``cfg`` with the dp and microbatches :func:`resize` picks for ``world`` processes
    (``cfg`` itself when it is not elastic or already fits)."""
    p = cfg.parallel
    if p.min_dp is None:
        return cfg
    layout = resize(world, dp=p.dp, pp=p.pp, tp=p.tp, microbatches=p.microbatches,
                    min_dp=p.min_dp, microbatch_multiple=p.microbatch_multiple, cp=p.cp)
    if (layout.dp, layout.microbatches) == (p.dp, p.microbatches):
        return cfg
    parallel = dataclasses.replace(p, dp=layout.dp, microbatches=layout.microbatches)
    return dataclasses.replace(cfg, parallel=parallel)


def layout_change(saved: dict[str, Any] | None, now: dict[str, Any], *, step: int,
                  world: int) -> dict[str, Any] | None:
    """The metrics record of a resize: the checkpoint's layout ``saved`` against ``now`` (both
    ``ParallelConfig.layout_record()``); None when dp and microbatches are unchanged."""
    if not saved or all(saved.get(k) == now[k] for k in ("dp", "microbatches")):
        return None
    return {"event": "resize", "step": step, "world_size": world,
            "from": {"dp": saved.get("dp"), "microbatches": saved.get("microbatches")},
            "to": {"dp": now["dp"], "microbatches": now["microbatches"]}}


def join(cfg: TrainConfig, *, rank: int, world: int) -> tuple[TrainConfig, bool]:
    """(this worker's config at world size ``world`` (:func:`fit_world`), whether this rank
    takes part): ranks beyond the layout's ``dp x cp x pp x tp`` end at once. The caller joins the
    process group with ``cfg.parallel.world_size`` processes (not the launcher's
    ``WORLD_SIZE``), so it holds exactly the mesh. Raises :class:`ResizeError`."""
    if cfg.parallel.min_dp is None:
        return cfg, True
    cfg = fit_world(cfg, world)
    return cfg, rank < cfg.parallel.world_size


def resize_record(cfg: TrainConfig, *, step: int, world: int) -> dict[str, Any] | None:
    """The ``resize`` metrics record of an elastic worker resuming at ``step``, when the newest
    checkpoint was written under another dp or microbatches; None otherwise."""
    if cfg.parallel.min_dp is None or not cfg.save_dir or step <= 1:
        return None
    from trainmesh.checkpoint.resume import saved_layout
    return layout_change(saved_layout(cfg.save_dir), cfg.parallel.layout_record(), step=step, world=world)
