"""The zero-bubble split backward (``pipeline_parallel.split_backward``), one process, float64:
``I`` then ``W`` give the input gradient and every weight gradient of one full backward, and the
post-accumulate-grad hooks the DP strategies rely on fire once per weight, in ``W``.

Cases: a GPT stage ending in the loss; a weight used at several places of the input path (its
groups merge; each intermediate pinned to its recorded gradient, else counted twice); a weight
used apart from the input (``W`` from the output); a first stage (no input gradient).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from trainmesh.pipeline_parallel.split_backward import (
    SPLIT_BACKWARD_SUPPORTED,
    backward_input,
    backward_weight,
)

pytestmark = pytest.mark.skipif(not SPLIT_BACKWARD_SUPPORTED, reason="needs torch >= 2.7")
REL = 1e-12   # float64, the same operations in another order: rounding only


class Shared(nn.Module):
    """One linear used three times on the input path, plus a weight that never meets the input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.apart = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return self.lin(h) * self.lin(x) + self.apart.exp()


def _gpt_stage():
    from trainmesh.models.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2), seed=0)
    return model.double(), list(model.pipeline_layers())


def _compare(run, params: list[nn.Parameter], x: torch.Tensor | None) -> None:
    """``run()`` -> (output, its gradient or None): full backward vs I then W."""
    for t in [*params, *([x] if x is not None else [])]:
        t.grad = None
    out, grad = run()
    out.backward(grad)
    want = [p.grad.clone() for p in params]
    want_dx = x.grad.clone() if x is not None else None
    for p in params:
        p.grad = None
    fired: list[int] = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p))) for p in params]
    out, grad = run()
    dx, pending = backward_input(out, grad, x, params)
    assert all(p.grad is None for p in params) and not fired      # I left the weights alone
    del out
    backward_weight(pending)
    for h in handles:
        h.remove()
    assert sorted(fired) == sorted(id(p) for p in params)         # each weight's hook once, in W
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w, rtol=REL, atol=REL * w.abs().max().item())
    if x is not None:
        torch.testing.assert_close(dx, want_dx, rtol=REL, atol=REL * want_dx.abs().max().item())


def test_gpt_stage_ending_in_the_loss() -> None:
    model, layers = _gpt_stage()
    batch = {"input_ids": torch.randint(0, 32, (2, 8)), "labels": torch.randint(0, 32, (2, 8))}
    x = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
    stage = layers[2:]                                  # the second block and the head
    params = [p for layer in stage for p in layer.parameters()]

    def run():
        y = x
        for layer in stage:
            y = layer(y)
        loss_sum, _ = model.pipeline_output(y, **batch)
        return loss_sum, None
    _compare(run, params, x)


def test_weight_used_at_several_places_and_apart_from_the_input() -> None:
    torch.manual_seed(0)
    model = Shared().double()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 6, dtype=torch.float64)
    _compare(lambda: (model(x), g), list(model.parameters()), x)
    model.apart.requires_grad_(False)                   # only the shared linear: merged groups
    _compare(lambda: (model(x), g), [model.lin.weight, model.lin.bias], x)


def test_first_stage_does_the_whole_backward_in_w() -> None:
    model, layers = _gpt_stage()
    ids = torch.randint(0, 32, (2, 8))
    stage = layers[:2]                                  # the embedding and the first block
    g = torch.randn(2, 8, 16, dtype=torch.float64)
    params = [p for layer in stage for p in layer.parameters()]

    def run():
        y = ids
        for layer in stage:
            y = layer(y)
        return y, g
    _compare(run, params, None)
