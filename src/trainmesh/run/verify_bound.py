"""``trainmesh verify``'s judgement: each step of a layout against one process's, beside the
bound that reduction-order rounding allows at that step (docs/VERIFY.md derives it).

A layout changes only the order in which floating-point sums are taken (a sum split over ranks,
microbatches or chunks, then combined). One sum of ``n`` terms rounded in another order differs
by about ``sqrt(n) * eps`` of its terms' magnitude (random-walk rounding; Higham, "Accuracy and
Stability of Numerical Algorithms", sec. 4.2); a step chains a few such sums (forward,
backward, loss), covered by :data:`SAFETY`. That is step 1's relative bound ``r``. Each
optimizer step carries what the weights already differ by and adds its own rounding; modelled as
at most doubling the carried difference (:data:`GROWTH`), step k's quantities may differ by
``r * 2**(k-1)``: loss ``|L_k| * r * 2**(k-1)`` absolute, grad norm ``r * 2**(k-1)`` relative,
each capped at the promise for training runs (loss 1e-3, grad norm 1e-3 relative). In bf16 and
fp16 the bound is one 16-bit rounding per stage, ``SAFETY * eps``, at every step.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

EPS = {"fp32": 2.0 ** -23, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
"""One rounding of the compute precision, relative (the spacing of numbers near 1)."""
SAFETY = 16.0
"""The rounding stages a step chains (forward, backward, loss: at most ~8 in a layer), x2."""
GROWTH = 2.0
"""How much an optimizer step may amplify the difference the weights carry (at most doubling
it: the carried difference, plus the update's response to it, no larger than itself)."""
LOSS_ABS = 1e-3
"""The promise for training runs: a layout's loss within 1e-3 of one process's, absolute."""
NORM_REL = 1e-3
"""The promise for training runs: a layout's grad norm within 1e-3 of one process's, relative."""


@dataclass(frozen=True)
class Bound:
    """What rounding allows between a layout's step and one process's."""

    precision: str
    """Compute precision (``fp32``, ``bf16``, ``fp16``)."""
    terms: int
    """The longest sum of a step: the tokens of the global batch (the loss's mean, each
    weight's gradient) or the widest dimension of a weight (a matrix product, the softmax over
    the vocabulary), whichever is larger."""

    @property
    def sixteen_bit(self) -> bool:
        """bf16 or fp16: every stage's result rounded to 16 bits (:meth:`relative`)."""
        return self.precision != "fp32"

    @property
    def first(self) -> float:
        """Step 1's relative bound: ``SAFETY * eps * sqrt(terms)``; in 16 bits ``SAFETY * eps``
        (the sums accumulate in fp32, whose rounding is far below one 16-bit rounding of
        their result)."""
        terms = 1 if self.sixteen_bit else max(self.terms, 1)
        return SAFETY * EPS[self.precision] * math.sqrt(terms)

    def relative(self, step: int) -> float:
        """Step ``step``'s relative bound, before the cap: ``first * GROWTH**(step - 1)``. In 16
        bits ``first`` at every step: each step's results are rounded to 16 bits again, so what
        the weights carry is of the size of that rounding (and the bound already as wide as
        16 roundings of it)."""
        if self.sixteen_bit:
            return self.first
        return self.first * GROWTH ** min(step - 1, 1000)

    def loss(self, step: int, loss: float) -> float:
        """Absolute bound on step ``step``'s loss difference, one process's loss being ``loss``
        (fp32: at most the promise)."""
        bound = self.relative(step) * abs(loss)
        return bound if self.sixteen_bit else min(LOSS_ABS, bound)

    def grad_norm(self, step: int) -> float:
        """Relative bound on step ``step``'s grad-norm difference (fp32: at most the promise)."""
        return self.relative(step) if self.sixteen_bit else min(NORM_REL, self.relative(step))

    def note(self) -> str | None:
        """What the bound means in 16 bits (None in fp32)."""
        if not self.sixteen_bit:
            return None
        return (f"--precision {self.precision} rounds every result to 2^{math.log2(EPS[self.precision]):.0f}: "
                f"the bound is {self.first:.2%} at every step, too wide to tell a small bug from "
                "rounding; the same flags with --precision fp32 check the layout to fp32's rounding")


@dataclass(frozen=True)
class Row:
    """One step of both runs."""

    step: int
    loss: float
    """The layout's loss."""
    loss_one: float
    """One process's loss."""
    loss_bound: float
    norm: float
    norm_one: float
    norm_bound: float

    @property
    def loss_diff(self) -> float:
        return abs(self.loss - self.loss_one)

    @property
    def norm_rel(self) -> float:
        """|layout - one process| / |one process| of the grad norm (0 when both are 0)."""
        diff = abs(self.norm - self.norm_one)
        return diff / abs(self.norm_one) if self.norm_one else (0.0 if diff == 0 else math.inf)

    def failed(self) -> str | None:
        """The first quantity beyond its bound (``loss``, ``grad_norm``), or None. A value that
        is not finite is beyond any bound."""
        if not self.loss_diff <= self.loss_bound:
            return "loss"
        if not self.norm_rel <= self.norm_bound:
            return "grad_norm"
        return None


def steps_of(records: Iterable[dict]) -> dict[int, dict]:
    """{step: its record} of a metrics file's step records (the last record of a step wins)."""
    return {r["step"]: r for r in records if r.get("event") == "step"}


def compare(one: Iterable[dict], layout: Iterable[dict], bound: Bound) -> tuple[list[Row], list[int]]:
    """(a row per step both runs took, in order; the steps only one of them took)."""
    a, b = steps_of(one), steps_of(layout)
    rows = [Row(k, b[k]["loss"], a[k]["loss"], bound.loss(k, a[k]["loss"]), b[k]["grad_norm"],
                a[k]["grad_norm"], bound.grad_norm(k)) for k in sorted(set(a) & set(b))]
    return rows, sorted(set(a) ^ set(b))


HEADER = ("step", "loss (layout)", "loss (one process)", "|diff|", "bound",
          "grad-norm rel diff", "bound", "")


def table(rows: list[Row]) -> str:
    """The rows as a plain-text table, one line per step."""
    cells = [HEADER] + [(str(r.step), f"{r.loss:.6f}", f"{r.loss_one:.6f}", f"{r.loss_diff:.1e}",
                         f"{r.loss_bound:.1e}", f"{r.norm_rel:.1e}", f"{r.norm_bound:.1e}",
                         "FAIL" if r.failed() else "ok") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)).rstrip() for line in cells)


def verdict(rows: list[Row], unmatched: list[int], what: str) -> tuple[bool, str]:
    """(passed, the line saying so) for layout ``what`` against one process."""
    if not rows:
        return False, f"FAIL: no step of {what} to compare with one process"
    for r in rows:
        quantity = r.failed()
        if quantity == "loss":
            return False, (f"FAIL: step {r.step}: loss differs by {r.loss_diff:.2e} "
                           f"({r.loss:.6f} vs one process {r.loss_one:.6f}), beyond the bound "
                           f"{r.loss_bound:.1e} that rounding allows: {what} does not compute "
                           "what one process does")
        if quantity == "grad_norm":
            return False, (f"FAIL: step {r.step}: grad_norm differs by {r.norm_rel:.2e} relative "
                           f"({r.norm:.6g} vs one process {r.norm_one:.6g}), beyond the bound "
                           f"{r.norm_bound:.1e} that rounding allows: {what} does not compute "
                           "what one process does")
    if unmatched:
        return False, f"FAIL: step {unmatched[0]} was taken by one run only"
    worst_loss = max(rows, key=lambda r: r.loss_diff)
    worst_norm = max(rows, key=lambda r: r.norm_rel)
    return True, (f"PASS: {what} equals one process within rounding for {len(rows)} steps "
                  f"(largest: loss {worst_loss.loss_diff:.1e} at step {worst_loss.step}, "
                  f"grad_norm {worst_norm.norm_rel:.1e} relative at step {worst_norm.step})")
