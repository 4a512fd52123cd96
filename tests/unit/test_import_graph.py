"""The house rules of docs/architecture.md, checked on the source with `ast` (no import runs):

- no import cycle between trainplan's modules, counting imports inside functions too (a cycle
  kept alive by a deferred import is still a cycle);
- no private name (`_x`) imported from another module;
- no re-export shim (`# noqa: F401`);
- no module over 400 lines and no folder of more than 12 modules.

The direction of imports between packages is import-linter's contract in pyproject.toml
(`lint-imports`, run by scripts/lint.sh)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "trainplan"
"""The one import package; its subpackages are links to the repository's top-level folders
(docs/architecture.md, "One namespace"), walked through."""
FOLDERS = ("trainplan", "hardware_profiles", "costmodels", "modeling", "planner", "executor")
"""The source folders: `trainplan/` (the package, its errors) and the top-level folders it links to
(docs/architecture.md, "One namespace"); `Path.rglob` does not follow the links, so each file once."""
MAX_LINES = 400
MAX_MODULES_PER_FOLDER = 12


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the source packages."""
    out = {}
    for folder, _, files in os.walk(ROOT / PACKAGE, followlinks=True):
        for file in sorted(f for f in files if f.endswith(".py")):
            f = Path(folder) / file
            parts = f.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, imported names, line) for every import statement in the module, at any
    depth; relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, [a.name for a in node.names], node.lineno))
    return out


def _target(mod: str, names: list[str]) -> list[str]:
    """The trainplan modules an import statement loads: the module itself and, for
    `from package import submodule`, the submodules."""
    out = [mod] if mod in MODULES else []
    out += [f"{mod}.{n}" for n in names if f"{mod}.{n}" in MODULES]
    return out


def import_graph() -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(MODULES)
    for name, path in MODULES.items():
        for mod, names, _ in _imports(name, path):
            for t in _target(mod, names):
                if t != name and not name.startswith(t + "."):  # a package's own __init__ is no edge
                    g.add_edge(name, t)
    return g


def test_no_import_cycles():
    cycles = sorted(sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1)
    assert not cycles, f"import cycles (strongly connected modules): {cycles}"


def test_no_private_names_across_modules():
    bad = []
    for name, path in MODULES.items():
        for mod, names, line in _imports(name, path):
            if mod.split(".")[0] == PACKAGE and mod != name:
                bad += [f"{path.relative_to(ROOT)}:{line} imports {mod}.{n}" for n in names
                        if n.startswith("_") and not n.startswith("__")]
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


def test_no_reexport_shims():
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in MODULES.values()
           for i, line in enumerate(p.read_text().splitlines(), 1) if "noqa: F401" in line]
    assert not bad, f"re-export shims (a public name has one home): {bad}"


@pytest.mark.parametrize("pkg", FOLDERS)
def test_module_and_folder_sizes(pkg):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
    crowded = {str(d.relative_to(ROOT)): n for d in [ROOT / pkg, *(ROOT / pkg).rglob("*/")]
               if d.is_dir() and (n := len(list(d.glob("*.py")))) > MAX_MODULES_PER_FOLDER}
    assert not crowded, f"folders over {MAX_MODULES_PER_FOLDER} modules: {crowded}"


def test_the_checker_sees_cycles(tmp_path, monkeypatch):
    """The cycle check is not vacuous: the graph has the edges a deferred import makes."""
    g = import_graph()
    assert g.number_of_edges() > 100
    assert g.has_edge("trainplan.planner.api", "trainplan.planner.plan")
