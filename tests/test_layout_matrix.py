"""The whole mesh composes: a pairwise matrix generated from the table of rules (the axes' and
every strategy's, :mod:`trainmesh.strategies.table`), each layout run by `trainmesh train`
against one process with the same model flags (loss within LOSS_ABS, grad norm within
NORM_REL, 20 steps; tests/helpers.py ``assert_equivalent``). A DiLoCo row runs one inner step,
outer lr 1, no outer momentum, SGD without clipping: DP exactly, so one process (SGD, no clip)
is its reference, by loss (DiLoCo forms no global gradient norm).

The rows: :data:`PINNED` (the layouts refusals used to hide: MoE under cp, under sequence
parallelism and with ep over dp x cp; HSDP with tp, pp, cp and ep; offload with sequence
parallelism), then rows picked greedily (most new pairs per process) from every valid layout
of the table's :data:`~trainmesh.strategies.table.FEATURES` (at most :data:`MAX_WORLD` processes)
until every pair of features of two axes is in some row — a covering array. The 16-process
layout of ``test_the_whole_mesh_in_one_run`` (ZeRO-3 x tp + SP x pp x cp x ep) counts too.
``test_every_pair_is_run_or_refused`` holds the table to it: a feature added to FEATURES fails
it until each of its pairs is in a row or refused by a rule (its ``pairs``), and each of the
table's RULES is a refusal case here (exit 2 before any worker, one line naming its flag; a
rule on the model's facts with a model that has them). ``test_no_layout_refusal_outside_the_table``
walks the source for a ConfigError about the layout raised anywhere else.

Planted bugs this module catches (each seen failing with an assertion): the MoE slot counts not
summed over cp (moe-cp2: grad norm 4% off) nor over tp under sequence parallelism (moe-tp2-sp:
6% off); the replicated shard's all-reduce skipped under HSDP (dp4-shard2-zero3-tp2: grad norm
57% off); offload's host copies of the shards not taken again after sequence parallelism's tp
sum (dp2-zero1-offload-tp2-sp: 7% off).
"""
from __future__ import annotations

import contextlib
import io
import itertools
import types
from collections import Counter
from dataclasses import fields

import pytest
from helpers import SMALL, assert_equivalent, one_process, run_train, steps, summary
from tolerances import LOSS_ABS

from trainmesh.config.parallel import ParallelConfig
from trainmesh.config.train import FLAGS, TrainConfig, build_train_config
from trainmesh.core import axes
from trainmesh.core.axes import Facts
from trainmesh.core.errors import ConfigError
from trainmesh.strategies import table

MAX_WORLD = 8
MOE = ["--experts", "4", "--moe-aux-loss", "0.1"]
"""The MoE rows' model: every block's MLP a mixture of 4 experts (top 2), a load-balancing
coefficient large enough that its gradient shows in the norm."""
STEPS = 20
MUON = ["muon", "--lr", "0.002"]
"""The dense rows' optimizer (DiLoCo's: DILOCO_SGD; the MoE rows': AdamW): Muon, whose step
covers AdamW's too (embeddings, norms, biases) and whose Newton-Schulz iteration needs each
matrix whole, so these layouts are layouts of whole-matrix updates too (ZeRO owners, tp
gathers); its one-process reference equals torch.optim.Muon + AdamW (tests/test_muon.py). The
iteration runs in bf16, so the reduction-order rounding of a layout (1e-7) moves an element of
an update by a bf16 step (2^-8) where its rounding flips: at lr 0.002 the grad norm stays within
5e-5 of one process over 20 steps (at Muon's default 0.01 it reached 7e-4, too near 1e-3). A
top-2 MoE model amplifies the same steps into a token's other expert choice (grad norm 1e-3 to
2e-3 off at one step of twenty), so the MoE rows keep AdamW and the whole mesh routes every
token to all 4 experts (MOE_ALL), its routing weights continuous."""
MOE_ALL = [*MOE, "--top-k", "4"]
DILOCO_SGD = ["sgd", "--grad-clip", "0", "--lr", "0.1"]
"""DiLoCo rows' optimizer (and their reference's): SGD without clipping, which DiLoCo with one
inner step, outer lr 1 and no outer momentum follows exactly as DP. Not SGD's default lr 0.3:
there the MoE model's routing piles onto few experts, and an expert no token of one replica
chose sits that replica's inner step out (no weight decay there) where DP, which sees it used,
decays it everywhere, so DiLoCo leaves DP (loss 8e-6 off at step 6, 1e-2 later;
within 5e-7 with weight decay 0); at lr 0.1 the DiLoCo rows stay within 1e-6 of one process for
their 20 steps."""
FLAG_OF = {f.field: name for name, f in FLAGS.items()}
SHAPE = {"layers": 2, "d_model": 32, "heads": 4, "seq_len": 16, "vocab_size": 64,
         "global_batch": 8, "steps": STEPS, "warmup_steps": 5}

PINNED: dict[str, dict] = {
    "moe-cp2": {"experts": 4, "cp": 2},
    "moe-tp2-sp": {"experts": 4, "tp": 2, "sequence_parallel": True},
    "moe-dp2-cp2-ep2": {"experts": 4, "dp": 2, "cp": 2, "ep": 2},
    "moe-dp4-shard2-zero3-ep2": {"experts": 4, "dp": 4, "dp_shard": 2, "zero": 3, "ep": 2},
    "dp4-shard2-zero3-tp2": {"dp": 4, "dp_shard": 2, "zero": 3, "tp": 2},
    "dp4-shard2-zero2-pp2": {"dp": 4, "dp_shard": 2, "zero": 2, "pp": 2, "microbatches": 2},
    "dp4-shard2-zero3-cp2": {"dp": 4, "dp_shard": 2, "zero": 3, "cp": 2},
    "dp2-zero1-offload-tp2-sp": {"dp": 2, "zero": 1, "offload": "cpu", "tp": 2,
                                 "sequence_parallel": True},
}
WHOLE_MESH = {"experts": 4, "dp": 2, "zero": 3, "tp": 2, "sequence_parallel": True, "pp": 2,
              "microbatches": 2, "cp": 2, "ep": 2}
"""ZeRO-3 x tp + SP x pp x cp x ep: 16 processes."""


LAUNCH_WEIGHT = 6
"""The greedy cover's cost of a launch beside its processes' (each process steps 20 times, a
launch adds its launcher and start-up): cheap rows, but not many rows of one pair each."""

DEFAULTS = {**{f.name: f.default for f in fields(ParallelConfig)}, "experts": 0}
FACTS = set(Facts.__dataclass_fields__)
RUN_DEFAULTS = {f.name: f.default for f in fields(TrainConfig) if f.name != "parallel"}
"""A run's own settings (TrainConfig's, the rules' ``f.run``) at their defaults."""


def _facts(settings: dict) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{**DEFAULTS, **settings})


def features_of(settings: dict) -> frozenset[str]:
    facts = _facts(settings)
    return frozenset(f.name for f in table.FEATURES if f.on(facts))


def world_of(settings: dict) -> int:
    f = _facts(settings)
    return f.dp * f.tp * f.pp * f.cp + (f.ps_servers if f.strategy == "ps" else 0)


def valid(settings: dict) -> bool:
    """Whether `trainmesh train` accepts the layout on the matrix's model."""
    try:
        build_train_config({**SHAPE, **settings})
    except ConfigError:
        return False
    return True



def pairs_of(names: frozenset[str]) -> set[tuple[str, str]]:
    axis = {f.name: f.axis for f in table.FEATURES}
    return {(a, b) for a, b in itertools.combinations(sorted(names), 2) if axis[a] != axis[b]}


def every_pair() -> set[tuple[str, str]]:
    return pairs_of(frozenset(f.name for f in table.FEATURES))


def refused_pairs() -> set[tuple[str, str]]:
    return {tuple(sorted(p)) for r in table.RULES for p in r.pairs}


def candidates() -> list[dict]:
    """Every layout of one choice per axis (its default or one of its features) on at most
    MAX_WORLD processes, ZeRO only where dp x cp has ranks to shard over, in a fixed order (not
    yet checked against the rules)."""
    by_axis: dict[str, list[dict]] = {}
    for f in table.FEATURES:
        by_axis.setdefault(f.axis, [{}]).append(f.settings)
    out = []
    for choice in itertools.product(*by_axis.values()):
        settings: dict = {}
        for part in choice:
            settings.update({k: max(v, settings.get(k, v)) if k == "dp" else v
                             for k, v in part.items()})
        facts = _facts(settings)
        if facts.zero and facts.dp * facts.cp == 1:
            continue                     # ZeRO with no group to shard over: pairs in name only
        if world_of(settings) <= MAX_WORLD:
            out.append(settings)
    return out


def generated_rows() -> dict[str, dict]:
    """:data:`PINNED`, then greedy rows until every pair no rule refuses is covered: each the
    valid layout with the most uncovered pairs per process (a launch weighing as
    :data:`LAUNCH_WEIGHT` processes), then the fewest processes."""
    rows = dict(PINNED)
    covered = set().union(*(pairs_of(features_of(s)) for s in [*rows.values(), WHOLE_MESH]))
    todo = every_pair() - refused_pairs() - covered
    pool = [(s, pairs_of(features_of(s))) for s in candidates()]
    invalid: set[int] = set()
    while todo:
        ranked = sorted(range(len(pool)), key=lambda i: (
            -len(pool[i][1] & todo) / (world_of(pool[i][0]) + LAUNCH_WEIGHT), world_of(pool[i][0]), i))
        best = next((i for i in ranked if pool[i][1] & todo and i not in invalid
                     and (valid(pool[i][0]) or invalid.add(i))), None)
        if best is None:
            break                        # what is left cannot be run here: the coverage test says
        settings, pairs = pool[best]
        rows["gen-" + "-".join(sorted(features_of(settings)))] = settings
        todo -= pairs
    return rows


ROWS = generated_rows()


def flags_of(settings: dict) -> list[str]:
    out = []
    for key, value in settings.items():
        flag = FLAG_OF[key]
        out += [flag] if value is True else [flag, str(value)]
    return out


# ---------------------------------------------------------------- the table's own checks
def test_every_pair_is_run_or_refused():
    covered = set().union(*(pairs_of(features_of(s)) for s in [*ROWS.values(), WHOLE_MESH]))
    missing = every_pair() - covered - refused_pairs()
    assert not missing, f"pairs of features neither run by the matrix nor refused: {sorted(missing)}"
    for name, settings in ROWS.items():
        assert valid(settings), name
        assert world_of(settings) <= MAX_WORLD, name
    for strategy in table.STRATEGIES:     # every strategy is a row of the matrix
        assert strategy.features, strategy.name
    assert len(ROWS) <= 21, sorted(ROWS)        # few launches: the suite's time


HUB = ["--seq-len", "16", "--vocab-size", "64", "--global-batch", "8", "--steps", "2"]
"""A --model-dir run's flags (the model sets layers, width and heads)."""


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory) -> str:
    """A tiny Llama with tied embeddings (its head's weight is the input embedding's)."""
    transformers = pytest.importorskip("transformers")
    import torch
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tied") / "llama"
    with contextlib.redirect_stderr(io.StringIO()):       # its progress bar
        transformers.LlamaForCausalLM(config).save_pretrained(str(path))
    return str(path)


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
"""A worker of a 2-process torchrun job (its environment)."""


def _argv(rule, tmp_path, request, monkeypatch) -> list[str] | None:
    """``trainmesh`` arguments that break ``rule``: its example's fields as flags, its facts as
    a model, run or launcher that has them (None: no model the suite builds has the fact)."""
    fields = {k: v for k, v in rule.example.items() if k not in FACTS or k in ("experts", "layers")}
    facts = {k: v for k, v in rule.example.items() if k in FACTS and k not in ("experts", "layers")}
    if "ties_on_one_rank" in facts:
        return None                  # no hub family the suite builds shares a block: in process
    if facts.get("launcher") == "sbatch":
        return ["launch", "slurm", "--nodes", str(fields["dp"]), "--", *SMALL, *flags_of(fields)]
    for name, value in (TORCHRUN if facts.get("launcher") == "torchrun" else {}).items():
        monkeypatch.setenv(name, value)
    base = SMALL
    if facts.get("ties") or facts.get("hub"):
        base = [*HUB, "--model-dir", request.getfixturevalue("tied_llama")]
    if facts.get("saves"):
        fields["save_dir"] = str(tmp_path / "ck")
    if "offload_dir" in fields:
        fields["offload_dir"] = str(tmp_path / fields["offload_dir"])
    return ["train", *base, *flags_of(fields)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rule", table.RULES, ids=[f"{r.flag}-{i}" for i, r in enumerate(table.RULES)])
def test_each_rule_exits_2_before_any_worker(rule, no_launch, refused, tmp_path, request,
                                             monkeypatch):
    """Every row of the table, the strategies' and the model's included: ``trainmesh train``
    exits 2 with its line before any worker starts (a fact no model here has: the table's
    refusal in process)."""
    run = types.SimpleNamespace(**{**RUN_DEFAULTS, **{k: v for k, v in rule.example.items()
                                                      if k in RUN_DEFAULTS}})
    facts = Facts(**{k: v for k, v in rule.example.items() if k in FACTS}, run=run)
    layout = _facts(rule.example)
    want = rule.message(layout, facts)
    argv = _argv(rule, tmp_path, request, monkeypatch)
    if argv is None:
        cfg = ParallelConfig(**{k: v for k, v in rule.example.items() if k not in FACTS})
        found = table.refusal(cfg, facts)
        assert found is not None and (found.flag, found.message) == (rule.flag, want), found
        return
    line = refused(argv, rule.flag)
    assert no_launch == []
    assert want[:40] in line, (want, line)


def test_a_weight_shared_by_stages_of_one_rank_is_the_tables_refusal():
    """The fact the pipeline runtime reads (a model given to the Python API): two stages one
    rank holds share a weight (interleaved: stage s on rank s mod pp), refused by the table."""
    from torch import nn

    from trainmesh.pipeline_parallel.partition import partition, shared_stages, ties_on_one_rank
    shared = nn.Linear(4, 4)
    layers = [(str(i), m) for i, m in enumerate([shared, nn.Linear(4, 4), shared, nn.Linear(4, 4)])]
    stages = partition(layers, 4, [1, 2, 3])           # pp 2 x 2 chunks: layers 0 and 2 on rank 0
    assert ties_on_one_rank(shared_stages(stages), 2)
    assert not ties_on_one_rank(shared_stages(partition(layers, 2, [2])), 2)   # stage 0, 1
    with pytest.raises(ConfigError) as err:
        table.check_facts(types.SimpleNamespace(pp=2), Facts(ties_on_one_rank=True))
    assert err.value.field == "--pp" and "different ranks" in err.value.message
    table.check_facts(types.SimpleNamespace(pp=2), Facts(ties_on_one_rank=False))


ALLOWED = {
    "strategies/table.py": "the table's check",
    "core/axes.py": "check_degrees: every degree a positive integer, the factored ones dividing",
    "config/validation.py": "each field's own type and range",
    "config/parallel.py": "check_pipeline: a schedule's own rules, shared with `trainmesh "
                          "schedule`, which builds schedules without a config",
    "config/model_dir.py": "a --model-dir model's config.json against the degrees (its experts "
                           "and heads): the model's shape, as the built-in GPT's in models/gpt.py",
    "cli/train.py": "the launch environment: a torchrun/srun world size the flags do not fill",
    "cli/launch.py": "the launch environment: a TP group within srun's tasks per node",
    "engine/pretrained.py": "what a hub model's declared plans allow (the model built on meta)",
    "tensor_parallel/hf_experts.py": "what a hub model's declared plans allow",
    "tensor_parallel/hf_check.py": "an inferred or file tp plan checked on the model's first "
                                   "layer at start: the model's arithmetic, not the layout's",
    "context_parallel/hf_attention.py": "what a hub model's attention allows",
    "context_parallel/parallelize.py": "a model given to the Python API without attention to split",
    "expert_parallel/hf.py": "what a hub model's declared expert plan allows",
    "engine/compile.py": "this machine: a compiler for --compile, a model it can compile",
    "data_parallel/nvme.py": "this machine: disk space for --offload nvme",
    "cli/plan.py": "the advisor's own --precision value (it searches layouts, it is given none)",
    "data_parallel/diloco.py": "a DiLoCo checkpoint's strategy and replica count against the "
                               "layout resuming it, read when it loads",
}
"""Where a ConfigError about the layout may be raised outside the table, and why."""


def _layout_errors() -> list[tuple[str, int, str]]:
    """Every ``ConfigError(FLAG, ...)`` in src/trainmesh whose FLAG is a ParallelConfig field's
    flag (a literal, or an f-string or choice of literals starting with one):
    (path under src/trainmesh, line, flag)."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "src" / "trainmesh"
    layout = {name for name, f in FLAGS.items() if f.field in ParallelConfig.field_names()}
    prefixes = {name[2:] for name in layout}

    def flags(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value] if node.value in layout else []
        if isinstance(node, ast.IfExp):
            return flags(node.body) + flags(node.orelse)
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            head = node.values[0].value
            return [head] if head == "--" or head[2:].split("-")[0] in prefixes else []
        return []

    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and node.args
                    and getattr(node.func, "id", getattr(node.func, "attr", None)) == "ConfigError"):
                out += [(str(path.relative_to(root)), node.lineno, f) for f in flags(node.args[0])]
    return out


def test_no_layout_refusal_outside_the_table():
    """A ConfigError naming a layout flag (a ParallelConfig field's: --dp, --zero, --strategy,
    --allreduce, --fault-tolerant, ...) is raised by the table's check only, or where
    :data:`ALLOWED` says why not."""
    found = _layout_errors()
    assert any(p == "core/axes.py" for p, _, _ in found)          # the walk sees flags
    outside = [f"{p}:{line} {flag}" for p, line, flag in found if p not in ALLOWED]
    assert not outside, f"layout refusals outside the table: {outside}"


def test_each_strategy_names_what_exists():
    """A strategy's gradient-sync wrapper, step policy and launcher hooks are dotted paths
    (imported only when a run needs them): each names an object that exists."""
    for strategy in table.STRATEGIES:
        for what in ("grad_sync", "policy", "worker", "launcher"):
            if getattr(strategy, what) is not None:
                try:
                    found = strategy.load(what)
                except (ImportError, AttributeError) as exc:
                    found = exc
                assert callable(found), (strategy.name, what, getattr(strategy, what), found)


def test_the_layouts_page_lists_every_rule():
    """docs/LAYOUTS.md's table of rules and the code's are the same rows: (owner, flag) for the
    axes' rules and each strategy's (a rule removed from the code, or added to it, fails here)."""
    from pathlib import Path
    page = (Path(__file__).resolve().parents[1] / "docs" / "LAYOUTS.md").read_text()
    owners = ("axes", *(s.name for s in table.STRATEGIES))
    listed = sorted((cells[1], cells[2].strip("`")) for line in page.splitlines()
                    if (cells := [c.strip() for c in line.split("|")])[1:2] and cells[1] in owners)
    code = sorted([*(("axes", r.flag) for r in axes.RULES),
                   *((s.name, r.flag) for s in table.STRATEGIES for r in s.rules)])
    page_rows, code_rows = Counter(listed), Counter(code)
    assert listed == code, (f"in the code, not on the page: {sorted((code_rows - page_rows).elements())}; "
                            f"on the page, not in the code: {sorted((page_rows - code_rows).elements())}")
    assert len(code) == len(table.RULES)


def test_the_planner_reads_the_group_sizes():
    """The table's per-kind group sizes (what a planner divides states and traffic by)."""
    hsdp = axes.group_sizes(ParallelConfig(dp=4, dp_shard=2, zero=3, cp=2, ep=2))
    assert hsdp == {"dense": (4, 2), "expert": (4, 1)}
    assert axes.group_sizes(ParallelConfig(dp=2, cp=2)) == {"dense": (4, 1), "expert": (4, 1)}
    assert axes.sequence_groups(ParallelConfig(tp=2, cp=2, sequence_parallel=True), True) == ("cp", "tp")
    assert axes.refusal(ParallelConfig(dp=2, ep=2), experts=0).flag == "--ep"
    assert axes.refusal(ParallelConfig(dp=2, ep=2), experts=4) is None
    assert table.refusal(ParallelConfig(dp=2, ep=2), Facts(experts=0)).flag == "--ep"


def test_mesh_groups_follow_the_views():
    """The views number the ranks alike: every group is a line of its view, HSDP's shard group
    under cp spans cp and dp_shard, and experts' groups cut the dp x cp line."""
    d = axes.Layout(dp=4, tp=2, cp=2, ep=2, dp_shard=2)
    assert d.members("dp_shard_cp")[0] == [0, 2, 4, 6]
    assert d.members("dp_replicate")[0] == [0, 8]
    assert d.members("ep")[0] == [0, 2] and d.members("edp")[0] == [0, 4, 8, 12]
    for name in axes.GROUPS:
        groups = d.members(name)
        assert sorted(r for g in groups for r in g) == list(range(d.world)), name


# ---------------------------------------------------------------- the runs
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(ROWS))
def test_layout_matches_one_process(name, reference_run, tmp_path):
    settings = ROWS[name]
    moe = MOE if settings.get("experts", 0) > 0 else []
    diloco = settings.get("strategy") == "diloco"
    optimizer = ["--optimizer", *(DILOCO_SGD if diloco else ["adamw"] if moe else MUON)]
    ref = reference_run([*one_process(optimizer[1]), *optimizer[2:], *moe])
    row = {k: v for k, v in settings.items() if k != "experts"}
    proc, run = run_train([*SMALL, *optimizer, *moe, *flags_of(row)], tmp_path, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if not diloco:
        assert_equivalent(ref, run)
        return
    a, b = steps(ref), steps(run)      # DiLoCo as DP: the same losses (no global grad norm)
    assert len(a) == len(b) == STEPS and all(r.get("outer") for r in b), (len(a), len(b))
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= LOSS_ABS, f"step {x['step']}: loss {x['loss']} vs {y['loss']}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_whole_mesh_in_one_run(reference_run, tmp_path):
    """MoE at dp 2 x ZeRO-3 x tp 2 + SP x pp 2 x cp 2 x ep 2: 16 processes, as one process,
    with Muon (MUON)."""
    ref = reference_run([*one_process(MUON[0]), *MUON[1:], *MOE_ALL])
    row = {k: v for k, v in WHOLE_MESH.items() if k != "experts"}
    proc, run = run_train([*SMALL, "--optimizer", *MUON, *MOE_ALL, *flags_of(row)], tmp_path,
                          timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_equivalent(ref, run)
    assert len(summary(run)["ranks"]) == 16
