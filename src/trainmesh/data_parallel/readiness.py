"""Which parameters' gradients are final, and which took part in the step.

A gradient is final after the backward that produced it, except in a pipeline, where a stage
runs ``m`` backward passes through every parameter in any interleaving of stages: there it is
final only after its last (``m``-th) backward of the step (:meth:`Readiness.expect`), and a
weight tied across pipeline stages only once the pipeline has summed it over those stages. The
same object remembers which parameters received a gradient in any backward of the step, for
DDP's ``find_unused_parameters`` semantics: the unused ones are named (an error) or, when asked,
agreed on over the strategy's group so that a parameter no rank used gets no update.

With unused parameters allowed, a parameter may also sit out one backward only (an expert no
token of that microbatch was routed to) or sit out on one rank only. Before each backward the
strategy is told which parameters its graph does not reach (:func:`reached`, DDP's walk of the
autograd graph); they pass that backward at once, without a gradient, so every bucket and
ZeRO-3 unit still completes once per backward and every rank issues the same reductions in the
same order.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..comm import Comm


def reached(roots: list[torch.Tensor]) -> set[int]:
    """id() of every leaf tensor (parameter) whose gradient a backward from ``roots`` computes:
    a walk of the autograd graph to its ``AccumulateGrad`` nodes, as DDP's
    ``find_unused_parameters`` does after each forward."""
    out: set[int] = set()
    seen: set[int] = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            out.add(id(variable))
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return out


class Readiness:
    """Per-step gradient bookkeeping of one strategy's parameters ``named``."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], *, find_unused: bool) -> None:
        self.named = named
        self.find_unused = find_unused
        self.ready: set[int] = set()      # id(param): gradient final in this backward
        self.used: set[int] = set()       # ... in any backward of this step
        self.unused: list[nn.Parameter] = []     # no rank of the group gave them a gradient
        self._remaining: dict[int, int] | None = None   # pipeline: backwards left per param

    def start(self) -> None:
        """A backward begins (one per microbatch): every gradient is final after it."""
        self.ready, self._remaining = set(), None

    def expect(self, n: int, held: Sequence[nn.Parameter] = ()) -> None:
        """Pipeline mode: this step runs ``n`` backward passes through every parameter; those of
        ``held`` wait for one more (:meth:`final` once more, when the pipeline releases them)."""
        self.ready = set()
        extra = {id(p) for p in held}
        self._remaining = {id(p): n + (id(p) in extra) for _, p in self.named}

    def holds(self, p: nn.Parameter) -> bool:
        """Whether ``p`` is one of this strategy's parameters."""
        return any(q is p for _, q in self.named)

    @property
    def pipelined(self) -> bool:
        return self._remaining is not None

    def final(self, p: nn.Parameter) -> bool:
        """A post-accumulate-grad hook fired for ``p``: whether its gradient is now final."""
        self.used.add(id(p))
        return self.passed(p)

    def passed(self, p: nn.Parameter) -> bool:
        """``p`` is done with one backward pass, with a gradient (:meth:`final`) or without
        (the pass's graph does not reach it: :func:`reached`): whether that was its last."""
        if self._remaining is not None:
            self._remaining[id(p)] -= 1
            if self._remaining[id(p)] > 0:
                return False
        self.ready.add(id(p))
        return True

    def unreached(self, reached: set[int], among: set[int] | None = None) -> list[nn.Parameter]:
        """The parameters a backward's graph does not reach (``reached``: id() of those it
        does; ``among``: id() of those the pass goes through, None: all), in registration order."""
        return [p for _, p in self.named
                if id(p) not in reached and (among is None or id(p) in among)]

    def mark(self, p: nn.Parameter) -> None:
        """``p`` received a gradient (strategies that reduce every backward's gradient)."""
        self.ready.add(id(p))
        self.used.add(id(p))

    def check_unused(self, rank: int) -> None:
        """Raise naming the parameters without a gradient in this step's backwards (unless
        ``find_unused``)."""
        missing = [n for n, p in self.named if id(p) not in self.used]
        if missing and not self.find_unused:
            raise RuntimeError(
                f"rank {rank}: parameters received no gradient: "
                f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} "
                "(pass find_unused_parameters=True to reduce them anyway)")

    def local_unused(self) -> int:
        """How many parameters received no gradient this step (0 unless ``find_unused``)."""
        if not self.find_unused:
            return 0
        return sum(id(p) not in self.used for _, p in self.named)

    def agree(self, anywhere: bool, comm: Comm, axis: str, device: torch.device, *,
              replicate: str | None = None,
              across: Callable[[torch.Tensor], None] | None = None) -> None:
        """``anywhere`` (some rank of the world has an unused parameter): one all-reduce over
        ``axis`` (and ``replicate``, HSDP; and ``across`` the fault-tolerant replicas present)
        of a flag per parameter; :attr:`unused` then lists those no rank used."""
        self.unused = []
        if not anywhere:
            return
        flags = torch.tensor([float(id(p) in self.used) for _, p in self.named],
                             dtype=torch.float32, device=device)
        if comm.mesh.size(axis) > 1 and flags.numel():
            comm.all_reduce(flags, axis)
        if replicate is not None and flags.numel():
            comm.all_reduce(flags, replicate)
        if across is not None:   # every replica present: the same count of flags
            across(flags)
        self.unused = [p for (_, p), f in zip(self.named, flags.tolist()) if f == 0.0]

    def end_step(self) -> None:
        """The next step starts with no parameter used."""
        self.used, self.unused = set(), []
