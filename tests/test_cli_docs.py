"""docs/CLI.md is what the parsers say: regenerated and compared (flags change often; the fix
is one command, printed by the failure)."""
from __future__ import annotations

from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "CLI.md"


@pytest.mark.timeout(60)
def test_cli_reference_is_regenerated_from_the_parsers():
    from trainmesh.cli.docs import render
    from trainmesh.config.train import FLAGS
    text = render()
    assert DOC.read_text() == text, ("docs/CLI.md is out of date; regenerate it with "
                                     "`python -m trainmesh.cli.docs > docs/CLI.md`")
    for flag in FLAGS:   # every train flag, with its help, in the train section
        assert f"`{flag}`" in text.split("## `trainmesh plan`")[0], flag
    assert "| `--grad-clip` | float | `1.0` |" in text   # trainmesh train's own default


@pytest.mark.timeout(60)
def test_the_comparison_sees_a_changed_flag(monkeypatch):
    """A flag's help changed in the parsers but not in the file: the comparison notices."""
    from trainmesh.cli import docs
    from trainmesh.config.train import FLAGS
    flag = FLAGS["--dp"]
    monkeypatch.setitem(FLAGS, "--dp", type(flag)(flag.field, flag.kind, flag.help + " (changed)"))
    assert DOC.read_text() != docs.render()


@pytest.mark.timeout(60)
def test_api_reference_names_every_public_name_field_and_method():
    import dataclasses

    import trainmesh as tm
    api = (DOC.parent / "API.md").read_text()
    missing = [n for n in tm.__all__ if f"tm.{n}" not in api]
    missing += [f.name for f in dataclasses.fields(tm.ParallelConfig) if f"| `{f.name}` |" not in api]
    missing += [n for n in vars(tm.Engine) if not n.startswith("_") and f"`{n}" not in api]
    assert not missing, f"docs/API.md does not describe {missing}"


@pytest.mark.timeout(60)
def test_metrics_reference_names_every_record():
    text = (DOC.parent / "METRICS.md").read_text()
    for event in ("step", "eval", "resize", "summary"):
        assert f"## `{event}`" in text, event
    for field in ("grad_norm", "tokens_per_s", "mfu", "model_state_bytes", "comm_bytes_per_step",
                  "comm_buffer_peak_bytes", "init_peak_mem_bytes", "offloaded_bytes"):
        assert f"`{field}`" in text, field
