"""One Layout: the config, the mesh and the planner read ranks, coordinates and groups from the
same value, and they agree with the rank layout stated independently here, rank by rank."""
from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

import trainmesh
from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.errors import ConfigError
from trainmesh.core.layout import Group, Layout
from trainmesh.core.mesh import ParallelMesh
from trainmesh.models.gpt import GPTConfig
from trainmesh.observe.layout import layout_text
from trainmesh.planner.predict import predict_layout

LAYOUTS = {   # name -> ParallelConfig settings (experts: the model's)
    "dp4": {"dp": 4},
    "dp2-tp2": {"dp": 2, "tp": 2},
    "pp2-tp2": {"pp": 2, "tp": 2, "microbatches": 2},
    "dp2-cp2-ep2": {"dp": 2, "cp": 2, "ep": 2, "experts": 4},
    "cp2-ep2": {"cp": 2, "ep": 2, "experts": 2},
    "hsdp-unset": {"dp": 4, "zero": 3},
    "hsdp-dp4-shard2": {"dp": 4, "dp_shard": 2, "zero": 1},
    "hsdp-cp2-tp2": {"dp": 4, "dp_shard": 2, "zero": 2, "cp": 2, "tp": 2},
    "composed-16": {"dp": 2, "zero": 3, "tp": 2, "sequence_parallel": True, "pp": 2,
                    "microbatches": 2, "cp": 2, "ep": 2, "experts": 4},
    "composed-16-hsdp": {"dp": 4, "dp_shard": 2, "zero": 1, "tp": 2, "pp": 2, "microbatches": 2,
                         "ep": 4, "experts": 4},
}


def _expected(s: dict) -> dict[int, dict[str, int]]:
    """Every rank's coordinates, stated here: tp fastest, then cp, dp, pp outermost."""
    dp, pp, tp, cp, ep = (s.get(k, 1) for k in ("dp", "pp", "tp", "cp", "ep"))
    out = {}
    for pp_i, dp_i, cp_i, tp_i in itertools.product(range(pp), range(dp), range(cp), range(tp)):
        rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i
        out[rank] = {"dp": dp_i, "pp": pp_i, "tp": tp_i, "cp": cp_i,
                     **({"ep": (dp_i * cp + cp_i) % ep} if ep > 1 else {})}
    return out


def _keys(s: dict) -> dict[Group, object]:
    """Each group as what its members share: a function of a rank's coordinates."""
    dp, cp, ep = s.get("dp", 1), s.get("cp", 1), s.get("ep", 1)
    shard = s.get("dp_shard") or dp
    line = lambda c: c["dp"] * cp + c["cp"]   # noqa: E731  (the dp x cp line ep cuts in runs)
    return {
        Group.tp: lambda c: (c["pp"], c["dp"], c["cp"]),
        Group.cp: lambda c: (c["pp"], c["dp"], c["tp"]),
        Group.dp: lambda c: (c["pp"], c["cp"], c["tp"]),
        Group.pp: lambda c: (c["dp"], c["cp"], c["tp"]),
        Group.dp_cp: lambda c: (c["pp"], c["tp"]),
        Group.ep: lambda c: (c["pp"], c["tp"], line(c) // ep),
        Group.edp: lambda c: (c["pp"], c["tp"], line(c) % ep),
        Group.dp_shard: lambda c: (c["pp"], c["cp"], c["tp"], c["dp"] // shard),
        Group.dp_replicate: lambda c: (c["pp"], c["cp"], c["tp"], c["dp"] % shard),
        Group.dp_shard_cp: lambda c: (c["pp"], c["tp"], c["dp"] // shard),
        Group.world: lambda c: (),
    }


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_config_mesh_and_planner_agree_rank_by_rank(name):
    settings = dict(LAYOUTS[name])
    experts = settings.pop("experts", 0)
    layout = Layout(**{k: v for k, v in settings.items() if k in ("dp", "pp", "tp", "cp", "ep",
                                                                   "dp_shard")})
    cfg = ParallelConfig(**settings)
    expected, keys = _expected(settings), _keys(settings)
    world = len(expected)
    # the config holds the layout: its world, shard and record are the layout's
    assert cfg.layout == layout and cfg.world_size == layout.world == world
    assert cfg.shard_size == layout.dp_shard == (settings.get("dp_shard") or settings.get("dp", 1))
    record = cfg.layout_record()
    assert Layout.of(record) == layout
    assert layout_text(record).startswith(layout.describe())
    gpt = GPTConfig(vocab_size=64, seq_len=16, d_model=16, n_layers=4, n_heads=2, n_experts=experts)
    planner = predict_layout(gpt, cfg, global_batch=8 * settings.get("dp", 1), base_bytes=0).ranks
    assert [p.rank for p in planner] == list(range(world))
    for rank, coords in expected.items():
        mesh = ParallelMesh.on_paper(cfg.layout, rank)
        assert layout.coords(rank) == coords, (name, rank)
        assert mesh.coords == mesh.coords_of(rank) == coords, (name, rank)
        assert planner[rank].coords == coords, (name, rank)
        assert layout.rank_of(**{k: v for k, v in coords.items() if k != "ep"}) == rank
        for group, key in keys.items():
            members = [r for r, c in expected.items() if key(c) == key(coords)]
            assert mesh.ranks(group) == members, (name, rank, group)
            assert mesh.size(group) == layout.size(group) == len(members), (name, group)
            assert mesh.index(group) == members.index(rank)
            assert members in layout.members(group)


def test_an_unset_dp_shard_is_dp_in_one_place():
    """``dp_shard`` None is dp, plain ZeRO: decided by the Layout, read by all."""
    assert Layout(dp=4) == Layout(dp=4, dp_shard=4) and not Layout(dp=4).hsdp
    assert Layout.of(ParallelConfig(dp=4, zero=1)).dp_shard == 4
    assert Layout.of({"dp": 4, "zero": 1}).dp_shard == 4
    assert Layout(dp=4, dp_shard=2).hsdp and Layout(dp=4, dp_shard=2).size(Group.dp_replicate) == 2


def test_groups_are_named_by_the_enum():
    """A group name is a Group: the mesh refuses any other name at once, naming the valid ones."""
    mesh = ParallelMesh.on_paper(Layout(dp=2, tp=2), 3)
    assert mesh.ranks("tp") == mesh.ranks(Group.tp) == [2, 3]
    with pytest.raises(KeyError, match="unknown mesh group 'dpcp'; valid: pp, dp, cp, tp, dp_cp"):
        mesh.group("dpcp")
    with pytest.raises(KeyError, match="valid"):
        mesh.ranks("tensor")
    assert f"{Group.dp_cp}" == "dp_cp" and {Group.dp: 1} == {"dp": 1}


def test_one_text_for_the_degrees():
    """The console's words and the planner's flags are one function of the layout."""
    hsdp = Layout(dp=4, dp_shard=2, cp=2, ep=2)
    assert hsdp.describe() == "dp 4 (shard 2 x replicate 2) x cp 2 x pp 1 x tp 1"
    assert hsdp.describe("flags") == "dp=4 dp-shard=2 cp=2 pp=1 tp=1 ep=2"
    assert Layout(dp=2, tp=2).describe("flags") == "dp=2 cp=1 pp=1 tp=2"
    assert layout_text({"dp": 4, "dp_shard": 0, "pp": 1}) == "dp 4 x cp 1 x pp 1 x tp 1"


def test_the_mesh_takes_a_layout_or_its_degrees():
    assert ParallelMesh(Layout()).layout == ParallelMesh().layout == Layout()
    with pytest.raises(TypeError):
        ParallelMesh(Layout(), dp=1)
    with pytest.raises(ConfigError, match="--dp-shard"):
        ParallelMesh(dp=4, dp_shard=3)


# ---------------------------------------------------------------- group names in the source
MESH_CALLS = {"index", "size", "ranks", "group"}
COMM_CALLS = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_gather_object",
              "all_to_all", "batch_p2p", "irecv", "isend", "_gather"}


def bare_group_names(tree: ast.AST) -> list[int]:
    """Lines where a mesh or communication call names a group by a bare string."""
    names = {g.value for g in Group}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Attribute, ast.Name)):
            continue
        fn = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        if fn not in MESH_CALLS | COMM_CALLS:
            continue
        args = [*node.args, *(k.value for k in node.keywords if k.arg in ("axis", "group"))]
        if fn in MESH_CALLS:
            args = node.args[:1]
        if any(isinstance(a, ast.Constant) and a.value in names for a in args):
            out.append(node.lineno)
    return out


def test_groups_are_named_by_the_enum_in_the_source():
    """Every mesh and communication call in src/ names its group by ``Group`` (a typo is an
    AttributeError where it is written), not by a bare string. Planted: ``mesh.index("tp")``
    back in engine.py fails with {'engine/engine.py': [line]}."""
    root = Path(trainmesh.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        lines = bare_group_names(ast.parse(path.read_text()))
        if lines:
            found[str(path.relative_to(root))] = lines
    assert found == {}
