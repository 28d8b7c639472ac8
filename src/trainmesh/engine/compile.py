"""``--compile``: ``torch.compile`` applied to each layer, never to the whole model.

Following torchtitan, each transformer block (each pipeline layer) is compiled on its own, in
place: the layer's ``forward`` becomes its compiled version, while the module itself, its
parameter names and its hooks stay what they were. So everything trainmesh hangs on modules
keeps running eagerly around the compiled code (docs/COMPILE.md):

* ZeRO-3's forward pre-hook (all-gather) and post-hook (free) run around a unit's compiled
  forward: compute inside the graph, collectives outside;
* the data-parallel strategies' post-accumulate-grad hooks fire per parameter, after the
  compiled backward returns each gradient to autograd's ``AccumulateGrad`` node;
* tensor-parallel and expert-parallel collectives (:mod:`trainmesh.tensor_parallel.mappings`)
  go through the Comm (ledger, timeouts), which stays out of the graphs: when compiling, the
  Comm's collectives are disabled for dynamo (:func:`keep_collectives_eager`), so each is one
  graph break at its call. Traced into, the Comm's bookkeeping made dynamo specialise on each
  collective's name: a recompile per kind of collective, and its resumption frames compiled
  each time (a tp 2 + SP GPT: 8 recompiles and 70 graph breaks per rank). They are not marked
  with ``torch.compiler.disable`` in the Comm itself, which would import dynamo into every
  worker, compiled or not (~74 MiB of RSS);
* a module whose forward loops over collectives (context parallelism's ring attention: its
  autograd Function sends and receives K/V blocks rank to rank) declares
  ``runs_collectives = True`` and is disabled for dynamo here, when compiling: one graph break at
  it, the block's graphs compiled once, instead of dynamo tracing into the ring and recompiling
  it at every hop;
* activation recomputation wraps ``forward`` before it is compiled (torchtitan's order: AC,
  then compile), so the checkpoint is traced into the block's graph.

:func:`check_compile` refuses, cheaply and before any worker starts, a machine where
``torch.compile``'s default backend cannot build kernels.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys

import torch
from torch import nn

from trainmesh.comm import Comm
from trainmesh.comm.ops import COLLECTIVES
from trainmesh.core.distributed import worker_threads
from trainmesh.core.errors import ConfigError
from trainmesh.engine.recompute import LAYER_LIST_NAMES


def inductor_cxx() -> str:
    """The C++ compiler inductor's CPU backend runs: ``$CXX``, else ``g++`` (``clang++`` on
    macOS), as ``torch._inductor.config.cpp.cxx`` defaults."""
    return os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")


def check_compile(device_type: str, backend: str = "inductor") -> None:
    """ConfigError naming ``--compile`` when inductor cannot generate code for ``device_type``:
    on CPU it needs a C++ compiler, on CUDA the ``triton`` package (the other backends generate
    none)."""
    if backend != "inductor":
        return
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise ConfigError("--compile", "needs the triton package on CUDA (inductor generates "
                              "triton kernels); install triton or leave --compile off")
        return
    cxx = inductor_cxx()
    why = _compiler_fault(cxx)
    if why:
        raise ConfigError("--compile", f"needs a working C++ compiler on CPU: {cxx} {why} (set "
                          "CXX or install one) or leave --compile off")


@functools.cache
def _compiler_fault(cxx: str) -> str:
    """'' when ``cxx`` exists and preprocesses an empty C++ file, else what went wrong: a
    driver found on PATH whose compiler proper is missing (``g++`` without ``cc1plus``) fails
    here, not inside a worker."""
    if shutil.which(cxx) is None:
        return "is not on PATH"
    try:
        done = subprocess.run([cxx, "-x", "c++", "-E", "-"], input=b"", capture_output=True,
                              timeout=60)
    except subprocess.TimeoutExpired:
        return "did not answer within 60 s"
    except OSError as exc:
        return f"cannot run ({exc.strerror})"
    if done.returncode == 0:
        return ""
    said = done.stderr.decode(errors="replace").strip().splitlines()
    # the line naming the cause, not gcc's closing "compilation terminated."
    why = next((line for line in reversed(said) if "error" in line), said[-1] if said else "")
    return f"cannot compile ({why or f'exit {done.returncode}'})"


def compile_layers(model: nn.Module, device_type: str, comm: Comm | None = None, *,
                   backend: str = "inductor") -> list[nn.Module]:
    """Compile each layer of ``model`` (on ``device_type``, with torch.compile's ``backend``) in
    place; returns the layers.
    Modules that exchange data with other ranks inside their ``forward`` and say so
    (``runs_collectives = True``: context parallelism's attention) run eagerly between the
    layer's graphs (``torch.compiler.disable``, applied only here, when compiling), and so do
    the collectives of ``comm``, the layers' communication layer."""
    check_compile(device_type, backend)
    if backend == "inductor":
        share_compile_threads()
    if comm is not None:
        keep_collectives_eager(comm)
    layers = find_layers(model)
    for module in model.modules():
        if getattr(module, "runs_collectives", False):
            module.forward = torch.compiler.disable(module.forward, recursive=True)
    for layer in layers:
        # An instance attribute shadows the class's forward; nn.Module.__call__ still runs the
        # module's hooks (ZeRO-3's gather and free) eagerly around it.
        layer.forward = torch.compile(layer.forward, backend=backend)
    return layers


def share_compile_threads() -> None:
    """Inductor compiles with this rank's share of the host's CPUs, its intra-op threads
    (:func:`~trainmesh.core.distributed.worker_threads`), within inductor's own bound, unless
    ``TORCHINDUCTOR_COMPILE_THREADS`` says otherwise. Its default, one compile process per CPU
    of the host (up to 32), is right for one process; with N ranks on a host it starts N pools
    of that size, and at one thread per rank none at all (a rank compiles in its own process)."""
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        from torch._inductor import config
        config.compile_threads = min(config.decide_compile_threads(), worker_threads())


def keep_collectives_eager(comm: Comm) -> None:
    """Each collective of ``comm`` disabled for dynamo, on this instance (as a compiled layer's
    ``forward`` shadows its class's): one graph break at each call from a compiled layer."""
    for name in COLLECTIVES:
        setattr(comm, name, torch.compiler.disable(getattr(comm, name), recursive=True))


def find_layers(model: nn.Module) -> list[nn.Module]:
    """The layers compiled one by one: ``model.pipeline_layers()`` (the built-in GPT: embedding,
    blocks, head), the children of an ``nn.Sequential``, or a ModuleList attribute named
    ``blocks``/``layers``/``h``."""
    if callable(getattr(model, "pipeline_layers", None)):
        return list(model.pipeline_layers())
    if isinstance(model, nn.Sequential):
        return list(model)
    for m in model.modules():
        for attr in LAYER_LIST_NAMES:
            layers = getattr(m, attr, None)
            if isinstance(layers, (nn.ModuleList, nn.Sequential)) and len(layers) > 0:
                return list(layers)
    raise ConfigError("--compile", f"compiles the model layer by layer: needs pipeline_layers(), "
                      f"an nn.Sequential, or a ModuleList attribute named "
                      f"{'/'.join(LAYER_LIST_NAMES)}; none found in {type(model).__name__}")
