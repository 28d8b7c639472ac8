"""A torch or transformers below the supported range is refused with one line naming the
installed and the required version (the command line: exit 2, before anything runs)."""
from __future__ import annotations

import pytest

from trainmesh.core.errors import ConfigError
from trainmesh.core.versions import TORCH_MIN, TRANSFORMERS_MIN, parse, require


def test_versions_compare_by_their_numbers():
    assert parse("2.13.0+cpu") == (2, 13, 0) and parse("5.0.0rc1") == (5, 0, 0)
    require("torch", "2.13.0+cpu", "2.5.1")
    require("torch", "2.5.1", "2.5.1")
    require("torch", "2.10", "2.5.1")               # 10 > 5: numbers, not text
    with pytest.raises(ConfigError, match=r"2\.5\.0 is installed; trainmesh needs torch >= 2\.5\.1"):
        require("torch", "2.5.0", "2.5.1")


def test_an_old_torch_exits_2_naming_both_versions(refused, monkeypatch):
    import torch
    monkeypatch.setattr(torch, "__version__", "2.4.1")
    line = refused(["train", "--steps", "1"], "torch")
    assert "2.4.1" in line and TORCH_MIN in line


def test_an_old_transformers_is_refused_naming_both_versions(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from trainmesh.models.hf import transformers_module
    monkeypatch.setattr(transformers, "__version__", "4.30.0")
    with pytest.raises(ConfigError) as exc:
        transformers_module("--model-dir")
    assert exc.value.field == "transformers"
    assert "4.30.0" in str(exc.value) and TRANSFORMERS_MIN in str(exc.value)
