"""Bytes a CP rank passes per layer and microbatch (the ledger's ``cp`` axis), by mode.

With ``B`` the elements of one rank's K block, ``B = b·(s/cp)·(d/tp)`` (micro-batch b, sequence
s, hidden d: heads split over tp), ``e`` the compute dtype's bytes and ``g`` those of the
gradient accumulators (4; 8 in float64):

- ring, forward: K and V sent (and received) ``cp-1`` times: ``send = 2(cp-1)·B·e``;
  backward: K/V again ``cp-1`` times and dK/dV ``cp`` times: ``2(cp-1)·B·e + 2cp·B·g``.
- allgather, forward: ``all_gather = 2cp·B·e`` (the gathered output); backward:
  ``reduce_scatter = 2cp·B·g`` (the unreduced input).

A forward run again by recomputation (``--recompute full`` or ``selective``) adds its forward
traffic once more. Packed documents: each microbatch's forward also all-gathers every rank's
share of the position ids once, whatever the layers of the rank's stage (they share it,
:class:`~.documents.GatheredDocuments`) and whether recomputation runs them again (it reuses
it): ``all_gather = b·s·8`` bytes (the gathered int64 output), :func:`cp_document_bytes`.
"""
from __future__ import annotations


def cp_bytes_per_layer(*, cp: int, micro_batch: int, seq_len: int, d_model: int, tp: int = 1,
                       mode: str = "ring", elem_bytes: int = 4, grad_bytes: int = 4,
                       forwards: int = 1) -> dict[str, int]:
    """{op: bytes} one CP rank passes for one layer and one microbatch (forward and backward);
    ``forwards``: forward passes per backward (2 with recomputation). Packed documents add
    :func:`cp_document_bytes` per microbatch, not per layer."""
    if cp == 1:
        return {}
    block = micro_batch * (seq_len // cp) * (d_model // tp)
    if mode == "ring":
        p2p = forwards * 2 * (cp - 1) * block * elem_bytes \
            + 2 * (cp - 1) * block * elem_bytes + 2 * cp * block * grad_bytes
        return {"send": p2p, "recv": p2p}
    return {"all_gather": forwards * 2 * cp * block * elem_bytes,
            "reduce_scatter": 2 * cp * block * grad_bytes}


def cp_document_bytes(*, cp: int, micro_batch: int, seq_len: int) -> dict[str, int]:
    """{op: bytes} one CP rank passes for one packed microbatch's documents: the position ids'
    gather, once per microbatch on a rank whose stage holds attention layers (its layers and a
    recomputation share it)."""
    return {} if cp == 1 else {"all_gather": micro_batch * seq_len * 8}
