"""A torch or transformers below the supported range is refused with one line naming the
installed and the required version (the command line: exit 2, before anything runs)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

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


def test_the_newest_tested_transformers_is_the_bound_and_the_pin():
    """pyproject's extras stop at the newest transformers tested, constraints.txt (what .ci/run
    and the README install through) pins it, and the warning names it: the three move together."""
    from trainmesh.core.versions import TRANSFORMERS_TESTED
    root = Path(__file__).resolve().parents[1]
    with open(root / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for extra in ("test", "hf"):
        spec = next(r for r in extras[extra] if r.startswith("transformers"))
        assert spec == f"transformers>={TRANSFORMERS_MIN},<={TRANSFORMERS_TESTED}", (extra, spec)
    assert f"transformers=={TRANSFORMERS_TESTED}" in pins(root)


def test_every_declared_dependency_is_pinned_within_its_range():
    """A fresh install gets the versions tested: every dependency pyproject declares (core and the
    test extra) has an exact pin in constraints.txt that its own range accepts; .ci/run and the
    README's test command install through that file."""
    from packaging.requirements import Requirement
    root = Path(__file__).resolve().parents[1]
    with open(root / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    pinned = {line.split("==")[0].lower().replace("_", "-"): line.split("==")[1]
              for line in pins(root)}
    for text in project["dependencies"] + project["optional-dependencies"]["test"]:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = req.name.lower().replace("_", "-")
        assert name in pinned, f"{name} is not pinned in constraints.txt"
        assert req.specifier.contains(pinned[name], prereleases=True), (name, pinned[name], str(req))
    command = 'pip install -q -c constraints.txt torch==2.13.0 -e ".[test]"'
    assert command in (root / ".ci" / "run").read_text()
    assert command.replace(" -q", "") in (root / "README.md").read_text()


def test_a_transformers_newer_than_tested_is_warned_about(monkeypatch, caplog):
    transformers = pytest.importorskip("transformers")
    from trainmesh.core.versions import TRANSFORMERS_TESTED, check_transformers, newer_than_tested
    assert newer_than_tested("5.26.0", "5.25.0") and newer_than_tested("6.0", "5.25.0")
    assert not newer_than_tested("5.25.0", "5.25.0") and not newer_than_tested("5.24.9", "5.25.0")
    assert not newer_than_tested("5.25.0+local", "5.25.0")
    monkeypatch.setattr(transformers, "__version__", "99.0.0")
    with caplog.at_level("WARNING", logger="trainmesh"):
        check_transformers(transformers)
    assert f"99.0.0 is newer than the newest release trainmesh was tested with ({TRANSFORMERS_TESTED})" \
        in caplog.text


def pins(root: Path) -> list[str]:
    lines = (root / "constraints.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]
