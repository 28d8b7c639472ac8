"""README.md and docs/: a short front door, links that resolve, pages that open with an example,
and the examples tagged ``doc-test`` run as written (CONTRIBUTING.md, "Examples in the docs")."""
from __future__ import annotations

import json
import os
import re
import resource
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doc_examples import ROOT, blocks, broken_links, commands, leading_block, pages
from helpers import LAUNCHED

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LAYOUT_FLAGS = ("--dp", "--pp", "--tp", "--cp", "--ep")


def _tagged() -> list[tuple[str, str]]:
    """(where, command) of every command of every ``doc-test`` block, page by page, in order."""
    return [(f"{b.path.relative_to(ROOT)}:{b.line}", c)
            for path in pages() for b in blocks(path) if b.tagged for c in commands(b)]


def test_readme_is_short():
    size = README.stat().st_size
    assert size <= 10 * 1024, f"README.md is {size} bytes; the front door stays within 10 KiB"


def test_every_link_and_named_file_exists():
    bad = [line for path in pages() for line in broken_links(path)]
    assert not bad, "links, page names or scripts naming no file:\n" + "\n".join(bad)


def test_every_docs_page_opens_with_an_example():
    bare = [p.name for p in DOCS
            if (b := leading_block(p)) is None or b.info.split()[:1] not in (["bash"], ["python"])]
    assert not bare, f"these pages do not open with a bash or python block after the title: {bare}"


def test_the_readme_test_command_is_the_one_ci_runs():
    readme = [c for b in blocks(README) for c in commands(b) if "pytest" in c]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line
          and not line.lstrip().startswith("#")]
    assert len(readme) == 1 and len(ci) == 1, (readme, ci)
    assert ci[0].replace("pip install -q ", "pip install ") == readme[0], (
        f".ci/run runs {ci[0]!r}, README.md says {readme[0]!r}")
    assert readme[0].endswith("python3 -m pytest -q -n 2")


def test_tagged_examples_stay_cheap():
    """A ``doc-test`` command is one process, a few steps: the slow tier runs them all."""
    tagged = _tagged()
    assert {"train", "plan", "report", "--help"} <= {w for _, c in tagged for w in c.split()}, tagged
    for where, command in tagged:
        argv = shlex.split(command, comments=True)
        if argv[:2] != ["trainmesh", "train"] or "--help" in argv:
            continue
        values = dict(zip(argv, argv[1:]))
        assert all(values.get(f, "1") == "1" for f in LAYOUT_FLAGS), f"{where}: {command}: one process"
        assert int(values.get("--steps", "200")) <= 10, f"{where}: {command}: at most 10 steps"


@pytest.mark.timeout(120)
def test_example_layouts_pass_validation(no_launch, monkeypatch, capsys):
    """Every ``trainmesh train`` line of the README's untagged blocks and of each docs page's
    leading block is a valid local run (checked in process; no worker starts). Lines naming a file the
    example does not create (``--config``, ``--resume``, ``--model-dir``, ``--data``) are left out."""
    import trainmesh.run.ft_launch
    from trainmesh.cli import main
    monkeypatch.setattr(trainmesh.run.ft_launch, "launch_fault_tolerant", lambda *a, **k: LAUNCHED)
    monkeypatch.chdir(ROOT)
    chosen = [b for b in blocks(README) + [leading_block(p) for p in DOCS] if b and not b.tagged]
    lines = [(b, c) for b in chosen for c in commands(b) if b.info.split()[:1] == ["bash"]
             and c.startswith("trainmesh train")
             and not re.search(r"--config|--resume|--model-dir|--data|--init-from", c)]
    assert len(lines) >= 15, lines
    for block, command in lines:
        rc = main(shlex.split(command, comments=True)[1:])
        where = f"{block.path.relative_to(ROOT)}:{block.line}"
        assert rc == LAUNCHED, f"{where}: `{command}` exits {rc}: {capsys.readouterr().err[-500:]}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tagged_examples_run(tmp_path):
    """Each ``doc-test`` command exits 0, run in order in one scratch directory by one process."""
    tagged = _tagged()
    (tmp_path / "commands.json").write_text(json.dumps([c for _, c in tagged]))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        env.pop(var, None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("doc_examples.py")),
                           "commands.json", "results.jsonl"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=540)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(f"{len(tagged)} doc-test commands: {cpu:.1f} CPU-seconds")
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()] \
        if (tmp_path / "results.jsonl").exists() else []
    said = {part.split("\n", 1)[0]: part for part in proc.stderr.split("$ ")}   # command -> its stderr
    failed = [f"{where}: `{c}` exited {r['rc']}:\n{said.get(c, '')[-1500:]}"
              for (where, c), r in zip(tagged, results) if r["rc"] != 0]
    assert not failed, "\n".join(failed)
    assert len(results) == len(tagged), (
        f"the runner stopped after {len(results)} of {len(tagged)} commands", proc.stderr[-3000:])


def test_the_architecture_page_names_every_module_and_no_other():
    """docs/ARCHITECTURE.md's tree names each module of src/trainmesh under its package, and
    no file that is not there (planted: a module renamed in the tree fails naming both)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    tree = text.split("```\nsrc/trainmesh/\n", 1)[1].split("```", 1)[0]
    named: set[str] = set()
    package = ""
    for line in tree.splitlines():
        head = re.match(r"  (\w+)/\s", line)
        if head:
            package = head.group(1)
        elif re.match(r"  \S", line):
            package = ""
        if line.startswith(("tests/", "benchmarks/", "examples/", "docs/")):
            break
        for module in re.findall(r"\b(\w+)\.py\b", line):
            named.add(f"{package}/{module}.py" if package else f"{module}.py")
    src = ROOT / "src" / "trainmesh"
    actual = {str(p.relative_to(src)) for p in src.rglob("*.py")
              if p.name != "__init__.py" or p.parent == src}
    named = {n for n in named if not n.endswith("/__init__.py")}
    assert sorted(named - actual) == [], "named on the page, not in src/trainmesh"
    assert sorted(actual - named) == [], "in src/trainmesh, not on the page"
