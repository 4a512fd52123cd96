"""The trainplan cache root: the one function every cached file's path starts from.

The root is, in order: a `cache_dir` the caller passes, else `$TRAINPLAN_CACHE_DIR`, else the
platform's user cache folder for "trainplan" (`platformdirs.user_cache_path`:
`$XDG_CACHE_HOME/trainplan`, by default `~/.cache/trainplan`, on Linux;
`~/Library/Caches/trainplan` on macOS; `%LOCALAPPDATA%\\trainplan\\Cache` on Windows).
Under it: `hardware/cpu.json` (the measured cpu profile, `trainplan.hardware_profiles.cpu`), `laws/` and
`quality/` (fitted constants, `trainplan.costmodels.loss.cache`, `trainplan.costmodels.data.quality_cache`),
`tokenizers/`, `tokens/` and `scores/` (`trainplan.executor.data`), `calibration_history.csv`
(`trainplan.executor.reporting.figures`).

It lives in the lowest package that caches something (the cpu profile), so every package above
builds its paths from it.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "trainplan"
"""The folder name under the platform's user cache folder."""

CACHE_ENV = "TRAINPLAN_CACHE_DIR"
"""Environment variable that overrides the platform's cache folder (tests, benchmarks' scratch
caches, several users of one machine)."""


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The trainplan cache root: `cache_dir` when given, else `$TRAINPLAN_CACHE_DIR` when set and
    not empty, else `platformdirs.user_cache_path("trainplan")` (see the module text); `~` is
    expanded. Nothing is created here: the writers make the folders they write into."""
    root = cache_dir or os.environ.get(CACHE_ENV)
    if root:
        return Path(root).expanduser()
    return platformdirs.user_cache_path(APP_NAME, appauthor=False)
