"""trainplan.modeling.torch_private: the one home of trainplan's private torch APIs.

Each entry of its table resolves under the installed torch; no other source file imports a private
torch module (checked on the source with `ast`, and the check is shown to flag one); a name the
installed torch lacks is a TrainplanError naming the API, the installed torch and the tested range;
the table's users are the modules that import from it; importing the module imports no torch, and
using one name does not import FSDP's internals; pyproject's torch requirement is the tested one.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from trainplan.errors import TrainplanError
from trainplan.modeling import torch_private
from trainplan.modeling.torch_private import PRIVATE, TORCH_REQUIREMENT, Private

ROOT = Path(__file__).resolve().parents[3]
FOLDERS = ("trainplan", "hardware_profiles", "costmodels", "modeling", "planner", "executor")
"""The source folders: `trainplan/` (the package, its errors) and the top-level folders it links to
(docs/architecture.md, "One namespace"); `Path.rglob` does not follow the links, so each file once."""
SOURCES = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))
HOME = ROOT / "modeling" / "torch_private.py"
OPERATORS = "torch.ops."
"""`torch.ops.aten._grouped_mm` names an operator in torch's public operator registry, not a module."""


def _private(segment: str) -> bool:
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def _private_torch(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(_private(p) for p in parts[1:]) and not dotted.startswith(OPERATORS)


def _chain(node: ast.Attribute) -> list[str] | None:
    """`a.b.c` -> ["a", "b", "c"]; None when the chain does not start at a name (`f().x`)."""
    names: list[str] = []
    cur: ast.expr = node
    while isinstance(cur, ast.Attribute):
        names.append(cur.attr)
        cur = cur.value
    return [cur.id, *reversed(names)] if isinstance(cur, ast.Name) else None


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, private torch API) for each use of a private torch module in `source`'s code:
    `import torch._x`, `from torch._x import y`, `from torch.utils import _pytree`, attribute
    chains from a torch name (`torch._ops.OpOverload`, `dist._x` after `import torch.distributed as
    dist`) and `importlib.import_module("torch._x")`. Strings, docstrings and comments are not code;
    chains under `torch.ops.` name operators (`OPERATORS`)."""
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
                    if _private_torch(a.name):
                        found.append((node.lineno, a.name))
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            module = node.module or ""
            for a in node.names:
                aliases[a.asname or a.name] = f"{module}.{a.name}"
                if _private_torch(module) or _private(a.name):
                    found.append((node.lineno, f"{module}.{a.name}"))
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner and (chain := _chain(node)):
            if chain[0] in aliases:
                dotted = ".".join([aliases[chain[0]], *chain[1:]])
                if _private_torch(dotted):
                    found.append((node.lineno, dotted))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0].value
            if name in ("import_module", "__import__") and isinstance(arg, str) and _private_torch(arg):
                found.append((node.lineno, arg))
    return sorted(set(found))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(parts if parts[0] == "trainplan" else ("trainplan", *parts))


def _imports_from_home(path: Path) -> set[str]:
    """The names the file imports from trainplan.modeling.torch_private."""
    return {a.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module == "trainplan.modeling.torch_private"
            for a in node.names}


def test_the_walk_sees_each_source_file_once():
    assert HOME in SOURCES and ROOT / "trainplan" / "__init__.py" in SOURCES and len(SOURCES) > 100
    assert len({p.resolve() for p in SOURCES}) == len(SOURCES)


@pytest.mark.parametrize("name", sorted(PRIVATE))
def test_every_entry_resolves_under_the_installed_torch(name):
    entry = PRIVATE[name]
    assert _private_torch(entry.dotted), f"{name}: {entry.dotted} is not private; import it where it is used"
    assert entry.used_by and entry.use and entry.why, name
    assert getattr(torch_private, name) is torch_private.resolve(name)
    assert name in torch_private.__all__ and not name.startswith("_")


def test_no_other_source_file_imports_a_private_torch_module():
    bad = [f"{p.relative_to(ROOT)}:{line} uses {api}" for p in SOURCES if p != HOME
           for line, api in private_torch_uses(p.read_text())]
    assert not bad, ("private torch APIs outside modeling/torch_private.py (add them to its PRIVATE and "
                     "import them from there):\n" + "\n".join(bad))


def test_the_check_flags_private_torch_uses():
    source = '''
"""Docstrings and strings are not code: `torch._ops.OpOverload`, import torch._C"""
import logging
import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn, _C as c
from torch.utils import _pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
import importlib
logging.getLogger("torch.utils._pytree")

def f(x):
    from torch.distributed._tools.mem_tracker import MemTracker
    importlib.import_module("torch._meta_registrations")
    y = torch.ops.aten._grouped_mm(x, x)  # an operator, not a module
    return isinstance(x, torch._ops.OpOverload), dist._functional_collectives, nn._reduction, torch.__version__, y
'''
    assert [api for _, api in private_torch_uses(source)] == [
        "torch._dynamo", "torch._C", "torch.utils._pytree", "torch._subclasses.fake_tensor.FakeTensorMode",
        "torch.distributed._tools.mem_tracker.MemTracker", "torch._meta_registrations", "torch._ops.OpOverload",
        "torch.distributed._functional_collectives", "torch.nn._reduction"]
    assert private_torch_uses("import torch\nfrom torch import nn\nx = torch.nn.Linear(2, 2)\n") == []


def test_the_users_named_are_the_importers():
    """Each entry's `used_by` are exactly the source modules that import it from torch_private."""
    users: dict[str, set[str]] = {}
    for p in SOURCES:
        for name in _imports_from_home(p):
            users.setdefault(name, set()).add(_module_name(p))
    assert set(users) <= set(PRIVATE), f"imported from torch_private but not in PRIVATE: {set(users) - set(PRIVATE)}"
    assert {n: set(e.used_by) for n, e in PRIVATE.items()} == {n: users.get(n, set()) for n in PRIVATE}


@pytest.mark.parametrize("target", ["torch.utils._python_dispatch:_get_current_dispatch_mode_stack_v2",
                                    "torch._no_such_module:Thing"])
def test_a_missing_private_name_is_a_typed_error_naming_torch(monkeypatch, target):
    import torch

    monkeypatch.setitem(PRIVATE, "moved_api", Private(target, ("trainplan.executor.accumulation",), "test", "test"))
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    want = f"torch 2.14.0 has no {target.replace(':', '.')} (used by trainplan.executor.accumulation"
    with pytest.raises(TrainplanError, match=re.escape(want)) as e:
        torch_private.moved_api  # noqa: B018 - the attribute access resolves it
    message = str(e.value)
    assert re.match(r"trainplan \S+ is tested with torch 2\.13; ", message), message
    assert message.endswith(": pip install 'torch>=2.13,<2.14'") and "\n" not in message, message
    with pytest.raises(TrainplanError, match=re.escape(want)):
        exec("from trainplan.modeling.torch_private import moved_api", {})
    assert "moved_api" not in vars(torch_private)  # a failure is not cached


def test_a_name_outside_the_table_is_an_attribute_error():
    assert not hasattr(torch_private, "no_such_name")


def test_importing_it_imports_no_torch_and_one_name_not_fsdp():
    code = ("import sys\n"
            "import trainplan.modeling.torch_private as tp\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "tp.FakeTensorMode, tp.pytree, tp.get_current_dispatch_mode_stack\n"
            "assert 'torch' in sys.modules\n"
            "assert 'torch.distributed.fsdp' not in sys.modules, 'FSDP imported'\n"
            "assert 'torch.distributed._tools.mem_tracker' not in sys.modules, 'MemTracker imported'\n"
            "tp.DefaultAllGather\n"
            "assert 'torch.distributed.fsdp._fully_shard._fsdp_collectives' in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_pyproject_requires_the_tested_torch():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_req = [r for r in project["dependencies"] if re.match(r"torch\b(?![\w-])", r)]
    assert torch_req == [TORCH_REQUIREMENT]
