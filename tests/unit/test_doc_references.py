"""Every module, name and file that the docs and docstrings point to exists.

Prose names code in backticks: `trainplan.costmodels.step.memory.simulate_region`, `planner/joint/solver.py`.
After code moves, such a reference is easy to leave behind; this test resolves each one (a
dotted name by importing its longest module prefix and reading the attributes after it, a path
on disk) in README.md, CONTRIBUTING.md, docs/*.md and the source packages' text."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("trainplan", "hardware_profiles", "costmodels", "modeling", "planner", "executor")
"""The source folders: `trainplan/` (the package, its errors) and the top-level folders it links to
(docs/architecture.md, "One namespace"); `Path.rglob` does not follow the links, so each file once."""
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))

DOTTED = re.compile(r"`(trainplan(?:\.[A-Za-z_]\w*)+)`?")
FILE_SUFFIXES = {"json", "toml", "csv", "html", "log", "pt", "txt", "md", "yaml"}
"""`trainplan.json` is a file a run writes, not a module."""
PATH = re.compile(rf"`((?:{'|'.join(FOLDERS)}|tests|benchmarks|scripts|docs)/[\w/.-]*\w(?:\.\{{[\w,]+\}})?)")


def references(path: Path) -> list[tuple[str, str]]:
    """("dotted" | "path", reference) for each backticked reference in the file's text."""
    text = path.read_text()
    return ([("dotted", m) for m in DOTTED.findall(text) if m.rpartition(".")[2] not in FILE_SUFFIXES]
            + [("path", m) for m in PATH.findall(text)])


def resolves(kind: str, ref: str) -> bool:
    if kind == "path":
        stem, _, braces = ref.partition(".{")  # `results/bits.{csv,json}`: each suffix
        names = [f"{stem}.{x}" for x in braces.rstrip("}").split(",")] if braces else [ref]
        return all((ROOT / n).exists() for n in names)
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("path", DOCS + SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_references_resolve(path):
    stale = sorted({ref for kind, ref in references(path) if not resolves(kind, ref)})
    assert not stale, f"{path.relative_to(ROOT)} names what does not exist: {stale}"


def test_the_check_sees_a_stale_reference(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("`trainplan.costmodels.step.memory.simulate_region` and "
                   "`trainplan.costmodels.step.memory.no_such_name`, "
                   "`planner/joint/solver.py` and `planner/solver.py`, `benchmarks/results/joint.{csv,json}`")
    assert [resolves(k, r) for k, r in references(doc)] == [True, False, True, False, True]


def architecture_tree() -> set[str]:
    """The module paths docs/architecture.md's tree lists (its block after '## The tree')."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## The tree", 1)[1].split("```")[1]
    out, pkg, sub = set(), "", ""
    for line in block.splitlines():
        name = line.strip().split(" ", 1)[0] if line.strip() else ""
        indent = len(line) - len(line.lstrip())
        if name.endswith("/"):
            pkg, sub = (name, "") if indent == 0 else (pkg, name)
        elif name.endswith(".py"):
            out.add(pkg + (sub if indent == 4 else "") + name)
    return out


def test_architecture_tree_lists_every_module():
    on_disk = {str(p.relative_to(ROOT)) for p in SOURCES if p.name not in ("__init__.py", "__main__.py")}
    listed = architecture_tree()
    assert on_disk == listed, (f"docs/architecture.md's tree misses {sorted(on_disk - listed)} and lists "
                               f"{sorted(listed - on_disk)}")
