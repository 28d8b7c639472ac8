"""Ring attention's compute per CP rank with packed documents against the unmasked causal
sequence: cp 4, eight documents per sequence.

Each CP rank's share of one attention layer (forward and backward, the ring's own code:
:func:`trainmesh.context_parallel.ring_attention`) is run in this process with a stand-in ring
that hands the rank its own K/V block back at every hop (no transfer: the time is the
compute; the blocks computed, and their shapes, are those of the real ring, which the plan
decides from the documents). Per rank it reports

- the FLOPs of the blocks actually computed, counted from the plan (a full block or piece
  ``nq·nk`` query-key pairs, a diagonal one its triangle; 4·hd FLOPs per pair and head
  forward, 10·hd backward: scores again, dV, dP, dQ, dK);
- the CPU time of the forward and backward (this process's, one thread by default: what other
  jobs on the machine take is not counted), the fewest over the repeats, the two alternated;
- the pairs attended, and the imbalance the zigzag split leaves with documents (the most
  loaded rank over the mean);

each against the same rank without documents, and the largest ratio over the ranks. Run from
the repository root:

    python benchmarks/bench_packed_cp.py --seq-len 8192 --heads 4 --head-dim 64 --repeats 5
"""
from __future__ import annotations

import argparse
import time

import torch

from trainmesh.context_parallel import fused_available, ring_attention, shard_sequence
from trainmesh.context_parallel.documents import document_ids, rank_work


class Loopback:
    """A CP rank's ring with the transfers taken out: each hop hands back the block sent."""

    def __init__(self, index: int, size: int) -> None:
        self.index, self.size = index, size

    def shift(self, t):
        return lambda: t

    def all_gather(self, t):
        return torch.stack([t] * self.size)

    def reduce_scatter(self, t):
        return t[self.index]


def packed_positions(seq_len: int, documents: int, seed: int) -> torch.Tensor:
    """(1, seq_len) position ids of ``documents`` documents of random lengths (each at least
    half the mean, the cuts drawn from ``seed``): they fall anywhere, across chunk edges."""
    g = torch.Generator().manual_seed(seed)
    mean = seq_len // documents
    extra = torch.rand(documents, generator=g)
    lengths = (mean // 2 + (extra / extra.sum() * (seq_len - documents * (mean // 2)))).long()
    lengths[-1] += seq_len - int(lengths.sum())
    return torch.cat([torch.arange(int(n)) for n in lengths]).unsqueeze(0)


def time_rank(rank: int, cp: int, q, k, v, docs, fused: bool, repeats: int) -> tuple[float, float]:
    """Fewest CPU seconds (this process's: time the machine gave other jobs is not counted) of
    rank ``rank``'s forward and backward of one attention layer, without and with ``docs``,
    the two alternated so that the machine's noise hits both alike."""
    mine = [shard_sequence(t, rank, cp, dim=2) for t in (q, k, v)]
    ring = Loopback(rank, cp)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats + 1):                      # the first is a warm-up
        for packed in (False, True):
            leaves = [t.detach().requires_grad_() for t in mine]
            t0 = time.process_time()
            out = ring_attention(*leaves, ring, mode="ring", fused=fused,
                                 documents=docs if packed else None)
            out.backward(torch.ones_like(out))
            times[packed].append(time.process_time() - t0)
    return min(times[False][1:]), min(times[True][1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--math", action="store_true", help="the math path, not the fused kernels")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the CPU time measured is then the compute's; "
                         "on a shared machine threads of small ops wait on one another)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cp, s = args.cp, args.seq_len
    fused = not args.math and fused_available(torch.device("cpu"))
    position_ids = packed_positions(s, args.documents, args.seed)
    docs = document_ids(position_ids)
    g = torch.Generator().manual_seed(args.seed)
    q, k, v = (torch.randn(1, args.heads, s, args.head_dim, generator=g) for _ in range(3))
    flops = 14 * args.heads * args.head_dim                 # per computed pair, fwd + bwd
    plain, packed = rank_work(None, cp, s), rank_work(docs, cp, s)
    lengths = torch.unique_consecutive(docs, return_counts=True)[1].tolist()
    print(f"cp {cp}, seq {s}, {len(lengths)} documents {lengths}, heads {args.heads}, "
          f"head dim {args.head_dim}, {'fused' if fused else 'math'} blocks, "
          f"{torch.get_num_threads()} threads")
    worst_f = worst_t = 0.0
    for r in range(cp):
        t_plain, t_packed = time_rank(r, cp, q, k, v, docs, fused, args.repeats)
        f_plain, f_packed = plain[r]["computed_pairs"] * flops, packed[r]["computed_pairs"] * flops
        worst_f, worst_t = max(worst_f, f_packed / f_plain), max(worst_t, t_packed / t_plain)
        print(f"rank {r}: FLOPs {f_packed / 1e9:.3f} G vs {f_plain / 1e9:.3f} G causal "
              f"({f_packed / f_plain:.3f}x), CPU time {t_packed * 1e3:.1f} ms vs "
              f"{t_plain * 1e3:.1f} ms ({t_packed / t_plain:.3f}x), "
              f"{packed[r]['pieces']} pieces vs {plain[r]['pieces']} blocks, "
              f"attended pairs {packed[r]['attended_pairs']}")
    attended = [w["attended_pairs"] for w in packed]
    print(f"zigzag imbalance with documents: most loaded rank {max(attended) / (sum(attended) / cp):.2f}x "
          f"the mean (without: 1.00x)")
    print(f"largest ratio over ranks: FLOPs {worst_f:.3f}x, time {worst_t:.3f}x "
          f"({'PASS' if max(worst_f, worst_t) <= 0.35 else 'FAIL'}: at most 0.35x)")


if __name__ == "__main__":
    main()
