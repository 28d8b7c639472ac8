"""fp32 master weights of 16-bit parameters: mixed precision at the ZeRO paper's bytes.

At ZeRO 0-2 in bf16/fp16 the model holds its parameters and gradients in the compute dtype
(2Ψ + 2Ψ bytes); the fp32 masters live with the optimizer states (4Ψ of the 12Ψ), sharded
like them (ZeRO-1/2: this rank's shard only). The optimizer updates the masters; each step:

    master.grad = grad16.float() * scale        # unscale (1 / tokens, fp16's loss scale, clip)
    optimizer.step()                           # on the fp32 masters
    param16.copy_(master); master.grad = None  # ZeRO-1/2: then all-gather the 16-bit params

The gradient factors (``finish``'s 1/token count and loss scale, clipping) are deferred into
``scale`` and applied in fp32, so small fp16 gradients do not underflow when unscaled; the
fp32 gradients exist only during the step. ZeRO-3 keeps fp32 shards as the parameters instead
(FSDP2 style) and needs none of this.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class MasterWeights:
    """The optimizer's fp32 ``masters`` of the 16-bit ``lows`` (same shapes), whose gradients
    are ``grads`` (16-bit, shaped like the masters)."""

    def __init__(self, masters: list[nn.Parameter], lows: list[torch.Tensor],
                 grads: list[torch.Tensor]) -> None:
        self.masters, self.lows, self.grads = masters, lows, grads
        self.scale = 1.0
        """The factor the 16-bit gradients still have to be multiplied by."""

    def step(self, optimizer: torch.optim.Optimizer, *, skip: set[int] | frozenset[int] = frozenset(),
             run: Callable[[torch.optim.Optimizer], None] | None = None) -> None:
        """Unscale the gradients into the masters, step them (``run(optimizer)`` in place of
        ``optimizer.step()``: ZeRO's per-parameter step), cast them back into the params
        (masters whose id is in ``skip`` get no gradient: unused this step)."""
        for m, g in zip(self.masters, self.grads):
            m.grad = None if id(m) in skip else g.detach().to(m.dtype).mul_(self.scale)
        if run is not None:
            run(optimizer)
        else:
            optimizer.step()
        for m in self.masters:
            m.grad = None
        self.copy_to_params()
        self.scale = 1.0

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """Cast the masters into the 16-bit parameters (after a step or a checkpoint load)."""
        for m, low in zip(self.masters, self.lows):
            low.copy_(m)
