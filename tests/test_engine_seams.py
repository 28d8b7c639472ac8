"""The engine knows no strategy by name, and a step is a value.

- engine/'s code names no strategy: no ``strategy`` / ``fault_tolerant`` setting read, no
  strategy's name as a string, no strategy-only method of the gradient-sync seam called
  (DiLoCo's differences are the seam's hooks, :class:`~trainmesh.data_parallel.base.GradSync`);
- :meth:`Engine.apply` returns a frozen :class:`StepReport`; ``train_step`` still returns the
  float loss; ``engine.last`` is a read-only view of the last report, and an earlier report
  does not change when later steps run.
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import trainmesh
from trainmesh import Engine, ParallelConfig, ParallelMesh
from trainmesh.core.step import StepReport
from trainmesh.data.corpus import SyntheticCorpus
from trainmesh.data_parallel.base import GradSync
from trainmesh.models.gpt import GPT, GPTConfig

ENGINE = Path(trainmesh.__file__).parent / "engine"
STRATEGY_NAMES = {"mesh", "ps", "diloco", "fault_tolerant", "fault-tolerant"}
"""The --strategy values and fault tolerance, as a string in code."""
STRATEGY_SETTINGS = {"strategy", "fault_tolerant", "ps_mode", "ps_servers", "ps_staleness",
                     "inner_steps", "outer_lr", "outer_momentum", "replicas", "coordinator"}
"""Configuration fields only a strategy has: reading one is branching on the strategy."""
STRATEGY_ONLY = {"replica_slots", "n_replicas", "replica", "synced", "local_norm", "outer_axis",
                 "local_shards", "load_local_shards"}
"""Methods and attributes of one strategy's gradient sync, not of the seam."""
NAMES_IN_IDENTIFIERS = ("diloco", "fault_tolerant", "quorum", "parameter_server")


def _docstrings(tree: ast.AST) -> set[int]:
    """id()s of the docstring constants (prose may name a strategy as an example)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
        if isinstance(node, (ast.Module, ast.ClassDef)):   # attribute docstrings
            for a, b in zip(node.body, node.body[1:]):
                if isinstance(a, (ast.Assign, ast.AnnAssign)) and isinstance(b, ast.Expr) \
                        and isinstance(b.value, ast.Constant):
                    out.add(id(b.value))
    return out


def strategy_names_in(source: str) -> list[str]:
    """What in ``source`` names a strategy (module docstring): one line per finding."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if node.value.lower() in STRATEGY_NAMES:
                found.append(f"{where}: the string {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr in STRATEGY_SETTINGS | STRATEGY_ONLY:
            found.append(f"{where}: .{node.attr}")
        names = ([node.id] if isinstance(node, ast.Name) else [node.attr] if isinstance(node, ast.Attribute)
                 else [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [])
        found += [f"{where}: the name {n}" for n in names
                  if any(s in n.lower() for s in NAMES_IN_IDENTIFIERS)]
    return found


def test_the_engine_names_no_strategy():
    """Bug: the engine branching on a strategy again (``if self.config.strategy == "diloco"``)
    or calling a strategy-only method of its gradient sync by name."""
    files = sorted(ENGINE.glob("*.py"))
    assert ENGINE / "engine.py" in files
    found = {f.name: strategy_names_in(f.read_text()) for f in files}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_walker_sees_a_branch_on_a_strategy():
    planted = 'def f(self):\n    """diloco in prose is fine."""\n    if self.config.strategy == "diloco":\n        return self.grad_sync.replica_slots(1.0)\n'
    assert sorted(strategy_names_in(planted)) == ["line 3: .strategy", "line 3: the string 'diloco'",
                                                  "line 4: .replica_slots"]


def test_the_seam_defaults_are_the_mesh_strategys():
    """The hooks DiLoCo overrides: by default nothing rides along, every token of the global
    batch counts, the global norm is clipped by and reported."""
    cls = GradSync
    assert cls.extra_sums(None, 5.0) == []
    assert cls.token_total(None, 12.0, []) == 12.0
    assert cls.norm(None, lambda n, p: True, lambda: 2.5) == 2.5
    assert cls.step_metrics(None, 2.5) == {"grad_norm": 2.5}


CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def test_a_step_returns_a_frozen_report_and_last_is_a_view_of_it():
    """Bugs: the loop reading a mutable ``engine.last`` that the next step rewrites; a caller
    changing the engine's record of a step."""
    engine = Engine(GPT(CFG, seed=0), lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                    lambda m, b: m(**b), ParallelConfig(precision="fp16"),
                    mesh=ParallelMesh(local=True))
    engine.precision.scaler.scale = 2.0**8      # no scale search: the step is applied
    data = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    assert dict(engine.last) == {}
    first = engine.step(data.batch(0, 0, 4))
    assert isinstance(first, StepReport) and engine.report is first
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.loss = 0.0   # type: ignore[misc]
    row = dict(first.metrics())
    assert list(row) == ["loss", "grad_norm", "lr", "loss_scale", "skipped"], row
    assert row["grad_norm"] == first.grad_norm and first.grad_norm > 0
    assert dict(engine.last) == row
    with pytest.raises(TypeError):
        engine.last["grad_norm"] = 0.0   # type: ignore[index]
    loss = engine.train_step(data.batch(0, 1, 4))
    assert isinstance(loss, float) and loss == engine.last["loss"] == engine.report.loss
    assert dict(first.metrics()) == row and engine.report is not first


def test_a_strategys_gradient_sync_comes_from_its_declaration():
    """Bug: make_grad_sync choosing a strategy's wrapper by name instead of from the table
    (a strategy whose declaration loses its ``grad_sync`` would still be built, or not)."""
    from trainmesh.data_parallel import _wrapper
    from trainmesh.data_parallel.diloco import wrap
    from trainmesh.strategies.table import strategy_of
    diloco = ParallelConfig(dp=2, strategy="diloco")
    assert strategy_of(diloco).grad_sync == "trainmesh.data_parallel.diloco:wrap"
    assert _wrapper(diloco) is wrap
    assert _wrapper(ParallelConfig(dp=2)) is None and _wrapper(ParallelConfig(dp=2, fault_tolerant=True)) is None


def _resolved(strategy, field: str) -> object:
    try:
        return strategy.load(field)
    except (ImportError, AttributeError) as exc:
        return f"{getattr(strategy, field)}: {exc}"


def test_every_declared_plug_in_resolves():
    """Bug: a strategy's declaration naming a gradient-sync wrapper, step policy or launcher
    that was moved or renamed (found only when a run of that strategy starts)."""
    from trainmesh.strategies.table import STRATEGIES
    declared = {(s.name, field): _resolved(s, field) for s in STRATEGIES
                for field in ("grad_sync", "policy", "worker", "launcher") if getattr(s, field) is not None}
    assert ("diloco", "grad_sync") in declared
    assert {k: v for k, v in declared.items() if not callable(v)} == {}
