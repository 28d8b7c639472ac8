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
runs, per group of weights meeting the same intermediates, ``torch.autograd.backward`` from
those intermediates with their recorded gradients and ``inputs`` = the group's weights: the
gradients accumulate into ``.grad`` and post-accumulate-grad hooks (DDP buckets, ZeRO
reduce-scatter) fire as in a plain backward, and no input-path node runs again (one call for
all weights would re-run the input path between intermediates). Within a group a pre-hook pins
each intermediate to its recorded gradient, so one downstream of another is not counted twice.

A stage whose input needs no gradient (the first: token ids) has no input path: ``I`` does
nothing and ``W`` is the whole backward. So is ``W`` when some weight's path never meets the
input path (a weight used apart from the input): correct, with the input path computed twice.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node

SPLIT_BACKWARD_SUPPORTED = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 7)
"""``torch.autograd.backward`` from gradient edges (what ``W`` runs) came with torch 2.7."""


@dataclass(eq=False)
class WeightGroup:
    """Weights whose paths meet the input path at the same intermediates (merged when they
    share one): one ``W`` backward each, so none re-runs the input path of another."""

    params: list[nn.Parameter]
    nodes: list[Node]


@dataclass(eq=False)
class PendingWeights:
    """What ``W`` needs from ``I``: the weight groups and the gradients recorded at their
    intermediates; the output and its gradient where ``W`` starts from it."""

    params: list[nn.Parameter]
    groups: list[WeightGroup] = field(default_factory=list)
    recorded: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    root: tuple[torch.Tensor, torch.Tensor | None] | None = None
    """(output, its gradient): ``W`` is the whole backward (see the module docstring)."""
    output: torch.Tensor | None = None
    """The stage's output (the loss on the last stage), kept for the runtime to walk its graph
    at ``W`` (which parameters sit the microbatch out: passed with its weight gradients)."""


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


def _plan(out: torch.Tensor, x: torch.Tensor,
          params: list[nn.Parameter]) -> tuple[list[WeightGroup], bool]:
    """(the weight groups, whether some used weight meets no intermediate: then ``W`` must
    start from the output)."""
    consumers = _consumers(out.grad_fn)
    x_node = _grad_node(x)
    input_path, _ = _upward([x_node], consumers, set()) if x_node in consumers else (set(), set())
    group_of: dict[Node, WeightGroup] = {}
    groups: list[WeightGroup] = []
    for p in params:
        node = _grad_node(p)
        if node not in consumers:
            continue                                   # unused by this stage's output
        _, met = _upward([node], consumers, input_path)
        if not met:
            return [], True
        merged = {id(g): g for n in met if (g := group_of.get(n)) is not None}
        group = WeightGroup([p], sorted(met, key=id))
        for g in merged.values():                      # union with groups sharing a node
            group.params += g.params
            group.nodes = sorted(set(group.nodes) | set(g.nodes), key=id)
            groups.remove(g)
        groups.append(group)
        group_of.update((n, group) for n in group.nodes)
    return groups, False


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None,
                   params: list[nn.Parameter]) -> tuple[torch.Tensor | None, PendingWeights]:
    """``I``: d loss / d ``x`` (None when ``x`` needs no gradient), and what ``W`` needs.

    ``params`` in registration (forward) order: ``W`` produces their gradients in reverse, the
    order of a plain backward, which the DP strategies' buckets are laid out in.

    ``out`` is the stage output (or the scaled loss on the last stage, ``grad`` None).
    """
    pending = PendingWeights([p for p in params if p.requires_grad])
    if out.grad_fn is None:
        return None, pending
    if x is None or not x.requires_grad:
        pending.root = (out, grad)
        return None, pending
    pending.groups, from_output = _plan(out, x, pending.params)
    if from_output:
        pending.root = (out, grad)

    def recorder(node: Node):
        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            pending.recorded[node] = grads
        return hook

    nodes = [n for g in pending.groups for n in g.nodes]
    handles = [n.register_prehook(recorder(n)) for n in nodes]
    try:
        (dx,) = torch.autograd.grad(out, x, grad, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return dx if dx is not None else torch.zeros_like(x), pending


def backward_weight(pending: PendingWeights) -> None:
    """``W``: accumulate the weight gradients into ``.grad`` (hooks fire) and free the graph."""
    if pending.root is not None:       # the whole backward, from the output
        out, grad = pending.root
        if pending.params:
            torch.autograd.backward(out, grad, inputs=pending.params)
    else:   # last weights first, as a plain backward produces them (DP buckets expect it)
        for group in reversed(pending.groups):
            _group_backward(group, pending.recorded)
    pending.groups, pending.recorded, pending.root, pending.output = [], {}, None, None


def _group_backward(group: WeightGroup, recorded: dict[Node, tuple]) -> None:
    """One group's weight gradients, from its intermediates' recorded gradients; a pre-hook
    pins each intermediate to its recorded gradient (one downstream of another in the group
    would otherwise receive its gradient twice)."""
    edges, grads = [], []
    for node in group.nodes:
        for k, g in enumerate(recorded.get(node) or ()):
            if g is not None:
                edges.append(GradientEdge(node, k))
                grads.append(g)
    if not edges:
        return
    clamps = ([n.register_prehook(lambda _, saved=recorded.get(n): saved) for n in group.nodes]
              if len(group.nodes) > 1 else [])
    try:
        torch.autograd.backward(edges, grads, inputs=group.params)
    finally:
        for h in clamps:
            h.remove()
