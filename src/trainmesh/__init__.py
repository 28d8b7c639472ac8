"""trainmesh: every classic parallelism on one device mesh, each identical to one process.

Public face::

    import trainmesh as tm
    tm.init_distributed()
    engine = tm.Engine(model, optimizer=..., loss_fn=..., config=tm.ParallelConfig(dp=2))
    loss = engine.train_step(batch)
"""
from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.distributed import init_distributed, shutdown
from trainmesh.core.errors import CommTimeout, ConfigError
from trainmesh.core.mesh import ParallelMesh
from trainmesh.engine.engine import Engine
from trainmesh.engine.pretrained import causal_lm_loss, from_pretrained

from .comm import Comm, Ledger
from .data_parallel.whole_params import whole_params
from .parameter_server import PSEngine
from .tensor_parallel.hf import hf_tp_plan

__version__ = "0.1.0"
__all__ = ["Comm", "CommTimeout", "ConfigError", "Engine", "Ledger", "ParallelConfig",
           "PSEngine", "ParallelMesh", "causal_lm_loss", "from_pretrained", "hf_tp_plan",
           "init_distributed", "shutdown", "whole_params"]
