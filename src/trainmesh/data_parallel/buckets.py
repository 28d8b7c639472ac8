"""The bucket machinery every bucketed strategy shares (DDP's all-reduce, ZeRO-1/2's
reduce-scatter).

A strategy cuts its gradients into buckets once, in one deterministic order (reverse
registration order of the parameters: the order autograd tends to produce them in), and hands
them to a :class:`Bucketer` with the parameters each bucket covers. Each final gradient is
*given* to the bucketer (:meth:`Bucketer.give`); a bucket is complete when every parameter in
it has been given since the bucket last went out; complete buckets are launched strictly in
the one global order — so every rank issues the same sequence of collectives whatever order
autograd produces the gradients in — and the bucket is re-armed at once. (ZeRO-3's units are
buckets too, launched each as soon as it is complete: ``ordered=False``.) A bucket therefore
goes out once per backward (DDP, ZeRO-1: once per step, in the last backward; ZeRO-2: once per
microbatch), or, under a pipeline, once per round of gradients whatever the interleaving of
microbatches. :meth:`Bucketer.flush` sends a partial round (parameters that received no
gradient) so that nothing is left behind and every rank launched the same buckets.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from torch import nn


@dataclass
class Bucket:
    """What the bucketer counts for one bucket; strategies subclass it with their payload."""

    index: int
    params: list[nn.Parameter] = field(default_factory=list)
    pending: int = 0
    given: set[int] = field(default_factory=set)

    def arm(self) -> None:
        """Nothing given since the last launch."""
        self.pending, self.given = len(self.params), set()


B = TypeVar("B", bound=Bucket)


class Bucketer(Generic[B]):
    """Counts gradients into ``buckets`` (in launch order) and launches each complete bucket
    through ``launch``, strictly in that order."""

    def __init__(self, buckets: Sequence[B], launch: Callable[[B], None], *,
                 ordered: bool = True) -> None:
        self.buckets = list(buckets)
        self.launch = launch
        self.ordered = ordered
        """Launch in the buckets' order (else each as soon as it is complete: ZeRO-3's units,
        which complete in backward order, the same on every rank)."""
        self.next = 0                                    # the next bucket to go out
        self._of: dict[int, list[B]] = {}
        for b in self.buckets:
            for p in b.params:
                self._of.setdefault(id(p), []).append(b)
        self.arm()

    def buckets_of(self, p: nn.Parameter) -> list[B]:
        """The buckets holding (a piece of) ``p``, in launch order."""
        return self._of[id(p)]

    def arm(self) -> None:
        """A new round: nothing given, nothing launched."""
        self.next = 0
        for b in self.buckets:
            b.arm()

    def give(self, p: nn.Parameter) -> None:
        """``p``'s gradient is in its buckets: count it (once per round) and launch what is ready."""
        for b in self._of[id(p)]:
            if id(p) not in b.given:
                b.given.add(id(p))
                b.pending -= 1
        if self.ordered:
            self.launch_ready()
            return
        for b in self._of[id(p)]:
            if b.pending == 0:
                self.launch(b)
                b.arm()

    def launch_ready(self, *, force: bool = False) -> None:
        """Launch every complete bucket from the next one on (``force``: every bucket left)."""
        while self.next < len(self.buckets):
            b = self.buckets[self.next]
            if b.pending > 0 and not force:
                return
            self.launch(b)
            b.arm()
            self.next += 1
        self.next = 0                                    # a whole round went out

    def partial(self) -> bool:
        """Some buckets of the round went out or hold gradients, but not all went out."""
        return self.next > 0 or any(b.given for b in self.buckets)

    def flush(self) -> None:
        """Launch the rest of a partial round (buckets whose parameters got no gradient)."""
        if self.partial():
            self.launch_ready(force=True)
