"""Fixtures shared by the executor's unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty trainplan cache root for one test (`TRAINPLAN_CACHE_DIR`): tokenizers, token files."""
    d = tmp_path / "cache"
    monkeypatch.setenv("TRAINPLAN_CACHE_DIR", str(d))
    return d
