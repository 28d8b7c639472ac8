"""Expert parallelism for experts that take their tokens in expert-major blocks (Llama 4).

Most transformers mixtures of experts hand their experts module the routing
(``hidden_states, top_k_index, top_k_weights``: :class:`~.hf.Dispatch`). Llama 4's block
routes before it: its router scores every expert per token (sigmoid of the top-k logits, 0
for the others), repeats the tokens once per expert scaled by those scores and calls the
experts module with the ``(E·T, d)`` rows, expert ``e``'s block being rows ``[e T, (e + 1) T)``;
the module multiplies each block by its expert's matrices (``view(E, -1, d)``, ``bmm``) and
the block sums the E outputs per token. A token's row in the block of an expert it did not
choose is zero, and an expert without biases maps a zero row to zero with no gradient to its
matrices (``down(up(0) * act(gate(0))) = 0``), so only the non-zero rows need computing:

1. the non-zero rows (the chosen (expert, token) slots, already in expert order) go to the
   ranks holding their experts by :class:`~.dispatch.ExpertExchange`, as the routed form's;
2. each rank pads its rows per local expert to one block width with zero rows, runs the
   module's own forward (its ``E/ep`` experts) and keeps the real rows;
3. the outputs return and are put back at their rows of an ``(E·T, d)`` zero tensor, which
   the model's block sums as it does in one process.

The scores multiply the rows in the model's own code, so the router's gradient is the one
process's. Only an experts module whose parameters are all stacked matrices (no biases: a
zero row would not give zero) is taken (:func:`takes_blocks`). Imports core.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainmesh.core.compat import in_backward


def takes_blocks(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes only its tokens (``hidden_states``: expert-major
    blocks, the routing applied before it) and holds stacked matrices only."""
    arguments = list(inspect.signature(module.forward).parameters)
    own = list(module.parameters(recurse=False))
    return len(arguments) == 1 and bool(own) and all(p.dim() == 3 for p in own)


class BlockDispatch:
    """The forward of one expert-major experts module under expert parallelism (module
    docstring). ``stats()``: the model's MoE statistics, where it reports them."""

    def __init__(self, forward: Callable[..., torch.Tensor], exchange: Any, n_experts: int,
                 local: int, index: int, stats: Callable[[], Any]) -> None:
        self.forward, self.exchange = forward, exchange
        self.n_experts, self.local, self.index, self.stats = n_experts, local, index, stats

    def compute(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """This rank's experts on ``rows`` grouped by local expert: each group padded with zero
        rows to the widest, the module's forward on the ``(local·width, d)`` blocks, the real
        rows kept (with no rows: one zero row per expert, so the matrices still take part in
        backward, with zero gradient)."""
        width = max(max(per_expert, default=0), 1)
        where = torch.cat([torch.arange(count, device=rows.device) + e * width
                           for e, count in enumerate(per_expert)]) if rows.shape[0] else \
            torch.zeros(0, dtype=torch.long, device=rows.device)
        blocks = rows.new_zeros((self.local * width, rows.shape[-1])).index_copy(0, where, rows)
        return self.forward(blocks).index_select(0, where)            # (rows, d)

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        rows = hidden_states.shape[0]                                 # E·T, expert-major
        chosen = (hidden_states != 0).any(-1)                         # (E·T,) slots with a score
        slots = chosen.nonzero().squeeze(-1)                          # ascending: by expert
        counts = chosen.view(self.n_experts, rows // self.n_experts).sum(1)
        out, received = self.exchange(hidden_states[slots], counts, self.compute)
        stats = self.stats()
        if stats is not None and torch.is_grad_enabled() and not in_backward():
            stats.received[self.index] += received
        return hidden_states.new_zeros(hidden_states.shape).index_copy(
            0, slots, out.to(hidden_states.dtype))                    # (E·T, d)
