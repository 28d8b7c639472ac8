"""A stage's backward split in two (zero-bubble schedules): input gradient now, weights later.

``I`` (:func:`backward_input`) computes only the gradient of the stage's input, the one the
previous stage waits for, and keeps what the weight gradients still need; ``W``
(:func:`backward_weight`) computes the weight gradients later, filling a bubble. Together they
do the work of one full backward, each autograd node's outputs computed once.

How (the approach of ``torch.distributed.pipelining``'s split backward): walk the autograd graph
from the stage's output. The *input path* is every node from which the input's gradient
accumulator is reachable. A weight's path meets the input path at *intermediate* nodes, the
last nodes before it whose incoming gradient the weight needs (e.g. a linear layer's ``addmm``).
``I`` runs ``torch.autograd.grad(out, x, retain_graph=True)`` (only input-path outputs are
computed) with a pre-hook on every intermediate that records the gradient reaching it. ``W``
runs ``torch.autograd.backward`` from those intermediates with their recorded gradients,
``inputs`` = the weights, so gradients accumulate into ``.grad`` and post-accumulate-grad hooks
(DDP buckets, ZeRO reduce-scatter) fire as in a plain backward. A pre-hook on each
intermediate replaces whatever flows into it during ``W`` by its recorded gradient, so an
intermediate downstream of another is not counted twice.

A stage whose input needs no gradient (the first: token ids) has no input path: ``I`` does
nothing and ``W`` is the whole backward. Weights not reached from any intermediate (used apart
from the input) are reached from the output, kept for ``W`` in that case.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

SPLIT_BACKWARD_SUPPORTED = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 7)
"""``torch.autograd.backward`` from gradient edges (what ``W`` runs) came with torch 2.7."""


@dataclass
class PendingWeights:
    """What ``W`` needs from ``I``: recorded gradients at the intermediates, the weights."""

    params: list[nn.Parameter]
    intermediates: list[Node] = field(default_factory=list)
    grads: list[tuple[torch.Tensor | None, ...] | None] = field(default_factory=list)
    roots: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    """(output, its gradient): start ``W`` from the output too (see the module docstring)."""


def _grad_node(t: torch.Tensor) -> Node | None:
    """``t``'s grad_fn, or for a leaf its gradient accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """Reverse edges of the graph under ``root``: node -> the nodes that feed it gradients."""
    out: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt not in out:
                out[nxt] = []
                queue.append(nxt)
            out[nxt].append(node)
    return out


def _upward(starts: list[Node], consumers: dict[Node, list[Node]],
            stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from ``starts`` towards the output, not entering ``stop``; and the
    ``stop`` nodes met on the way."""
    seen, met = set(starts), set()
    queue = deque(starts)
    while queue:
        for up in consumers.get(queue.popleft(), []):
            if up in stop:
                met.add(up)
            elif up not in seen:
                seen.add(up)
                queue.append(up)
    return seen, met


def _plan(out: torch.Tensor, x: torch.Tensor | None,
          params: list[nn.Parameter]) -> tuple[list[Node], bool]:
    """(intermediates, whether some weight is reached only from the output)."""
    root = out.grad_fn
    consumers = _consumers(root)
    x_node = _grad_node(x) if x is not None else None
    input_path, _ = _upward([x_node], consumers, set()) if x_node in consumers else (set(), set())
    intermediates: set[Node] = set()
    from_output = False
    for p in params:
        node = _grad_node(p)
        if node not in consumers:
            continue                                   # unused by this stage's output
        reached, met = _upward([node], consumers, input_path)
        intermediates |= met
        from_output |= not met and root in reached
    return sorted(intermediates, key=id), from_output


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None,
                   params: list[nn.Parameter]) -> tuple[torch.Tensor | None, PendingWeights]:
    """``I``: d loss / d ``x`` (None when ``x`` needs no gradient), and what ``W`` needs.

    ``out`` is the stage output (or the scaled loss on the last stage, ``grad`` None).
    """
    pending = PendingWeights([p for p in params if p.requires_grad])
    if out.grad_fn is None:
        return None, pending
    needs_x = x is not None and x.requires_grad
    if not needs_x:
        pending.roots.append((out, grad))
        return None, pending
    nodes, from_output = _plan(out, x, pending.params)
    pending.intermediates = nodes
    pending.grads = [None] * len(nodes)
    if from_output:
        pending.roots.append((out, grad))

    def recorder(i: int):
        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            pending.grads[i] = grads
        return hook

    handles = [n.register_prehook(recorder(i)) for i, n in enumerate(nodes)]
    try:
        (dx,) = torch.autograd.grad(out, x, grad, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return dx if dx is not None else torch.zeros_like(x), pending


def backward_weight(pending: PendingWeights) -> None:
    """``W``: accumulate the weight gradients into ``.grad`` (hooks fire) and free the graph."""
    edges, grads = [], []
    for node, recorded in zip(pending.intermediates, pending.grads):
        for k, g in enumerate(recorded or ()):
            if g is not None:
                edges.append(GradientEdge(node, k))
                grads.append(g)
    for out, g in pending.roots:
        edges.append(get_gradient_edge(out))
        grads.append(g if g is not None else torch.ones_like(out))
    if not pending.params or not edges:
        return
    clamps = [n.register_prehook(lambda _, saved=saved: saved)
              for n, saved in zip(pending.intermediates, pending.grads) if saved is not None]
    try:
        torch.autograd.backward(edges, grads, inputs=pending.params)
    finally:
        for h in clamps:
            h.remove()
    pending.intermediates, pending.grads, pending.roots = [], [], []
