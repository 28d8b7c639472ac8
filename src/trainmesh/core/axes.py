"""The axes of the mesh in one table: what each kind of parameter reduces and shards over, and
the combinations that mean nothing. The dimensions, the views that number the ranks and the
named groups are :mod:`trainmesh.core.layout`'s (:data:`DIMS`, :data:`VIEWS`, :data:`GROUPS`,
re-exported here); a layout's degrees are one :class:`~trainmesh.core.layout.Layout`.

**Kinds** (:data:`KINDS`): what each kind of parameter is reduced over. A ``dense`` parameter
(replicated over the data ranks) is reduced and ZeRO-sharded over ``dp × cp`` — under HSDP over
``dp_shard × cp``, each reduced shard then all-reduced across ``dp_replicate``; an ``expert``
(held by the ranks of one ``ep`` index) over ``edp``. Placement flags add to a kind
(:data:`LATER`): a ``partial_grad`` (sequence parallelism) is then summed over ``tp``; a
``duplicate`` (a pipeline tie's second copy) is left out of the norm. The gradient strategies,
the initial broadcast, the checkpoint writer and the norm read these rows.

**Rules** (:data:`RULES`): combinations that mean nothing, each with its reason, the flag its
refusal names, the facts of the model or run it reads (:class:`Facts`) and an example that
breaks it. With every strategy's rules (:mod:`trainmesh.strategies.table`, the one table)
``ParallelConfig`` and ``TrainConfig`` check them (exit 2 before any worker starts), the test
suite turns each into a refusal case, and a generated pairwise matrix covers every pair of
features no rule refuses.

Public API (for the planner, the config and the tests):

* :data:`DIMS` — ``Dim(name, flag, help, value, choices, divides)``: ``choices(n)`` the degrees
  to try where ``n`` is the size it divides (``divides``);
* :data:`FEATURES` — the non-default choices of the axes the matrix pairs;
* :func:`check_degrees` ``(layout) -> Layout`` — every degree a positive integer, ep | dp·cp,
  dp_shard | dp;
* :func:`refusal` ``(cfg, experts=None, *, facts=None, rules=RULES) -> Refusal | None`` — the
  first rule ``cfg`` breaks (a fact None: the rules that read it skipped);
* :func:`kind_groups` ``(layout, kind) -> KindGroups`` — (reduce, replicate, holders) groups;
* :func:`group_sizes` ``(layout) -> {kind: (reduce size, replicate size)}``;
* :func:`sequence_groups` ``(layout, sequence_parallel)`` — the groups a sequence is split over.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from trainmesh.core.errors import ConfigError
from trainmesh.core.layout import DIM, DIMS, GROUPS, VIEWS, Dim, Group, Layout  # noqa: F401

# ---------------------------------------------------------------- degrees


def check_degrees(layout: Any) -> Layout:
    """Every degree a positive integer and the factored ones dividing what they factor
    (ConfigError naming the flag); returns the :class:`Layout`."""
    for name in ("dp", "pp", "tp", "cp", "ep"):
        value = getattr(layout, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"--{name}", f"must be a positive integer; got {value!r}")
    d = Layout.of(layout)
    if (d.dp * d.cp) % d.ep:
        raise ConfigError("--ep", f"must divide dp x cp = {d.dp} x {d.cp} = {d.dp * d.cp} "
                          f"(experts spread over ranks of the DP x CP group); got {d.ep}")
    shard = d.dp_shard
    if not isinstance(shard, int) or shard < 1 or d.dp % shard:
        raise ConfigError("--dp-shard", f"must divide --dp {d.dp} (shard groups of dp-shard "
                          f"ranks, replicated across dp/dp-shard); got {shard!r}")
    return d


# ---------------------------------------------------------------- kinds of parameters


@dataclass(frozen=True)
class KindGroups:
    """Where a kind of parameter's gradient goes on one layout."""

    reduce: Group
    """The group its gradient is reduced over (and ZeRO shards its states over)."""
    replicate: Group | None
    """HSDP: each reduced shard is then all-reduced across this group (None: no replicas)."""
    holders: Group
    """The ranks holding the same values of it (the initial broadcast's group; a checkpoint
    writes it from one of them, with the tp ranks)."""


@dataclass(frozen=True)
class Kind:
    name: str
    what: str
    groups: Callable[[Layout], KindGroups]


def _dense(d: Layout) -> KindGroups:
    holders = Group.dp_cp if d.cp > 1 else Group.dp
    if d.hsdp:
        return KindGroups(Group.dp_shard_cp if d.cp > 1 else Group.dp_shard, Group.dp_replicate,
                          holders)
    return KindGroups(holders, None, holders)


KINDS: dict[str, Kind] = {
    "dense": Kind("dense", "replicated over the data ranks: every dp x cp rank sees other tokens",
                  _dense),
    "expert": Kind("expert", "an expert under expert parallelism: held by one ep index, it saw "
                             "its ep group's tokens through the all-to-all",
                   lambda d: KindGroups(Group.edp, None, Group.edp)),
}


@dataclass(frozen=True)
class Later:
    """A placement flag's addition to its kind: a later sum, and whether the norm counts it."""

    flag: str
    then: str | None
    counted: bool
    what: str


LATER: dict[str, Later] = {
    "partial_grad": Later("partial_grad", "tp", True, "sequence parallelism: each tp rank's "
                          "gradient covers its sequence chunk; summed over tp after the reduction"),
    "duplicate": Later("duplicate", None, False, "a pipeline tie's copy: summed over its tie "
                       "group by the pipeline, counted in the norm by the lowest stage only"),
}


def sequence_groups(layout: Any, sequence_parallel: bool) -> tuple[Group, ...]:
    """The groups each sequence is split over: cp (2 of its 2·cp chunks per rank), and tp under
    sequence parallelism (between the tensor-parallel regions). Per-sequence statistics (MoE
    load balancing) are summed over them."""
    d = Layout.of(layout)
    return (*((Group.cp,) if d.cp > 1 else ()),
            *((Group.tp,) if sequence_parallel and d.tp > 1 else ()))


def kind_groups(layout: Any, kind: str) -> KindGroups:
    """Reduce, replicate and holder groups of parameters of ``kind`` ("dense" or "expert")."""
    return KINDS[kind].groups(Layout.of(layout))


def group_sizes(layout: Any) -> dict[str, tuple[int, int]]:
    """{kind: (ranks its gradient is reduced and sharded over, replicas of each shard)}."""
    d = Layout.of(layout)
    out = {}
    for name in KINDS:
        g = kind_groups(d, name)
        out[name] = (d.size(g.reduce), d.size(g.replicate) if g.replicate else 1)
    return out


# ---------------------------------------------------------------- features and rules


@dataclass(frozen=True)
class Feature:
    """A non-default choice of one axis: ``settings`` (config fields; ``experts`` is the
    model's) turn it on from the one-process layout, ``on(cfg)`` says whether a layout has it
    (``cfg``: the fields of a ParallelConfig and ``experts``). Features of one axis exclude
    each other."""

    name: str
    axis: str
    settings: dict[str, Any]
    on: Callable[[Any], bool]


FEATURES: tuple[Feature, ...] = (
    Feature("dp", "dp", {"dp": 2}, lambda c: c.dp > 1),
    Feature("zero1", "zero", {"zero": 1}, lambda c: c.zero == 1),
    Feature("zero2", "zero", {"zero": 2}, lambda c: c.zero == 2),
    Feature("zero3", "zero", {"zero": 3}, lambda c: c.zero == 3),
    Feature("hsdp", "dp_shard", {"dp": 4, "dp_shard": 2},
            lambda c: c.dp_shard is not None and c.dp_shard < c.dp),
    Feature("offload", "offload", {"offload": "cpu"}, lambda c: c.offload != "none"),
    Feature("tp", "tp", {"tp": 2}, lambda c: c.tp > 1),
    Feature("sp", "sequence_parallel", {"sequence_parallel": True}, lambda c: c.sequence_parallel),
    Feature("pp", "pp", {"pp": 2, "microbatches": 2}, lambda c: c.pp > 1),
    Feature("cp", "cp", {"cp": 2}, lambda c: c.cp > 1),
    Feature("experts", "experts", {"experts": 4}, lambda c: c.experts > 0),
    Feature("ep", "ep", {"ep": 2}, lambda c: c.ep > 1),
)
"""The axes' choices the generated matrix pairs (tests/test_layout_matrix.py), with the
strategies' (:mod:`trainmesh.strategies`): adding one adds it to the matrix, and the coverage
test fails until each of its pairs is run or refused. The planner enumerates these."""


@dataclass(frozen=True)
class Facts:
    """What a run adds to its layout, known before any worker starts: the model's facts and
    the run's outputs. None: not known where a check runs; the rules that need it
    (:attr:`Rule.needs`) are skipped there and checked where it is known."""

    experts: int | None = None
    """The model's experts per MoE layer (0: dense)."""
    layers: int | None = None
    """The built-in GPT's transformer blocks (what --pp x --virtual-stages cut)."""
    ties: bool | None = None
    """Some weight is shared by two of the model's pipeline layers (tied embeddings: the input
    embedding's and the head's)."""
    ties_on_one_rank: bool | None = None
    """A weight shared by pipeline stages that one rank holds (interleaved chunks)."""
    hub: bool | None = None
    """The model is a Hugging Face model of --model-dir (not the built-in GPT)."""
    saves: bool | None = None
    """The run writes checkpoints (--save-dir)."""
    launcher: str | None = None
    """What starts the workers: ``torchrun`` (this process is a worker of torchrun or srun) or
    ``sbatch`` (the script ``trainmesh launch slurm`` prints); unknown for a local launch."""
    run: Any = None
    """The run's own settings beside the layout (a TrainConfig: --coordinator, --global-batch,
    ...), for the strategies' rules on them."""


@dataclass(frozen=True)
class Refusal:
    flag: str
    message: str

    def error(self) -> ConfigError:
        return ConfigError(self.flag, self.message)


@dataclass(frozen=True)
class Rule:
    """A combination that means nothing: ``refuses(c, f)`` says whether layout ``c`` with facts
    ``f`` (a :class:`Facts`) is one; the refusal names ``flag`` and says ``why`` (formatted with
    ``c``, ``f`` and ``experts``)."""

    flag: str
    refuses: Callable[[Any, Facts], bool]
    why: str | Callable[[Any, Facts], str]
    """The refusal's message: a format string of ``c``, ``f`` and ``experts``, or a function
    of ``(c, f)``."""
    example: dict[str, Any] = field(default_factory=dict)
    """Settings (config fields; :class:`Facts` fields) that break it: a refusal test case."""
    pairs: tuple[tuple[str, str], ...] = ()
    """The pairs of features (:data:`FEATURES`, the strategies') it refuses together."""
    needs: tuple[str, ...] = ()
    """The :class:`Facts` it reads: skipped where one of them is not known."""

    def applies(self, cfg: Any, facts: Facts) -> bool:
        """Whether ``cfg`` breaks this rule (False where a fact it needs is unknown)."""
        return all(getattr(facts, n) is not None for n in self.needs) and self.refuses(cfg, facts)

    def message(self, cfg: Any, facts: Facts) -> str:
        if callable(self.why):
            return self.why(cfg, facts)
        return self.why.format(c=cfg, f=facts, experts=facts.experts)

    def refusal(self, cfg: Any, facts: Facts) -> Refusal:
        return Refusal(self.flag, self.message(cfg, facts))


def _hsdp(c: Any) -> bool:
    return c.dp_shard is not None and c.dp_shard < c.dp


RULES: tuple[Rule, ...] = (
    Rule("--reduce-dtype", lambda c, f: c.reduce_dtype not in (None, "fp32", c.precision),
         "must be fp32 or the compute dtype ({c.precision}); got {c.reduce_dtype!r}",
         {"reduce_dtype": "bf16"}),
    Rule("--min-dp", lambda c, f: c.min_dp is not None and c.min_dp > c.dp,
         "must be at most --dp {c.dp} (--dp is the full layout, --min-dp the smallest it may "
         "shrink to); got {c.min_dp}", {"dp": 2, "min_dp": 3}),
    Rule("--sequence-parallel", lambda c, f: c.sequence_parallel and c.tp == 1,
         "shards activations inside TP groups; needs --tp > 1",
         {"sequence_parallel": True}),
    Rule("--offload", lambda c, f: c.offload != "none" and c.zero == 0,
         "moves the optimizer shard of ZeRO off the device; needs --zero 1, 2 or 3 "
         "(valid with --zero 0: none)", {"dp": 2, "offload": "cpu"}),
    Rule("--dp-shard", lambda c, f: _hsdp(c) and c.zero == 0,
         "shards ZeRO's states inside groups of DP ranks; needs --zero 1, 2 or 3 "
         "(valid with --zero 0: leave it unset)", {"dp": 4, "dp_shard": 2}),
    Rule("--dp-shard", lambda c, f: _hsdp(c) and c.min_dp is not None and c.min_dp < c.dp,
         "< --dp is not supported with --min-dp (an elastic dp would change the shard and "
         "replica groups mid-run); leave --dp-shard unset",
         {"dp": 4, "dp_shard": 2, "zero": 1, "min_dp": 2}),
    Rule("--cp-comm", lambda c, f: c.cp_comm != "ring" and c.cp == 1,
         "exchanges K/V inside CP groups; needs --cp > 1 (valid otherwise: ring)",
         {"cp_comm": "allgather"}),
    Rule("--zero3-reshard", lambda c, f: c.zero3_reshard != "step" and (c.zero != 3 or c.pp == 1),
         "chooses when ZeRO-3 re-gathers under a pipeline; needs --zero 3 and --pp > 1 "
         "(valid otherwise: step)", {"dp": 2, "zero": 3, "zero3_reshard": "microbatch"}),
    Rule("--offload-params", lambda c, f: c.offload_params and (c.zero != 3 or c.offload == "none"),
         "needs --zero 3 and --offload cpu or nvme",
         {"dp": 2, "zero": 2, "offload": "cpu", "offload_params": True}),
    Rule("--offload-dir", lambda c, f: c.offload_dir is not None and c.offload != "nvme",
         "is where --offload nvme writes; needs --offload nvme", {"offload_dir": "offload"}),
    Rule("--compile-backend", lambda c, f: c.compile_backend != "inductor" and not c.compile,
         "chooses --compile's backend; needs --compile", {"compile_backend": "eager"}),
    Rule("--ep", lambda c, f: c.ep > 1 and f.experts == 0,
         "spreads the experts of MoE layers; needs --experts > 0", {"dp": 2, "ep": 2},
         needs=("experts",)),
    Rule("--ep", lambda c, f: f.experts > 0 and f.experts % c.ep != 0,
         "must divide --experts {experts}; got {c.ep}", {"dp": 2, "ep": 2, "experts": 3},
         needs=("experts",)),
    Rule("--pp", lambda c, f: c.pp * c.virtual_stages > f.layers,
         lambda c, f: f"pp x virtual-stages = {c.pp * c.virtual_stages} exceeds the model's "
                      f"{f.layers} layers",
         {"pp": 2, "microbatches": 2, "layers": 1}, needs=("layers",)),
    Rule("--zero", lambda c, f: c.pp > 1 and c.zero >= 2 and f.ties,
         "{c.zero}: the model ties weights across pipeline stages (e.g. tie_word_embeddings), "
         "whose gradients are summed over the stages before the DP reduction, which ZeRO-2 and 3 "
         "begin during the backward: --zero 0 or 1 under --pp",
         {"dp": 2, "pp": 2, "microbatches": 2, "zero": 2, "ties": True}, needs=("ties",)),
    Rule("--pp", lambda c, f: c.pp > 1 and f.ties_on_one_rank,
         "a weight shared by pipeline stages must sit on different ranks; this cut puts two of "
         "its stages on one rank (valid: other --virtual-stages or --pp, or a model without "
         "the tie)", {"pp": 2, "microbatches": 2, "ties_on_one_rank": True},
         needs=("ties_on_one_rank",)),
)
"""Every rule between the axes and their settings (the strategies add theirs:
:mod:`trainmesh.strategies`); none refuses a pair of :data:`FEATURES` (what they need of each
other — SP needs tp, offload and HSDP need ZeRO, ep needs experts — is a rule, not a refused
pair). docs/LAYOUTS.md lists them with the strategies' own rules."""


def refusal(cfg: Any, experts: int | None = None, *, facts: Facts | None = None,
            rules: tuple[Rule, ...] = RULES) -> Refusal | None:
    """The first of ``rules`` that ``cfg`` breaks with ``facts`` (``experts``: the model's
    count, short for ``Facts(experts=...)``; unknown facts skip the rules that need them), or
    None; the degrees (:func:`check_degrees`) first."""
    try:
        check_degrees(cfg)
    except ConfigError as exc:
        return Refusal(exc.field, exc.message)
    facts = facts if facts is not None else Facts()
    if experts is not None:
        facts = replace(facts, experts=experts)
    for rule in rules:
        if rule.applies(cfg, facts):
            return rule.refusal(cfg, facts)
    return None


def check(cfg: Any, experts: int | None = None, *, facts: Facts | None = None,
          rules: tuple[Rule, ...] = RULES) -> None:
    """Raise the :class:`ConfigError` of the first rule ``cfg`` breaks."""
    found = refusal(cfg, experts, facts=facts, rules=rules)
    if found is not None:
        raise found.error()
