"""``Engine.train_step(batch)`` (docs/API.md): a tensor, a tuple/list of tensors or a
dict is this DP rank's batch, split along dim 0 into ``microbatches``; pre-split microbatches
only through ``train_step(microbatches=[...])``."""
from __future__ import annotations

import pytest
import torch
from tolerances import SAME_KERNELS_ABS
from torch import nn

from trainmesh import Engine, ParallelConfig, ParallelMesh
from trainmesh.core.errors import ConfigError
from trainmesh.data.corpus import split_microbatches


def test_split_keeps_the_kind_and_splits_rows():
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    parts = split_microbatches(x, 3)
    assert [p.tolist() for p in parts] == [x[0:2].tolist(), x[2:4].tolist(), x[4:6].tolist()]
    tup = split_microbatches((x, y), 2)
    assert all(isinstance(p, tuple) and p[0].shape == (3, 2) and p[1].shape == (3,) for p in tup)
    assert isinstance(split_microbatches([x, y], 2)[0], list)
    d = split_microbatches({"input_ids": x, "labels": y, "flag": True}, 3)
    assert [p["labels"].tolist() for p in d] == [[0, 1], [2, 3], [4, 5]] and d[2]["flag"] is True
    assert len(split_microbatches(x, 1)) == 1 and torch.equal(split_microbatches(x, 1)[0], x)


def test_indivisible_rows_name_microbatches_and_rows():
    with pytest.raises(ConfigError) as err:
        split_microbatches(torch.zeros(6, 2), 4)
    assert err.value.field == "microbatches" and "6 rows" in str(err.value) and "4" in str(err.value)
    with pytest.raises(ValueError, match="disagree"):
        split_microbatches((torch.zeros(6), torch.zeros(5)), 2)


class Rows(nn.Module):
    """A loss that depends on how rows are grouped: mean over rows of a squared output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x).pow(2).mean()


def _engine(m: int) -> Engine:
    return Engine(Rows(), lambda ps: torch.optim.SGD(ps, lr=0.1), lambda mod, b: mod(b),
                  ParallelConfig(microbatches=m), mesh=ParallelMesh(local=True))


def test_a_tensor_batch_is_one_batch_not_a_list_of_rows():
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    whole = Rows()(x).item()
    seen: list[tuple[int, ...]] = []
    engine = _engine(1)
    engine.module.register_forward_pre_hook(lambda _m, args: seen.append(tuple(args[0].shape)))
    assert abs(engine.train_step(x) - whole) <= SAME_KERNELS_ABS
    assert seen == [(6, 4)], seen                       # one forward on the (rows, features) batch
    seen.clear()
    engine2 = _engine(3)
    engine2.module.register_forward_pre_hook(lambda _m, args: seen.append(tuple(args[0].shape)))
    engine2.train_step(x)
    assert seen == [(2, 4)] * 3, seen


def test_explicit_microbatches_and_bad_calls():
    x = torch.randn(6, 4)
    engine = _engine(2)
    seen: list[tuple[int, ...]] = []
    engine.module.register_forward_pre_hook(lambda _m, args: seen.append(tuple(args[0].shape)))
    engine.train_step(microbatches=[x[:1], x[1:]])       # the caller's split, uneven allowed
    assert seen == [(1, 4), (5, 4)], seen
    with pytest.raises(TypeError):
        engine.train_step()
    with pytest.raises(TypeError):
        engine.train_step(x, microbatches=[x])
    with pytest.raises(ConfigError, match="microbatches"):
        _engine(4).train_step(x)
