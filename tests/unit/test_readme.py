"""README.md is a landing page: short, every local link resolves, every figure it quotes links to
the docs page that reproduces it, and its Python example runs.

The long form of every section is under docs/ (the mkdocs site, `mkdocs.yml`); this test keeps
the README from growing back into it."""

from __future__ import annotations

import re
import subprocess
import sys
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 250

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")
FIGURE = re.compile(r"\d(?:[\d,.]*\d)?\s?(?:%|x\b|(?:min|s|ms|h|GiB|MiB|GB|MB|nats|tokens|steps|FLOPs|"
                    r"device-hours)\b)")
"""A number with a unit: `8.4 min`, `7.5%`, `0.58%`, `8 x h100`, `2.25 s`, `0.060 nats`."""


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, in_code = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (mkdocs) gives a heading."""
    text = re.sub(r"[`*_]", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#").strip()) for _, line in prose_lines(page.read_text()) if line.startswith("#")}


def test_the_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES}): move the long form to a docs/ page"


def test_every_local_link_resolves():
    broken = []
    for n, line in prose_lines(README.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            page = ROOT / path if path else README
            if not page.exists():
                broken.append(f"line {n}: {target} (no such file)")
            elif anchor and page.suffix == ".md" and anchor not in anchors(page):
                broken.append(f"line {n}: {target} (no heading #{anchor} in {path or 'README.md'})")
    assert not broken, "README.md links to what does not exist:\n" + "\n".join(broken)


def test_every_figure_links_to_the_page_that_reproduces_it():
    unlinked = [f"line {n}: {line}" for n, line in prose_lines(README.read_text())
                if FIGURE.search(line) and "](docs/" not in line]
    assert not unlinked, ("README.md quotes figures without a link to the docs page that reproduces them:\n"
                          + "\n".join(unlinked))


def test_the_check_sees_an_unlinked_figure():
    text = "the suite runs in 8.4 min\n```\n7.5% in a code block\n```\nsaved 37.8% ([docs/loss.md](docs/loss.md))\n"
    assert [n for n, line in prose_lines(text) if FIGURE.search(line) and "](docs/" not in line] == [1]
    assert slug("Long context: tiled loss, tiled MLP, activation offload") == \
        "long-context-tiled-loss-tiled-mlp-activation-offload"


def test_the_python_example_runs(tmp_path):
    """The README's first ```python block, as a script in a scratch folder (it writes plan.json): the
    session's cache (tests/conftest.py, inherited through TRAINPLAN_CACHE_DIR) holds the cpu profile,
    so it measures nothing; a solve of tiny-llama, seconds on one core."""
    code = re.search(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)
    assert code, "README.md has no ```python example"
    script = tmp_path / "readme_example.py"
    script.write_text(code.group(1))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "predicted final loss" in done.stdout, done.stdout
    assert (tmp_path / "plan.json").exists()
