"""Precision policy: compute dtype, the dtype gradients are reduced in, and fp16 loss scaling.

fp32 weights are always the masters; forward and backward run under ``torch.autocast`` in
the compute dtype:

- DDP and ZeRO-1/2 (the ZeRO paper's bytes): the model holds 16-bit parameters and gradients;
  the fp32 masters live with the optimizer state (:mod:`trainmesh.data_parallel.master`), and
  gradients are reduced in ``reduce_dtype``.
- ZeRO-3 (FSDP2 style): the fp32 shards are the masters; a unit's parameters are all-gathered
  in the compute dtype (half the bytes), their gradients come out in it and are reduce-scattered
  in ``reduce_dtype`` into fp32 gradient shards.

fp16 has a narrow range, so the loss is multiplied by a dynamic scale (start 2^16, x2 after
``growth_interval`` good steps in a row, x0.5 and the step skipped when any gradient element on
any rank is inf/NaN: every rank skips the same step). An overflow at the minimum scale (1, as
DeepSpeed's default) cannot be cured by backing off: it is reported as non-finite (``nonfinite()``)
and the trainer's ``--on-nonfinite`` policy decides. bf16 has fp32's range and needs none.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LossScaler:
    """Dynamic loss scaling (as torch.amp.GradScaler): grow after a run of finite steps,
    back off on an overflow."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0
    min_scale: float = 1.0
    """The scale never backs off below this; an overflow at it is a non-finite step."""

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0


def check_supported(name: str, device: torch.device) -> None:
    """Raise ConfigError("precision", ...) if ``device`` cannot train in precision ``name``."""
    if name == "fp32":
        return
    dtype = DTYPES[name]
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ConfigError("precision", f"bf16 is not supported by {torch.cuda.get_device_name(device)}; "
                          "valid here: fp32, fp16")
    try:   # a tiny autocast step: matmul, attention and their backward
        x = torch.randn(1, 1, 4, 8, device=device, requires_grad=True)
        w = torch.randn(8, 8, device=device, requires_grad=True)
        with torch.autocast(device.type, dtype=dtype):
            y = x @ w
            z = torch.nn.functional.scaled_dot_product_attention(y, y, y, is_causal=True)
        z.float().sum().backward()
        ok = z.dtype == dtype and w.grad is not None
    except (RuntimeError, TypeError) as exc:
        raise ConfigError("precision", f"{name} is not supported on {device.type} by this torch build "
                          f"({str(exc).splitlines()[0]}); use --precision fp32") from exc
    if not ok:
        raise ConfigError("precision", f"autocast on {device.type} does not compute in {name}; "
                          "use --precision fp32")


class Precision:
    """The step's precision: ``autocast()``, ``scale_loss()``, ``should_skip()``, ``metrics()``."""

    def __init__(self, cfg: ParallelConfig, device: torch.device, *, init_scale: float = 2.0**16,
                 growth_interval: int = 2000, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5) -> None:
        check_supported(cfg.precision, device)
        self.cfg = cfg
        self.name = cfg.precision
        self.device = device
        self.compute_dtype = DTYPES[cfg.precision]
        # the compute dtype; under fp32 that is the model's own (None: a float64 model's
        # gradients are reduced in float64, not cast to float32 and back)
        self.reduce_dtype = (torch.float32 if cfg.reduce_dtype == "fp32"
                             else None if self.compute_dtype == torch.float32 else self.compute_dtype)
        self.scaler = (LossScaler(init_scale, growth_factor, backoff_factor, growth_interval)
                       if cfg.precision == "fp16" else None)
        self.skipped = False
        self._step_scale = self.loss_scale

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != torch.float32

    @property
    def loss_scale(self) -> float:
        """The factor this step's loss is multiplied by (1 unless fp16)."""
        return self.scaler.scale if self.scaler else 1.0

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if not self.mixed:
            yield
            return
        with torch.autocast(self.device.type, dtype=self.compute_dtype):
            yield

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.loss_scale != 1.0 else loss

    def should_skip(self, grads_finite: torch.Tensor | Callable[[], torch.Tensor],
                    all_reduce_min: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """fp16: whether every rank skips this step (:meth:`overflowed`), the scaler updated
        at once (:meth:`commit`). Never skips otherwise."""
        self.commit(self.overflowed(grads_finite, all_reduce_min))
        return self.skipped

    def overflowed(self, grads_finite: torch.Tensor | Callable[[], torch.Tensor],
                   all_reduce_min: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """fp16: whether some gradient element on some rank, in some shard, is inf/NaN (every
        rank gets the same answer); the scaler is left as it is until :meth:`commit`. Always
        False otherwise (and computes and sends nothing). ``grads_finite``: this rank's
        1.0/0.0 flag, or a function computing it (called only when needed: checking every
        gradient element costs a pass over them)."""
        self._step_scale = self.loss_scale
        if self.scaler is None:
            return False
        if callable(grads_finite):
            grads_finite = grads_finite()
        flag = all_reduce_min(grads_finite.detach().reshape(1).to(torch.float32).clone())
        return not bool(flag.item() >= 1.0)

    def commit(self, overflowed: bool) -> None:
        """The step is taken (applied, or skipped for its overflow): the scale backs off or
        grows. A step attempt that is discarded instead (fault tolerance) never calls it."""
        if self.scaler is None:
            return
        self.scaler.update(not overflowed)
        self.skipped = overflowed

    def nonfinite(self, overflowed: bool | None = None) -> str | None:
        """fp16: why this step's overflow is a failure (it happened at the minimum scale).
        ``overflowed``: the step's :meth:`overflowed` (default: the last committed step's)."""
        overflowed = self.skipped if overflowed is None else overflowed
        if self.scaler is None or not overflowed or self._step_scale > self.scaler.min_scale:
            return None
        return f"gradients overflow fp16 at the minimum loss scale {self._step_scale:g}"

    def state_dict(self) -> dict:
        """Checkpointing: the loss scaler's state (fp16), else {}."""
        if self.scaler is None:
            return {}
        return {"scale": self.scaler.scale, "good_steps": self.scaler.good_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and "scale" in state:
            self.scaler.scale, self.scaler.good_steps = float(state["scale"]), int(state["good_steps"])

    def metrics(self) -> dict:
        """fp16: {"loss_scale": the scale this step used, "skipped": bool}; otherwise {}."""
        if self.scaler is None:
            return {}
        return {"loss_scale": self._step_scale, "skipped": self.skipped}
