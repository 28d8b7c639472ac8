"""The examples of README.md and docs/*.md: fenced blocks, their commands, their relative links.

A block whose info string carries ``doc-test`` (```` ```bash doc-test ````) is run by
tests/test_docs.py, each command in order in one scratch directory (CONTRIBUTING.md). Run as a
script (``python doc_examples.py COMMANDS.json RESULTS.jsonl``), it is that runner: ``trainmesh``
commands in this one process (torch imported once, the workers forked from one server), any
other line through bash; it appends one JSON line per command, with its exit code, to RESULTS.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAG = "doc-test"
PYTHON = "#python\n"                                  # marks a python block's text
FENCE = re.compile(r"^```(.*)$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")        # [text](target)
SCRIPT = re.compile(r"(?<![\w/.])((?:benchmarks|examples|tests)/[\w/.-]+\.(?:py|sh))\b")
DOC_PATH = re.compile(r"(?<![\w/.])((?:docs/)?[A-Z][A-Z_]*\.md)\b")   # docs/ZERO.md, CLI.md, ...


@dataclass(frozen=True)
class Block:
    """One fenced block: the file, the line it opens on, its info string and its lines."""
    path: Path
    line: int
    info: str
    lines: tuple[str, ...]

    @property
    def tagged(self) -> bool:
        return TAG in self.info.split()


def pages() -> list[Path]:
    """The user-facing Markdown: the README, CONTRIBUTING and every docs page."""
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    out: list[Block] = []
    opened: tuple[int, str] | None = None
    body: list[str] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if fence and opened is None:
            opened, body = (number, fence.group(1).strip()), []
        elif fence:
            out.append(Block(path, opened[0], opened[1], tuple(body)))
            opened = None
        elif opened is not None:
            body.append(line)
    return out


def commands(block: Block) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped; a
    ``python`` block is one command, its whole text."""
    if block.info.split()[:1] == ["python"]:
        return [PYTHON + "\n".join(block.lines)]
    out: list[str] = []
    pending = ""
    for line in block.lines:
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if line and not line.startswith("#"):
            out.append(line)
    return out


def leading_block(path: Path) -> Block | None:
    """The fenced block that opens the page right after its title, if there is one."""
    lines = path.read_text().splitlines()
    rest = [(n, s) for n, s in enumerate(lines[1:], 2) if s.strip()]
    if not lines or not lines[0].startswith("# ") or not rest or not FENCE.match(rest[0][1]):
        return None
    first = [b for b in blocks(path) if b.line == rest[0][0]]
    return first[0] if first else None


def broken_links(path: Path) -> list[str]:
    """Relative links, page mentions and scripts run by the examples of ``path`` that name no
    file of the project."""
    text = path.read_text()
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue                                       # http(s), mailto, an anchor here
        if not (path.parent / target.split("#")[0]).exists():
            bad.append(f"{path.relative_to(ROOT)}: link {target}")
    for block in blocks(path):                            # scripts the examples run
        for script in SCRIPT.findall("\n".join(block.lines)):
            if not (ROOT / script).exists():
                bad.append(f"{path.relative_to(ROOT)}:{block.line}: runs {script}")
    for name in DOC_PATH.findall(text):
        here = path.parent / name
        if not (here.exists() or (ROOT / name).exists() or (ROOT / "docs" / name).exists()):
            bad.append(f"{path.relative_to(ROOT)}: mentions {name}")
    return bad


def _run(command: str) -> int:
    if command.startswith(PYTHON):                         # in this process, torch imported once
        import torch.distributed as dist
        try:
            exec(compile(command, "<doc example>", "exec"), {"__name__": "__main__"})
        except Exception:
            import traceback
            traceback.print_exc()
            return 1
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return 0
    argv = shlex.split(command, comments=True)
    if argv[0] != "trainmesh" or any(c in command for c in "|><;&"):
        return subprocess.run(["bash", "-c", command]).returncode
    from trainmesh.cli import main
    try:
        return int(main(argv[1:]) or 0)
    except SystemExit as exc:                              # --help, --version
        return exc.code if isinstance(exc.code, int) else 1


if __name__ == "__main__":
    import torch
    torch.set_num_threads(1)
    for command in json.loads(Path(sys.argv[1]).read_text()):
        print(f"$ {command}", file=sys.stderr, flush=True)
        rc = _run(command)
        sys.stdout.flush()
        with open(sys.argv[2], "a") as results:
            results.write(json.dumps({"command": command, "rc": rc}) + "\n")
