"""Tensor-parallel layers, each built from an existing full layer by slicing its weight.

Shards are exact slices of the unsharded weights (so every layout starts from the same logical
model). Each layer keeps a :class:`~trainmesh.core.placement.Placements` of its sharded parameters
(``placements``, by attribute name: which slice of the full tensor each holds), which
``parallelize`` files under the parameters' names in the model; replicated ones (the
row-parallel bias) have no record. Parameter attribute names stay ``weight`` and ``bias``, so a
model's parameter names do not change.

The linear layers take an ``nn.Linear`` (weight ``(out, in)``) or a Hugging Face ``Conv1D``
(GPT-2: weight ``(in, out)``, ``y = x W + b``), whose layout they keep (``transposed``), so the
sharded parameters stay slices of the model's own tensors. A fused projection (``parts`` > 1,
e.g. GPT-2's ``c_attn`` = [q | k | v]) splits each of its equal output blocks, so every rank holds
whole heads of q, of k and of v; its shard's record has ``tp_parts`` = 3.

What each layer communicates (n = TP degree; SP = sequence parallel):

- :class:`ColumnParallelLinear`: enters the region on its input (f: fwd identity, bwd all-reduce;
  SP: fwd all-gather along the sequence, bwd reduce-scatter), unless it runs inside a module
  whose input already entered it (the ``parallel_input`` style). Output: (b, s, out/n).
- :class:`RowParallelLinear`: input (b, s, in/n); g on the output (fwd all-reduce, bwd identity;
  SP: fwd reduce-scatter along the sequence, bwd all-gather); bias added once, after g.
- :class:`VocabParallelEmbedding`: vocab rows split; masked local lookup, then fwd all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainmesh.core.placement import Placement, Placements

from ..comm import Comm
from .mappings import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
)
from .state import part_sizes, shard_of


@dataclass
class TPState:
    """What every parallel layer of one ``parallelize`` call shares: group, mode, region depth."""

    comm: Comm
    axis: str = "tp"
    sequence_parallel: bool = False
    inside_region: int = 0
    """> 0 while a ``parallel_input`` module runs: its input has already entered the region."""

    def __deepcopy__(self, memo: dict) -> "TPState":
        return self   # shared by every layer of the model (and its copies): groups are not copied

    @property
    def size(self) -> int:
        return self.comm.mesh.size(self.axis)

    @property
    def rank(self) -> int:
        return self.comm.mesh.index(self.axis)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The f operator: a replicated (SP: sequence-sharded) activation -> the region's input."""
        if self.sequence_parallel:       # (b, s/n, h) -> (b, s, h); tokens flattened (T/n, h) by rows
            return gather_from_sequence(x, self.comm, self.axis, dim=0 if x.dim() == 2 else 1)
        return copy_to_region(x, self.comm, self.axis)              # (b, s, h), bwd all-reduce

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        """The g operator: partial sums -> complete activations (SP: of this rank's chunk)."""
        if self.sequence_parallel:       # (b, s, h) -> (b, s/n, h); (T, h) -> (T/n, h)
            return reduce_scatter_to_sequence(y, self.comm, self.axis, dim=0 if y.dim() == 2 else 1)
        return reduce_from_region(y, self.comm, self.axis)

    def shard(self, full: torch.Tensor, dim: int, parts: int | tuple[int, ...] = 1
              ) -> tuple[nn.Parameter, Placement]:
        """This rank's slice of ``full`` along ``dim``, as a fresh (1/n-sized) parameter, and its
        record; with several ``parts`` (a count of equal blocks, or block sizes), its slice of
        each block along ``dim``, concatenated."""
        width = part_sizes(full.shape[dim], parts)[0] // self.size
        piece = shard_of(full.detach(), dim, self.rank, self.size, parts).clone()
        p = nn.Parameter(piece, requires_grad=full.requires_grad)
        return p, Placement(full_shape=tuple(full.shape), tp_dim=dim,   # full[.., start:+width]
                            tp_start=self.rank * width, tp_parts=parts)  # of each of the parts


def _weight_of(layer: nn.Module) -> tuple[nn.Parameter, bool]:
    """(weight, transposed): an ``nn.Linear``'s ``(out, in)`` weight, or a Hugging Face
    ``Conv1D``'s ``(in, out)`` one (transposed)."""
    if type(layer) is nn.Linear:
        return layer.weight, False
    if is_conv1d(layer):
        return layer.weight, True
    raise TypeError(f"{type(layer).__name__} is neither an nn.Linear nor a Hugging Face Conv1D")


def is_conv1d(module: nn.Module) -> bool:
    """A Hugging Face ``Conv1D`` (GPT-2's linear layer, weight ``(in, out)``), recognised without
    importing transformers."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor)
            and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def features(layer: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an ``nn.Linear`` or a ``Conv1D``."""
    weight, transposed = _weight_of(layer)
    out, inp = weight.shape[::-1] if transposed else weight.shape
    return inp, out


def _check_divisible(what: str, value: int, state: TPState) -> None:
    if value % state.size:
        raise ValueError(f"{what} = {value} is not divisible by the tensor-parallel degree {state.size}")


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows (and b) split: each rank computes out/n features.

    fwd: f on the input (see module docstring), local matmul; with ``gather_output``, also an
    all-gather along the last dim (bwd: keep own chunk). Shapes: (b, s, in) -> (b, s, out/n), or
    (b, s, out) gathered. Under SP the input is (b, s/n, in). ``transposed``: the weight is
    ``(in, out/n)`` (built from a Conv1D).
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, state: TPState, *,
                 gather_output: bool = False, transposed: bool = False) -> None:
        super().__init__()
        self.state, self.gather_output, self.transposed = state, gather_output, transposed
        self.weight, self.bias = weight, bias                       # (out/n, in), (out/n,)
        self.placements = Placements()
        """Records of the sharded parameters, by attribute name (``from_linear`` fills it)."""
        self.out_features, self.in_features = weight.shape[::-1] if transposed else weight.shape

    @classmethod
    def from_linear(cls, linear: nn.Module, state: TPState, *, gather_output: bool = False,
                    parts: int | tuple[int, ...] = 1) -> "ColumnParallelLinear":
        """From an ``nn.Linear`` or ``Conv1D``; several ``parts``: a fused projection of that
        many equal output blocks, or of blocks of the given sizes (q, k, v of grouped-query
        attention), each split (every rank keeps its slice of each)."""
        weight, transposed = _weight_of(linear)
        for size in part_sizes(features(linear)[1], parts):
            _check_divisible("a fused block's out_features", size, state)
        records = {"weight": state.shard(weight, 1 if transposed else 0, parts)}
        if linear.bias is not None:
            records["bias"] = state.shard(linear.bias, 0, parts)
        bias = records["bias"][0] if "bias" in records else None
        layer = cls(records["weight"][0], bias, state, gather_output=gather_output,
                    transposed=transposed)
        for attr, (_, placement) in records.items():
            layer.placements.record(attr, placement)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.state.inside_region:
            x = self.state.enter(x)                                 # (b, s, in)
        weight = self.weight.t() if self.transposed else self.weight
        y = F.linear(x, weight, self.bias)                          # (b, s, out/n)
        if self.gather_output:
            y = gather_from_region(y, self.state.comm, self.state.axis)  # (b, s, out)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local), "
                f"tp={self.state.size}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split: each rank multiplies its in/n slice.

    fwd: local matmul (partial sums), then g (all-reduce; SP: reduce-scatter along the
    sequence), then + bias — once, after the reduction; bwd: identity (SP: all-gather). With
    ``input_is_parallel=False`` a full input is first split along its last dim (bwd all-gather).
    Shapes: (b, s, in/n) -> (b, s, out); under SP -> (b, s/n, out). ``transposed``: the
    weight is ``(in/n, out)`` (built from a Conv1D).
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, state: TPState, *,
                 input_is_parallel: bool = True, transposed: bool = False) -> None:
        super().__init__()
        self.state, self.input_is_parallel, self.transposed = state, input_is_parallel, transposed
        self.weight, self.bias = weight, bias                       # (out, in/n), (out,) replicated
        self.placements = Placements()
        """Record of the sharded weight (``from_linear`` fills it); the bias is replicated."""
        self.out_features, self.in_features = weight.shape[::-1] if transposed else weight.shape

    @classmethod
    def from_linear(cls, linear: nn.Module, state: TPState, *,
                    input_is_parallel: bool = True) -> "RowParallelLinear":
        """From an ``nn.Linear`` or a ``Conv1D``."""
        weight, transposed = _weight_of(linear)
        _check_divisible("in_features", features(linear)[0], state)
        bias = None
        if linear.bias is not None:
            bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        shard, placement = state.shard(weight, 0 if transposed else 1)
        layer = cls(shard, bias, state, input_is_parallel=input_is_parallel, transposed=transposed)
        layer.placements.record("weight", placement)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.state.comm, self.state.axis)  # (b, s, in/n)
        weight = self.weight.t() if self.transposed else self.weight
        y = self.state.leave(F.linear(x, weight))                   # (b, s, out) or (b, s/n, out)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local), out_features={self.out_features}, "
                f"tp={self.state.size}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table with its vocabulary rows split: rank r holds ids [r·V/n, (r+1)·V/n).

    fwd: ids outside this rank's range look up row 0 and are zeroed, then all-reduce (each id
    is found on exactly one rank); bwd: identity (rows of other ranks get no gradient here).
    ``padding_idx`` (global), as nn.Embedding's: its row gets no gradient on the rank holding it.
    Shapes: (b, s) int -> (b, s, h).
    """

    def __init__(self, weight: nn.Parameter, state: TPState, *, num_embeddings: int,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.state, self.weight, self.padding_idx = state, weight, padding_idx   # (V/n, h)
        self.placements = Placements()
        """Record of the sharded table (``from_embedding`` fills it)."""
        self.num_embeddings, self.embedding_dim = num_embeddings, weight.shape[1]
        self.vocab_start = state.rank * weight.shape[0]

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, state: TPState) -> "VocabParallelEmbedding":
        if emb.max_norm is not None or emb.sparse:
            raise ValueError("vocab_embedding supports nn.Embedding without max_norm or sparse")
        _check_divisible("num_embeddings (vocab size)", emb.num_embeddings, state)
        shard, placement = state.shard(emb.weight, 0)
        layer = cls(shard, state, num_embeddings=emb.num_embeddings, padding_idx=emb.padding_idx)
        layer.placements.record("weight", placement)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])     # (b, s) bool
        pad = None if self.padding_idx is None else self.padding_idx - self.vocab_start
        pad = pad if pad is not None and 0 <= pad < self.weight.shape[0] else None
        out = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=pad)   # (b, s, h) partial
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_region(out, self.state.comm, self.state.axis)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (local rows {self.vocab_start}.."
                f"{self.vocab_start + self.weight.shape[0] - 1}), {self.embedding_dim}")
