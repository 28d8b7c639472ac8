"""Context parallelism over the mesh's ``cp`` axis: each sequence split over cp ranks (zigzag,
load-balanced for causal attention), attention over the whole sequence by ring or all-gather.

``apply_context_parallel(model, mesh, comm, mode=...)`` swaps the model's attention core and
positions (the built-in GPT's seams); the ring math (:mod:`.ring`, :mod:`.blocks`), the
partition (:mod:`.partition`), the plan of blocks for packed documents and sliding windows
(:mod:`.documents`) and the traffic formula (:mod:`.traffic`) are usable directly.
See docs/CONTEXT_PARALLEL.md. Imports core, comm and models (the GPT's seams); never the engine.
"""
from .blocks import attend_block, attend_block_backward, fused_available, merge
from .documents import GatheredDocuments, document_ids, gather_documents, rank_work
from .parallelize import (
           ContextParallelAttention,
           ZigzagPositions,
           apply_context_parallel,
)
from .partition import (
           chunk_ids,
           shard_batch,
           shard_sequence,
           unshard_sequence,
           zigzag_positions,
)
from .ring import CommRing, ring_attention
from .traffic import cp_bytes_per_layer, cp_document_bytes

__all__ = ["CommRing", "ContextParallelAttention", "GatheredDocuments", "ZigzagPositions",
           "apply_context_parallel", "attend_block", "attend_block_backward", "chunk_ids",
           "cp_bytes_per_layer", "cp_document_bytes",
           "document_ids", "fused_available", "gather_documents", "merge", "rank_work",
           "ring_attention", "shard_batch", "shard_sequence", "unshard_sequence",
           "zigzag_positions"]
