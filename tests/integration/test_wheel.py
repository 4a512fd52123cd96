"""The wheel: built from the checkout, installed into a fresh virtual environment, it installs one
top-level package, `trainplan`, with every module and the package data the code reads, and the
installed `trainplan` command answers `--version`, lists the shipped profiles and solves a plan.

Why a test: every other test imports the checkout (`pythonpath = ["."]`, or the editable install),
where each file is where the code looks for it. A `.toml` profile or report template left out of
`[tool.setuptools.package-data]`, a subpackage the symlinks (docs/architecture.md, "One namespace")
fail to carry into the wheel, or a stray top-level package in `site-packages` would go unnoticed
there and break only a user's `pip install`.

How, without a download: the wheel is built with the test environment's setuptools
(`--no-build-isolation`; pyproject's build-system asks for setuptools>=77, for the PEP 639 `license`
field) from a copy of the checkout's files (tracked and untracked-not-ignored, so uncommitted work is
what is tested; setuptools writes `build/` and `*.egg-info` into the copy, not the checkout). The
fresh environment's own pip installs it with `--no-index --no-deps`; then a `.pth` file appends the
test environment's site-packages, so torch and the rest import from there. A plain path in a `.pth`
file does not run the `.pth` files in that folder, so the checkout's editable install (its
`__editable__` finder) stays out: `import trainplan` is the wheel's copy, which a test checks.
Commands run from a scratch folder (the checkout's `trainplan/` would shadow the installed one) with
a scratch `TRAINPLAN_CACHE_DIR` and no pip configuration.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import site
import stat
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
DIST_INFO = f"trainplan-{VERSION}.dist-info"
LINKED = ("planner", "executor", "costmodels", "modeling", "hardware_profiles")
"""The top-level folders `trainplan/` links to: in the wheel under `trainplan/`, never at the top."""
FOLDERS = ("trainplan", *LINKED)
NOT_TOP_LEVEL = (*LINKED, "errors", "trainplan_errors")
TEMPLATES = Path("executor", "reporting", "templates")
TIMEOUT = 300


def _env(cache: Path, path_first: Path | None = None) -> dict[str, str]:
    """The environment for every command: no pip configuration (find-links, constraints, indexes),
    no PYTHON* variables or active virtual environment, a scratch trainplan cache."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "PYTHON")) and k not in ("VIRTUAL_ENV", "__PYVENV_LAUNCHER__")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
               PIP_NO_CACHE_DIR="1", PYTHONDONTWRITEBYTECODE="1", TRAINPLAN_CACHE_DIR=str(cache))
    if path_first is not None:
        env["PATH"] = os.pathsep.join([str(path_first), env.get("PATH", "")])
    return env


def _run(cmd: list[str | Path], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`cmd` run to completion; its output in the failure message when it exits non-zero."""
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT, check=False)
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
                                  f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def _copy_checkout(dest: Path) -> None:
    """The checkout's tracked and untracked-not-ignored files copied into `dest`, symlinks as symlinks
    (the relative links in `trainplan/` then point into the copy)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the wheel is built from the checkout's files as git lists them")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    for rel in sorted({f for f in out.decode().split("\0") if f}):
        src, dst = ROOT / rel, dest / rel
        if not os.path.lexists(src) or (src.is_dir() and not src.is_symlink()):
            continue  # a tracked file deleted in the working tree; a submodule
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)


@dataclass(frozen=True)
class Built:
    wheel: Path
    src: Path  # the copy of the checkout the wheel was built from
    tmp: Path  # scratch folder: the commands' working directory
    cache: Path  # the commands' TRAINPLAN_CACHE_DIR


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    """The wheel, built once per module from a copy of the checkout."""
    for requirement in map(Requirement, PYPROJECT["build-system"]["requires"]):
        try:
            have = installed_version(requirement.name)
        except PackageNotFoundError:
            have = None
        assert have is not None and requirement.specifier.contains(have, prereleases=True), (
            f"the wheel is built without build isolation, with this environment's {requirement.name} "
            f"({have or 'not installed'}); pyproject's build-system requires {requirement}")
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, cache, work = tmp / "src", tmp / "dist", tmp / "cache", tmp / "work"
    for d in (src, dist, cache, work):
        d.mkdir()
    before = {p.name for p in ROOT.iterdir()}
    _copy_checkout(src)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", dist, src], cwd=work, env=_env(cache))
    new = {p.name for p in ROOT.iterdir()} - before
    assert not {n for n in new if n == "build" or n.endswith(".egg-info")}, f"the build wrote into the checkout: {new}"
    wheels = list(dist.glob("*.whl"))
    assert [w.name for w in wheels] == [f"trainplan-{VERSION}-py3-none-any.whl"], wheels
    return Built(wheel=wheels[0], src=src, tmp=work, cache=cache)


@dataclass(frozen=True)
class Venv:
    root: Path
    python: Path
    bin: Path
    site_packages: Path
    installed: frozenset[str]  # what the wheel's install added to site-packages
    env: dict[str, str]


@pytest.fixture(scope="module")
def fresh(built, tmp_path_factory) -> Venv:
    """A fresh virtual environment with the wheel installed by its own pip, then the test environment's
    site-packages appended to its path for the dependencies."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    env = _env(built.cache, path_first=root / "bin")
    _run([sys.executable, "-m", "venv", root], cwd=built.tmp, env=env)  # with pip (ensurepip), offline
    python = root / "bin" / "python"
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        cwd=built.tmp, env=env).stdout.strip())
    assert purelib.is_dir() and purelib.is_relative_to(root), purelib
    listed = {p.name for p in purelib.iterdir()}
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", built.wheel], cwd=built.tmp, env=env)
    installed = frozenset({p.name for p in purelib.iterdir()} - listed)
    # after the install, so the install saw only the fresh environment (not the checkout's editable trainplan)
    deps = [p for p in site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
            if Path(p).is_dir()]
    (purelib / "zz_test_environment_packages.pth").write_text("".join(f"{p}\n" for p in deps))
    return Venv(root=root, python=python, bin=root / "bin", site_packages=purelib, installed=installed, env=env)


def _wheel(built: Built) -> zipfile.ZipFile:
    return zipfile.ZipFile(built.wheel)


# --- the wheel's contents --------------------------------------------------------------------------


def test_wheel_has_one_top_level_package(built):
    with _wheel(built) as zf:
        names = zf.namelist()
        record = [row[0] for row in csv.reader(io.StringIO(zf.read(f"{DIST_INFO}/RECORD").decode())) if row]
        top_level = (zf.read(f"{DIST_INFO}/top_level.txt").decode().split()
                     if f"{DIST_INFO}/top_level.txt" in names else ["trainplan"])
    assert {n.split("/")[0] for n in names} == {"trainplan", DIST_INFO}, sorted({n.split("/")[0] for n in names})
    assert {n.split("/")[0] for n in record} == {"trainplan", DIST_INFO}
    assert set(record) == set(names)
    assert top_level == ["trainplan"], top_level


def test_wheel_has_every_module_as_a_file(built):
    """Each .py file of `trainplan/` and of the folders it links to, under `trainplan/`, stored as a
    regular file (setuptools followed the links)."""
    expected = set()
    for folder in FOLDERS:
        prefix = "" if folder == "trainplan" else "trainplan/"
        # Path.rglob does not follow the links in trainplan/: each file once
        expected |= {prefix + p.relative_to(built.src).as_posix() for p in (built.src / folder).rglob("*.py")}
    with _wheel(built) as zf:
        infos = zf.infolist()
    modules = {i.filename for i in infos if i.filename.endswith(".py")}
    assert modules == expected, (f"missing from the wheel: {sorted(expected - modules)}; "
                                 f"not in the checkout: {sorted(modules - expected)}")
    assert {"trainplan/__init__.py", "trainplan/__main__.py", "trainplan/errors/__init__.py",
            "trainplan/planner/api.py", "trainplan/planner/cli/main.py", "trainplan/costmodels/step/memory.py",
            "trainplan/executor/train.py", "trainplan/modeling/presets.py",
            "trainplan/hardware_profiles/__init__.py"} <= modules
    links = [i.filename for i in infos if stat.S_ISLNK(i.external_attr >> 16)]
    assert not links, f"symlinks stored in the wheel: {links}"
    assert not {f"trainplan/{f}" for f in LINKED} & {i.filename for i in infos}


def test_wheel_has_the_package_data(built):
    profiles = sorted(p.name for p in (built.src / "hardware_profiles").glob("*.toml"))
    templates = sorted(p.name for p in (built.src / TEMPLATES).iterdir() if p.is_file())
    assert profiles and templates and any(t.endswith(".css") for t in templates)
    expected = {f"trainplan/hardware_profiles/{p}" for p in profiles}
    expected |= {f"trainplan/{TEMPLATES.as_posix()}/{t}" for t in templates}
    if (built.src / "trainplan" / "py.typed").exists():
        expected.add("trainplan/py.typed")
    with _wheel(built) as zf:
        names = set(zf.namelist())
        for name in sorted(expected & names):
            rel = name.removeprefix("trainplan/")
            source = built.src / ("trainplan" if rel == "py.typed" else "") / rel
            assert zf.read(name) == source.read_bytes(), f"{name} differs from the checkout's"
    assert not expected - names, f"package data missing from the wheel: {sorted(expected - names)}"
    data = {n for n in names if not n.endswith(".py") and n.startswith("trainplan/")}
    assert data == expected, f"unexpected files in the wheel: {sorted(data - expected)}"


def test_wheel_metadata(built):
    with _wheel(built) as zf:
        meta = Parser().parsestr(zf.read(f"{DIST_INFO}/METADATA").decode())
        names = set(zf.namelist())
        license_text = zf.read(f"{DIST_INFO}/licenses/LICENSE") if f"{DIST_INFO}/licenses/LICENSE" in names else b""
        entry_points = zf.read(f"{DIST_INFO}/entry_points.txt").decode()
    assert meta["Name"] == "trainplan" and meta["Version"] == VERSION
    assert meta["License-Expression"] == PYPROJECT["project"]["license"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert license_text and license_text == (built.src / "LICENSE").read_bytes(), "no LICENSE in dist-info/licenses"
    assert meta["Requires-Python"] == PYPROJECT["project"]["requires-python"]
    requires = {str(Requirement(r)) for r in meta.get_all("Requires-Dist") or []}
    assert {str(Requirement(r)) for r in PYPROJECT["project"]["dependencies"]} <= requires
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts == {"trainplan": "trainplan.planner.cli.main:main"}
    assert re.search(r"^\[console_scripts\]\ntrainplan = trainplan\.planner\.cli\.main:main$", entry_points, re.M)


# --- installed into a fresh virtual environment ----------------------------------------------------


def test_install_adds_only_trainplan(fresh):
    assert fresh.installed == {"trainplan", DIST_INFO}, sorted(fresh.installed)
    listed = {p.name for p in fresh.site_packages.iterdir()}
    assert not listed & set(NOT_TOP_LEVEL), sorted(listed & set(NOT_TOP_LEVEL))
    assert (fresh.bin / "trainplan").is_file()


IMPORT_CHECK = """
import importlib.metadata, json, sys
import trainplan
import trainplan.planner.api, trainplan.planner.cli.main, trainplan.executor.reporting.html as html
env = html.environment()
print(json.dumps({
    "version": trainplan.__version__,
    "file": trainplan.__file__,
    "dist": str(importlib.metadata.distribution("trainplan").locate_file("")),
    "modules": sorted({getattr(m, "__file__", None) or "" for m in list(sys.modules.values())} - {""}),
    "templates": sorted(env.list_templates()),
    "sources": {name: env.loader.get_source(env, name)[0] for name in env.list_templates()},
}))
"""


def test_import_resolves_to_the_installed_wheel(fresh, built):
    """`import trainplan` (and its heavy modules) come from the wheel's files in the fresh environment,
    none from the checkout; the report templates load as package data."""
    got = json.loads(_run([fresh.python, "-c", IMPORT_CHECK], cwd=built.tmp, env=fresh.env).stdout)
    assert got["version"] == VERSION
    assert Path(got["file"]) == fresh.site_packages / "trainplan" / "__init__.py", got["file"]
    assert Path(got["dist"]) == fresh.site_packages, got["dist"]
    ours = [m for m in got["modules"] if "trainplan" in Path(m).parts]
    assert ours and all(Path(m).is_relative_to(fresh.site_packages / "trainplan") for m in ours), ours
    checkout = [ROOT / f for f in FOLDERS]
    from_checkout = [m for m in got["modules"] if any(Path(os.path.realpath(m)).is_relative_to(c) for c in checkout)]
    assert not from_checkout, f"modules imported from the checkout: {from_checkout}"
    templates = sorted(p.name for p in (built.src / TEMPLATES).iterdir() if p.is_file())
    assert got["templates"] == templates
    assert got["sources"] == {t: (built.src / TEMPLATES / t).read_text() for t in templates}


def test_version(fresh, built):
    out = _run([fresh.bin / "trainplan", "--version"], cwd=built.tmp, env=fresh.env).stdout
    assert out.strip() == f"trainplan {VERSION}"


def test_profiles_lists_the_shipped_profiles(fresh, built):
    out = _run([fresh.bin / "trainplan", "profiles"], cwd=built.tmp, env=fresh.env).stdout
    listed = {line.split()[0] for line in out.splitlines()[1:] if line.strip()}
    shipped = {p.stem for p in (built.src / "hardware_profiles").glob("*.toml")}
    assert shipped <= listed, f"not listed: {sorted(shipped - listed)}\n{out}"


def test_solve_writes_a_loadable_plan(fresh, built):
    """A small solve on a shipped profile (h100: no cpu measurement), its plan read back by the
    installed package and by the checkout's."""
    plan_file = built.tmp / "plan.json"
    _run([fresh.bin / "trainplan", "solve", "--model", "tiny-llama", "--hw", "h100", "--seq-len", "256",
          "--budget-device-hours", "1", "--json", plan_file], cwd=built.tmp, env=fresh.env)
    read = "import sys, trainplan; p = trainplan.Plan.from_json(sys.argv[1]); print(p.model, p.hw, p.decisions.seq_len)"
    out = _run([fresh.python, "-c", read, plan_file], cwd=built.tmp, env=fresh.env).stdout
    assert out.split() == ["tiny-llama", "h100", "256"], out
    from trainplan import Plan

    plan = Plan.from_json(plan_file)
    assert (plan.model, plan.hw, plan.decisions.seq_len) == ("tiny-llama", "h100", 256)
