"""Bytes a CP rank passes per layer and microbatch (the ledger's ``cp`` axis), by mode.

With ``B`` the elements of one rank's K block, ``B = b·(s/cp)·(d/tp)`` (micro-batch b, sequence
s, hidden d: heads split over tp), ``e`` the compute dtype's bytes and ``g`` those of the
gradient accumulators (4; 8 in float64):

- ring, forward: K and V sent (and received) ``cp-1`` times: ``send = 2(cp-1)·B·e``;
  backward: K/V again ``cp-1`` times and dK/dV ``cp`` times: ``2(cp-1)·B·e + 2cp·B·g``.
- allgather, forward: ``all_gather = 2cp·B·e`` (the gathered output); backward:
  ``reduce_scatter = 2cp·B·g`` (the unreduced input).

A forward run again by recomputation (``--recompute full`` or ``selective``) adds its forward
traffic once more. Packed documents (``documents``): each forward also all-gathers every
rank's share of the position ids, ``all_gather = b·s·8`` bytes (the gathered int64 output).
"""
from __future__ import annotations


def cp_bytes_per_layer(*, cp: int, micro_batch: int, seq_len: int, d_model: int, tp: int = 1,
                       mode: str = "ring", elem_bytes: int = 4, grad_bytes: int = 4,
                       forwards: int = 1, documents: bool = False) -> dict[str, int]:
    """{op: bytes} one CP rank passes for one layer and one microbatch (forward and backward);
    ``forwards``: forward passes per backward (2 with recomputation); ``documents``: packed
    batches (their position ids gathered in each forward)."""
    if cp == 1:
        return {}
    block = micro_batch * (seq_len // cp) * (d_model // tp)
    ids = forwards * micro_batch * seq_len * 8 if documents else 0
    if mode == "ring":
        p2p = forwards * 2 * (cp - 1) * block * elem_bytes \
            + 2 * (cp - 1) * block * elem_bytes + 2 * cp * block * grad_bytes
        return {"send": p2p, "recv": p2p, **({"all_gather": ids} if ids else {})}
    return {"all_gather": forwards * 2 * cp * block * elem_bytes + ids,
            "reduce_scatter": 2 * cp * block * grad_bytes}
