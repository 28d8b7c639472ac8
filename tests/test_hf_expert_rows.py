"""A rank reads from a hub model's files only its part of each stacked expert parameter.

transformers holds a mixture of experts' experts stacked (``gate_up_proj`` (E, 2h, d) made from
each expert's gate and up matrices by ``MergeModulelist`` then ``Concatenate``, ``down_proj``
(E, d, h) by ``MergeModulelist``) where the files hold them one expert at a time. For tiny
Mixtral, Qwen2-MoE and Qwen3-MoE models saved by ``save_pretrained`` (test_hf_moe's), each
rank's pieces of both parameters at tp 2 (``packed_colwise`` gate and up halves, ``rowwise``
down, as tensor_parallel/hf_experts.py cuts them), at ep 2 (its run of experts) and at ep 2 x
tp 2, and a slice spanning the gate and up halves, equal what transformers' ``from_pretrained``
holds, sliced (``torch.equal``), and the bytes read from the files (every read of a tensor's
bytes goes through ``safetensors_file._read_at``, counted here) are exactly the piece's bytes:
nothing of another expert, row or column. Operations a family might add are mapped too: a
``Transpose`` after the merge, and one on a tensor already stacked in the file (no merge),
read only the box they take; an operation that is not mapped (an ``Interleave``) reads its
sources whole and still equals the whole conversion sliced.

Planted bugs this module catches (each seen failing with an assertion): every source read whole
and the conversion sliced (as before): "mixtral tp2 model.layers.0.mlp.experts.gate_up_proj
(slice(0, 4, None), slice(0, 12, None), slice(0, 32, None)): read 24576 bytes, the piece is
6144"; the ``Concatenate``'s offset not subtracted (the up half read from the gate rows):
"mixtral tp2 model.layers.0.mlp.experts.gate_up_proj (slice(0, 4, None), slice(0, 12, None),
slice(0, 32, None))", torch.equal False; a ``Transpose`` not swapped back: "transposed
model.layers.1.mlp.experts.gate_up_proj (slice(2, 5, None), slice(3, 30, None), slice(1, 9,
None))", torch.equal False.
"""
from __future__ import annotations

from copy import deepcopy

import pytest
import torch
from helpers import saved_models

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
from test_hf_moe import FAMILIES, moe_model  # noqa: E402  (after the skip: it needs transformers)

LAYOUTS = {"tp2": (1, 2), "ep2": (2, 1), "ep2 tp2": (2, 2)}
"""(ep, tp) of the index shapes."""
STYLES = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
"""transformers' up-to-5.24 tp plan for the stacked experts (module docstring of hf_experts)."""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    return saved_models(tmp_path_factory, "hfrows", moe_model, FAMILIES)


def view_of(directory: str):
    """The weights of model directory ``directory`` as its model's parameters (what the
    engine's init reads for a hub model)."""
    from trainmesh.models.hf import build_on_meta, weight_files
    from trainmesh.models.hf_weights import CheckpointView
    return CheckpointView(weight_files(directory), build_on_meta(directory), field="--model-dir")


def pieces(full: tuple[int, ...], style: str, ep: int, tp: int, ep_rank: int, tp_rank: int
           ) -> list[tuple[slice, ...]]:
    """The indices of the full tensor whose concatenation a rank holds (the engine's
    ``Placement.pieces``): its experts over ep, its tp part of each block of ``style``."""
    from trainmesh.core.placement import Placement
    from trainmesh.tensor_parallel.hf_experts import PARAM_STYLES
    dim, parts = PARAM_STYLES[style]
    local = list(full)
    local[0] //= ep
    local[dim] //= tp
    placement = Placement(full_shape=full, tp_dim=dim if tp > 1 else None, tp_parts=parts,
                          tp_start=tp_rank * full[dim] // parts // tp,
                          expert=ep > 1, ep_dim=0 if ep > 1 else None, ep_start=ep_rank * local[0])
    return placement.pieces(tuple(local))


def _check(read, want: torch.Tensor, name: str, index: tuple, counted: list[int], what: str,
           box_bytes: int | None = None) -> None:
    counted[0] = 0
    got = read(name, tuple(want.shape), index)
    assert torch.equal(got, want[index]), f"{what} {name} {index}"
    bound = want[index].numel() * 4 if box_bytes is None else box_bytes     # float32 files
    assert counted[0] == bound, \
        f"{what} {name} {index}: read {counted[0]} bytes, the piece is {bound}"


@pytest.mark.parametrize("kind", FAMILIES)
def test_each_rank_reads_only_its_rows_of_the_stacked_experts(dirs, kind, counted):
    view = view_of(dirs[kind])
    held = dict(transformers.AutoModelForCausalLM.from_pretrained(dirs[kind]).named_parameters())
    stacked = {n: p.detach() for n, p in held.items() if n.rsplit(".", 1)[-1] in STYLES}
    assert len(stacked) == 4, sorted(held)                # 2 layers: gate_up and down each
    for name, want in stacked.items():
        assert want.dtype == torch.float32
        style = STYLES[name.rsplit(".", 1)[-1]]
        for layout, (ep, tp) in LAYOUTS.items():
            for ep_rank in range(ep):
                for tp_rank in range(tp):
                    for index in pieces(tuple(want.shape), style, ep, tp, ep_rank, tp_rank):
                        _check(view.read, want, name, index, counted, f"{kind} {layout}")
        if style == "packed_colwise":                    # half of gate's rows, half of up's
            h = want.shape[1] // 2
            _check(view.read, want, name, (slice(1, 3), slice(h // 2, h + h // 2)),
                   counted, f"{kind} spanning")


def _stacked_file(tmp_path, full: torch.Tensor):
    """A CheckpointView of one file holding ``full`` under ``s``, made into parameter ``p`` by
    a converter of its own (``Transpose(1, 2)``, no merge)."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import Transpose, WeightConverter

    from trainmesh.models.hf_weights import CheckpointView, _Held
    from trainmesh.models.safetensors_file import SafetensorsFile
    save_file({"s": full}, tmp_path / "s.safetensors")
    view = CheckpointView.__new__(CheckpointView)
    view.path, view.field = str(tmp_path), "--model-dir"
    view.held, view.config, view.layer_of = _Held({"p": full.transpose(1, 2)}), None, {}
    view.handle_of = {"s": SafetensorsFile(tmp_path / "s.safetensors")}
    view.converters = [WeightConverter(source_patterns="s", target_patterns="p",
                                       operations=[Transpose(1, 2)])]
    view.sources = {"p": [(view.converters[0].source_patterns[0], "s")]}
    return view


def test_transposes_are_mapped_and_other_operations_read_whole(dirs, counted, tmp_path):
    from transformers.core_model_loading import Interleave, Transpose

    view = view_of(dirs["qwen3_moe"])
    view.converters = deepcopy(view.converters)
    for converter in view.converters:                   # gate_up (E, d, 2h), down (E, h, d)
        converter.operations = [*converter.operations, Transpose(1, 2)]
    boxes = [(slice(2, 5), slice(3, 30), slice(1, 9)), (slice(None), slice(None), slice(4, 12)),
             (slice(7, 8), slice(0, 1))]
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        want = view._converted(name, view._whole)
        for index in boxes:
            _check(view.read, want, name, index, counted, "transposed")
    stacked = _stacked_file(tmp_path, torch.randn(4, 6, 10))
    want = stacked._converted("p", stacked._whole)
    assert want.shape == (4, 10, 6)
    for index in boxes:
        _check(stacked.read, want, "p", index, counted, "stacked, transposed")
    for converter in view.converters:                   # not mapped: every source read whole
        converter.operations = [*converter.operations[:-1], Interleave(1)]
    name = "model.layers.1.mlp.experts.gate_up_proj"
    want = view._converted(name, view._whole)
    _check(view.read, want, name, boxes[0], counted, "interleaved", want.numel() * 4)
