"""Hugging Face GPT-2 under tensor parallelism: a tiny random model, CPU, 2 processes.

    torchrun --nproc-per-node 2 examples/hf_gpt2_tp.py

Each rank holds half of every attention and MLP matrix: the fused ``c_attn`` (a ``Conv1D``,
[q | k | v]) is split per block so each rank keeps whole heads of q, k and v; the plan is found
from the model (``tm.hf_tp_plan(model)`` shows it). The same seed and batches give the loss of
one process (``--nproc-per-node 1``).
"""
import torch
import torch.distributed as dist
import transformers

import trainmesh as tm
from trainmesh.data.corpus import SyntheticCorpus


def main() -> None:
    tm.init_distributed()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=255, eos_token_id=255)   # inside the vocabulary
    model = transformers.GPT2LMHeadModel(config)
    if dist.get_rank() == 0:
        print("plan:", tm.hf_tp_plan(model))
    engine = tm.Engine(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                       loss_fn=tm.causal_lm_loss,
                       config=tm.ParallelConfig(tp=dist.get_world_size()))
    data = SyntheticCorpus(config.vocab_size, 32)
    for step in range(20):
        loss = engine.train_step(data.batch(0, step, 8))    # every TP rank passes the same batch
        if engine.mesh.rank == 0:
            print(f"step {step + 1}: loss {loss:.4f}")
    tm.shutdown()


if __name__ == "__main__":
    main()
