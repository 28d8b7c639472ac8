"""ZeRO-3 under a pipeline: when gradients are reduced and parameters gathered (ZeRO-1/2's
pipeline mode is their readiness and bucket rounds, :mod:`.zero`).

A pipeline rank runs its stage's ``m`` backward passes interleaved with forwards (any schedule,
split backwards included: a ``W`` action is where the weight gradients appear). The runtime says
once per step how many passes go through every parameter (``expect_backwards(m)``).

ZeRO-3 (:class:`PipelineZero3`): the units are the pipeline layers this rank holds (each called
on its own by the runtime). ``reshard="step"`` gathers each unit at its first forward of the
step and keeps it for every microbatch, freeing it after its ``m``-th backward: one all-gather
per unit per step (dp.all_gather 4Ψ), the whole stage's parameters resident during the step.
``reshard="microbatch"`` frees a unit after every forward and re-gathers it for every backward
(dp.all_gather 2m·4Ψ), so about one unit is resident. Either way each unit's gradients are
reduce-scattered after each of its backwards (dp.reduce_scatter m·4Ψ). A unit whose backward
is split keeps its parameters from ``I`` until its ``W`` (some weight gradients need them).

Under a split backward (``split_backward``: zero-bubble schedules) a unit's reduction round is a
``W`` action: the runtime walks the graph at ``W`` (:meth:`PipelineZero3.pass_unreached`), so
what sits the microbatch out passes there, with that microbatch's gradients, never at an ``I``
in between; and the units of every ZeRO-3 strategy of the rank (the dense and the experts')
go out in one fixed order (:class:`WOrder`), so a unit this rank's tokens did not reach,
complete as the ``W`` begins, goes out where a peer's, complete only when its gradients are
in, does, among the other groups' reductions too (docs/ZERO.md).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from trainmesh.core.compat import in_backward
from trainmesh.core.errors import ConfigError
from trainmesh.core.step import tensors_in

from ..comm import Comm
from .base import SyncOptions
from .buckets import Bucketer
from .zero3 import Zero3, _State, _Unit

RESHARD = ("step", "microbatch")


class WOrder:
    """Under a split backward: the one order in which the rank's ZeRO-3 strategies (one per
    kind of parameter, joined in the kinds' order) reduce their units in a ``W``: last layer
    first (as ``W`` produces the gradients), a layer's experts before its dense part (the
    experts come last in a layer); a complete unit goes out once every unit before it has.
    Every rank of a group runs the same ``W`` actions, and a ``W`` completes every unit, so
    each rank issues the same reductions in the same order, whatever group each is over."""

    def __init__(self) -> None:
        self.parts: list[PipelineZero3] = []
        self._order: list[tuple[PipelineZero3, _Unit]] | None = None
        self._ready: set[tuple[int, int]] = set()
        self._next = 0

    def join(self, sync: "PipelineZero3") -> None:
        sync.w_order = self
        self.parts.append(sync)
        self._order = None

    def reset(self) -> None:
        """A step begins: nothing complete, nothing gone out."""
        self._ready, self._next = set(), 0

    def complete(self, sync: "PipelineZero3", unit: _Unit) -> None:
        """``unit`` of ``sync`` is complete: launch it and whatever follows it that is."""
        if self._order is None:
            keyed = [((-part.layers.index(u.name), -k), part, u)
                     for k, part in enumerate(self.parts) for u in part.units]
            self._order = [(part, u) for _, part, u in sorted(keyed, key=lambda e: e[0])]
        self._ready.add((id(sync), id(unit)))
        while self._order:
            part, u = self._order[self._next]
            if (id(part), id(u)) not in self._ready:
                return
            self._ready.discard((id(part), id(u)))
            part._post_backward(u)
            self._next = (self._next + 1) % len(self._order)
            if self._next == 0:
                return                              # a whole W's round went out


class PipelineZero3(Zero3):
    """ZeRO-3 under a pipeline, units = the rank's pipeline layers (module docstring)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], comm: Comm, *,
                 module: nn.Module, layers: list[str], reshard: str = "step",
                 param_dtype: torch.dtype | None = None, options: SyncOptions | None = None,
                 materialize: Any = None, split_backward: bool = False) -> None:
        if reshard not in RESHARD:
            raise ConfigError("zero3-reshard", f"must be one of {', '.join(RESHARD)}; got {reshard!r}")
        self.layers, self.reshard = list(layers), reshard
        self.split_backward = split_backward
        """The schedule splits backwards into ``I`` and ``W`` (one chunk per rank): each ``W`` is
        a round of every unit, launched in :attr:`w_order`'s order (module docstring)."""
        self.w_order: WOrder | None = None
        """Shared by the rank's ZeRO-3 strategies (``make_grad_sync``); its own by default."""
        if split_backward:
            WOrder().join(self)
        super().__init__(named_params, comm, module=module, param_dtype=param_dtype,
                         options=options, materialize=materialize)
        self._left: dict[int, int] = {}     # id(unit) -> backwards still to come this step
        self._open: dict[int, int] = {}     # id(unit) -> backwards begun whose gradients are not all in
        self.gathered_peak_bytes = 0
        """Most bytes of gathered unit parameters resident at once (measured from the buffers)."""

    def _unit_names(self) -> list[str]:
        return ["", *self.layers]

    def _setup(self, groups: Any) -> None:
        super()._setup(groups)
        stray = [u for u in self.units if u.name == ""]
        if stray:
            names = [s.name for pc in stray[0].pieces for s in pc.layout.slots]
            raise ConfigError("zero", f"--zero 3 with --pp > 1 gathers one pipeline layer at a "
                              f"time; parameters shared by several layers of a stage are not "
                              f"supported: {', '.join(names[:4])} (use --zero 0, 1 or 2)")
        self._left = {id(u): 0 for u in self.units}
        self._open = {id(u): 0 for u in self.units}
        if self.w_order is not None:     # one order on every rank, whatever completes first
            self.bucketer = Bucketer(self.units, lambda unit: self.w_order.complete(self, unit),
                                     ordered=False)

    # ---------------------------------------------------------------- the seam
    def expect_backwards(self, n: int, held: Sequence[nn.Parameter] = ()) -> None:
        self.readiness.start()
        self.bucketer.arm()
        if self.w_order is not None:
            self.w_order.reset()
        for unit in self.units:
            unit.done = False
            self._left[id(unit)], self._open[id(unit)] = n, 0

    def before_backward(self, *, is_last: bool) -> None:
        raise RuntimeError("PipelineZero3 runs under a pipeline: expect_backwards(m) instead")

    def finish(self, scale: float) -> None:
        self._backward_done()
        self._check_unused()
        for unit in self.units:                 # unused parameters (find_unused_parameters)
            if self._left[id(unit)] > 0:
                self._reduce_unit(unit, final=True)
                self._left[id(unit)] = 0
            self._free(unit)
        self.reductions.drain()
        self._grads_in()
        self._scale(scale)

    # ---------------------------------------------------------------- hooks
    def _gathered(self, unit: _Unit) -> None:
        self._gather(unit, wait=True)
        held = sum(u.nbytes for u in self.units if u.state is not _State.FREE)
        self.gathered_peak_bytes = max(self.gathered_peak_bytes, held)

    def _pre_forward(self, unit: _Unit, module: nn.Module, args: Any) -> None:
        if not in_backward():
            self.reductions.drain()   # a backward's last reduction lands before a forward grows
        self._gathered(unit)

    def _post_forward(self, unit: _Unit, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward():           # recomputation inside backward: kept for its backward
            return
        outs = [t for t in tensors_in(output) if t.requires_grad]
        training = bool(outs) and torch.is_grad_enabled()
        if training:
            register_multi_grad_hook(outs, self._backward_starts(unit), mode="any")
        if not training or (self.reshard == "microbatch" and self._open[id(unit)] == 0):
            self._free(unit)

    def _backward_starts(self, unit: _Unit) -> Callable[[Any], None]:
        """The hook on one forward's outputs: the first gradient through them opens that
        microbatch's backward of ``unit``. (A split backward's ``W`` may run the output's node
        again: that call only makes sure the unit is gathered.)"""
        opened = False

        def hook(_: Any) -> None:
            nonlocal opened
            if opened and self._open[id(unit)] == 0:
                return      # W again after the unit passed (no parameter of it reached): not needed
            self._gathered(unit)
            if not opened:
                opened = True
                self._open[id(unit)] += 1
                self._open_unreached(unit)
        return hook

    def pass_unreached(self, reached: set[int], among: set[int] | None = None) -> None:
        """:meth:`Zero3.pass_unreached`; a unit the pass reaches not at all passes when its
        backward opens, or now if it is already open: under a split backward the walk is made at
        ``W``, after the ``I`` that opened it (not on the first stage, whose ``I`` computes
        nothing: there it opens inside ``W``, after the walk)."""
        super().pass_unreached(reached, among)
        if self.split_backward:
            for unit in self.units:
                if self._open[id(unit)] > 0:
                    self._open_unreached(unit)

    def _post_backward(self, unit: _Unit) -> None:
        """One backward's gradients of ``unit`` are in: reduce-scatter them; free the unit
        after its last backward of the step (``step``) or of this microbatch (``microbatch``)."""
        self._reduce_unit(unit, final=self._left[id(unit)] == 1)   # its last backward this step
        self._left[id(unit)] -= 1
        self._open[id(unit)] = max(0, self._open[id(unit)] - 1)
        if self._left[id(unit)] == 0 or (self.reshard == "microbatch" and self._open[id(unit)] == 0):
            self._free(unit)
