"""The on-disk cache of fitted selection-quality multipliers, per (model, vocabulary).

Fits are written by `save_quality_fits` (e.g. `python benchmarks/data.py --save-fits`) under the
cache root (`trainplan.hardware_profiles.cache.cache_root`) and read back by `load_quality_fits`, which the planner's
method choice (`trainplan.planner.data_choice`) prefers to `trainplan.costmodels.data.quality.DEFAULT_QUALITY`.

Like `trainplan.costmodels.loss.cache`, a small JSON cache of fitted constants (`QualityFit`s) kept in
costmodels on purpose: the cost models themselves stay pure functions, and these files only
hold the constants they take.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Iterable
from pathlib import Path

from trainplan.costmodels.data.quality import QUALITY_FORM, QualityFit
from trainplan.costmodels.loss.cache import model_file
from trainplan.errors import TrainplanError

QUALITY_CACHE_FORMAT = 1
"""Version of the quality-fit file layout; a file of another version is ignored."""


def quality_path(model: str, vocab_size: int, cache_dir: str | Path | None = None) -> Path:
    """`<cache root>/quality/<model>-v<vocab_size>.json` (the cache root as
    `trainplan.hardware_profiles.cache.cache_root`; characters other than letters, digits, `.`, `_`, `-` in
    the model name become `_`)."""
    return model_file("quality", model, vocab_size, cache_dir)


def save_quality_fits(fits: Iterable[QualityFit] | dict[str, QualityFit], *, model: str,
                      vocab_size: int, corpus: str = "", cache_dir: str | Path | None = None
                      ) -> Path:
    """Cache fitted selection-quality multipliers of (model, vocab_size), atomically, merged
    into the methods already cached; returns the path. `corpus` names the data they were
    fitted on (kept in the file and in each fit's source: a multiplier belongs to its corpus).

    Raises: TrainplanError on a bad model name or vocabulary size."""
    items = list(fits.values()) if isinstance(fits, dict) else list(fits)
    path = quality_path(model, vocab_size, cache_dir)
    known = {f.method: f for f in load_quality_fits(model, vocab_size, cache_dir).values()}
    for f in items:
        src = f.source + (f"; corpus {corpus}" if corpus and corpus not in f.source else "")
        known[f.method] = dataclasses.replace(f, source=src)
    record = {"format": QUALITY_CACHE_FORMAT, "model": model, "vocab_size": int(vocab_size),
              "corpus": corpus, "form": QUALITY_FORM,
              "fits": {m: dataclasses.asdict(f) for m, f in sorted(known.items())}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def load_quality_fits(model: str, vocab_size: int, cache_dir: str | Path | None = None
                      ) -> dict[str, QualityFit]:
    """The cached multipliers of (model, vocab_size) by method; {} when none are cached. A file
    that cannot be read back (corrupt, other format, another model, invalid constants) gives {}
    with a `RuntimeWarning`: planning falls back to the defaults rather than failing."""
    path = quality_path(model, vocab_size, cache_dir)
    if not path.exists():
        return {}
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or record.get("format") != QUALITY_CACHE_FORMAT:
            raise TrainplanError(f"not a quality-fit file of format {QUALITY_CACHE_FORMAT}")
        if record.get("model") != model or record.get("vocab_size") != vocab_size:
            raise TrainplanError(f"written for {record.get('model')!r} "
                                 f"v{record.get('vocab_size')}, not {model!r} v{vocab_size}")
        return {m: QualityFit(**raw) for m, raw in record["fits"].items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError, TrainplanError) as e:
        warnings.warn(f"ignoring cached quality fits {path}: {e}", RuntimeWarning, stacklevel=2)
        return {}
