"""The planner: which parallel layout to use when, from a memory, traffic and time model.

* :mod:`.shapes`      the model as the planner sees it (dense or MoE); :mod:`.published` the
  published shapes, :mod:`.model_dir` a Hugging Face config.json's
* :mod:`.memory`      model states per GPU (ZeRO accounting)
* :mod:`.activations` what a layer keeps for backward, tensor by tensor, per kernel convention
* :mod:`.peak`        the peak of a rank: moments, buffers, the allocators' measured factors
* :mod:`.traffic`     bytes per step per mesh axis and op (payload and ring wire bytes)
* :mod:`.steptime`    FLOPs over throughput, exposed communication, pipeline bubble
* :mod:`.efficiency`  the efficiency assumed from published runs (:mod:`.references`);
  :mod:`.calibrate` implied efficiencies and a measured run's (``--calibrate``)
* :mod:`.space`       the layouts searched: axes, choices, refusals
* :mod:`.candidate`   one layout scored; :mod:`.advisor` enumerates, ranks, recommends;
  :mod:`.rules` says why
* :mod:`.predict`     what ``trainmesh train --metrics-out`` will measure for one layout, rank
  by rank; :mod:`.rank_bytes` what one rank holds, keeps and sends

``trainmesh plan`` (``trainmesh.cli.plan``) is the command line over these.
Imports core, config, models and observe; never torch.distributed.
"""
from .advisor import Plan, plan
from .candidate import Candidate, evaluate
from .cluster import Cluster
from .memory import MemoryBreakdown, ModelStates, model_states
from .shapes import ModelShape

__all__ = ["Candidate", "Cluster", "MemoryBreakdown", "ModelShape", "ModelStates", "Plan",
           "evaluate", "model_states", "plan"]
