"""Tensor parallelism (Megatron style) and sequence parallelism over the mesh's ``tp`` axis.

``parallelize(model, mesh, comm, plan=..., sequence_parallel=...)`` applies a plan (module-name
pattern -> style, :mod:`.plan`) to a built model; the layers (:mod:`.layers`), the vocab-parallel
loss (:mod:`.loss`) and the differentiable collectives (:mod:`.mappings`) are usable directly.
See docs/TENSOR_PARALLEL.md.
Imports core and comm only; models declare their plans as data.
"""
from .hf import hf_tp_plan
from .layers import (
                       ColumnParallelLinear,
                       RowParallelLinear,
                       TPState,
                       VocabParallelEmbedding,
)
from .loss import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from .mappings import (
                       copy_to_region,
                       gather_from_region,
                       gather_from_sequence,
                       reduce_from_region,
                       reduce_scatter_to_sequence,
                       scatter_to_region,
                       scatter_to_sequence,
)
from .parallelize import parallelize
from .plan import STYLES, default_plan

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "STYLES", "TPState", "VocabParallelCrossEntropy",
           "VocabParallelEmbedding", "copy_to_region", "default_plan", "gather_from_region",
           "gather_from_sequence", "hf_tp_plan", "parallelize", "reduce_from_region",
           "reduce_scatter_to_sequence", "scatter_to_region", "scatter_to_sequence",
           "vocab_parallel_cross_entropy"]
