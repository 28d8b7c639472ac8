"""Hugging Face Llama under tensor parallelism, loaded from a model directory: CPU, 2 processes.

    torchrun --nproc-per-node 2 examples/hf_llama_tp.py [MODEL_DIR]

Without MODEL_DIR, rank 0 saves a tiny random Llama (grouped-query attention: 4 heads, 2
key/value heads) with ``save_pretrained`` to a temporary directory first. ``tm.from_pretrained``
builds the model on the meta device and each rank reads only its slices of
``model.safetensors``: half of q/k/v/o (whole heads, key/value heads split too) and of the MLP.
The same run from the command line: ``trainmesh train --model-dir DIR --tp 2``.
"""
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import transformers

import trainmesh as tm
from trainmesh.data.corpus import SyntheticCorpus


def tiny_llama_dir() -> str:
    """A small random Llama saved by rank 0; its path, on every rank."""
    path = [tempfile.mkdtemp(prefix="tiny-llama-")] if dist.get_rank() == 0 else [None]
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=32)
        transformers.LlamaForCausalLM(config).save_pretrained(path[0])
    dist.broadcast_object_list(path, src=0)
    return path[0]


def main() -> None:
    tm.init_distributed()
    given = len(sys.argv) > 1
    directory = sys.argv[1] if given else tiny_llama_dir()
    model = tm.from_pretrained(directory)                   # on meta, reads its slices later
    engine = tm.Engine(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                       loss_fn=tm.causal_lm_loss,
                       config=tm.ParallelConfig(tp=dist.get_world_size()))
    data = SyntheticCorpus(model.config.vocab_size, 32)
    for step in range(20):
        loss = engine.train_step(data.batch(0, step, 8))
        if engine.mesh.rank == 0:
            print(f"step {step + 1}: loss {loss:.4f}")
    if not given and dist.get_rank() == 0:
        shutil.rmtree(directory)                             # the weights are in memory now
    tm.shutdown()


if __name__ == "__main__":
    main()
