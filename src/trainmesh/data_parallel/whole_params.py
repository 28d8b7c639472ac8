"""A user's optimizer that needs whole parameters (Shampoo-like preconditioners, Adafactor's
factored moments, ...), under every sharding.

An optimizer declares it with ``needs_whole_params = True`` on the object its factory returns,
or the factory is wrapped: ``tm.whole_params(factory)``. The engine then builds
:class:`WholeParams` over what its strategy hands an optimizer (ZeRO's flat shards, tp shards,
whole parameters) and sets its ``wholes`` map for the layout (:mod:`.muon_owners`): each step,
every parameter's whole value and gradient are assembled (under ZeRO at one owner rank of the
shard group, balanced over the ranks; under tp gathered over tp), the user's optimizer steps
that whole parameter, and each rank keeps its part of the result. The user's optimizer, and so
its states, is built per parameter where it steps (its owner), at its first step; its group
options (the learning rate a schedule sets included) follow the wrapper's. Element-wise
optimizers keep stepping flat shards as they are.

Not yet: such an optimizer's states are not in checkpoints (they live with each parameter's
owner, not in the shard layout a checkpoint gathers); a resumed run starts them afresh.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .muon import Local

Factory = Callable[[Any], torch.optim.Optimizer]


class WholeParams(torch.optim.Optimizer):
    """``factory``'s optimizer stepping each parameter whole (module docstring)."""

    needs_whole_params = True

    def __init__(self, params, factory: Factory) -> None:
        probe = factory([nn.Parameter(torch.zeros(1))])   # its defaults: lr for the schedule
        super().__init__(params, {**probe.defaults, "whole": True})
        self.factory = factory
        self.wholes = Local()
        """Set by the engine for the layout (:func:`~.muon_owners.install`)."""
        self.inner: dict[Any, tuple[nn.Parameter, torch.optim.Optimizer]] = {}
        """Per parameter stepped here: (its whole copy, the user's optimizer over it)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            options = {k: v for k, v in group.items() if k not in ("params", "whole")}
            for p in group["params"]:
                if p.grad is None:
                    continue
                new = self.wholes.map(p, [p.detach(), p.grad],
                                      lambda name, whole: self._step_whole(name or id(p), whole, options))
                p.copy_(new)
        return loss

    def _step_whole(self, key: Any, whole: list[torch.Tensor], options: dict) -> torch.Tensor:
        value, grad = whole
        if key not in self.inner:
            copy = nn.Parameter(value.clone())
            self.inner[key] = (copy, self.factory([{**options, "params": [copy]}]))
        copy, opt = self.inner[key]
        opt.param_groups[0].update(options)          # the schedule's lr of this step
        copy.data.copy_(value)
        copy.grad = grad.clone()
        opt.step()
        return copy.detach().clone()


def whole_params(factory: Factory) -> Factory:
    """``factory`` whose optimizer the engine hands whole parameters under every sharding."""
    def build(params) -> torch.optim.Optimizer:
        return WholeParams(params, factory)
    return build


def declared(factory: Factory) -> Factory:
    """``factory``, or, where the optimizer it builds declares ``needs_whole_params`` and has
    no ``wholes`` map of its own, :class:`WholeParams` over it."""
    def build(params) -> torch.optim.Optimizer:
        params = list(params)
        opt = factory(params)
        if getattr(opt, "needs_whole_params", False) and not hasattr(opt, "wholes"):
            return WholeParams(params, factory)
        return opt
    return build
