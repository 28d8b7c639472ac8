"""Learning-rate schedule: linear warm-up, then cosine decay to 10% of the peak at the last step."""
from __future__ import annotations

import math

import torch


def warmup_cosine(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                  min_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:  # step 0 is the first optimizer step
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
