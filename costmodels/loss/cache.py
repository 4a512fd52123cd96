"""Locally fitted loss laws, cached as JSON per (model, vocabulary size).

`trainplan calibrate` (`trainplan.executor.calibrate.law`) fits L(D) = E + B / D**beta to the held-out curves
of real runs and writes `<cache root>/laws/<model>-v<vocab_size>.json` (the root:
`trainplan.hardware_profiles.cache.cache_root`); `trainplan.planner.api.solve` reads it back with `load_local_law`
for the
`cpu` profile. Pure: json + `LossLaw`, no torch, so the planner can import it.

File layout (format 1): {"format", "model", "vocab_size", "created", "law": {LossLaw fields},
"fit": {method, points, residuals, ...}, "runs": [...]}; "law" may hold "bits", the fitted
`trainplan.costmodels.loss.bits.BitsPenalty` fields. Only "format", "model", "vocab_size" and "law" are read
back; the rest documents the fit.

The one disk access in `trainplan.costmodels.loss` besides `trainplan.costmodels.data.quality_cache`, kept here on
purpose: the cost models stay pure functions of graph x profile x choice, and these small JSON
files only hold the fitted constants those functions take (a `LossLaw`), read once by the
planner and written by calibration. `model_file` is the layout both share.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

from trainplan.costmodels.loss.bits import BitsPenalty
from trainplan.costmodels.loss.law import LossLaw
from trainplan.errors import TrainplanError
from trainplan.hardware_profiles.cache import cache_root

LAW_CACHE_FORMAT = 1
"""Version of the law file layout; a file of another version is ignored."""

_LAW_FIELDS = ("E", "A", "B", "alpha", "beta", "r_d_star", "r_n_star", "units", "source", "bytes_per_token",
               "vocab_size", "b_crit_tokens", "params_range", "tokens_range", "local", "band_nats",
               "cooldown_gain")


def law_fields(law: LossLaw) -> dict[str, Any]:
    """`law` as JSON-ready fields (ranges as lists, bits as a dict when fitted): what a law file
    and a plan (`trainplan.planner.plan.Predictions.loss_law`) hold."""
    out = {k: (list(v) if isinstance(v := getattr(law, k), tuple) else v) for k in _LAW_FIELDS}
    return out | ({"bits": dataclasses.asdict(law.bits)} if law.bits is not None else {})


def law_from_fields(raw: dict[str, Any]) -> LossLaw:
    """The LossLaw of `law_fields`' output (fields it lacks at their defaults: files written
    before a field existed read back as before).

    Raises: TrainplanError on an invalid constant; KeyError/TypeError on a malformed record."""
    kw = {k: raw[k] for k in _LAW_FIELDS if k in raw}
    for k in ("params_range", "tokens_range"):
        if kw.get(k) is not None:
            kw[k] = tuple(float(x) for x in kw[k])
    bits = BitsPenalty(**raw["bits"]) if isinstance(raw.get("bits"), dict) else None
    return LossLaw(**kw, bits=bits)


def law_path(model: str, vocab_size: int, cache_dir: str | Path | None = None) -> Path:
    """Path of the local law for `model` (preset name) at `vocab_size` tokens:
    `<cache root>/laws/<model>-v<vocab_size>.json` (`model_file`)."""
    return model_file("laws", model, vocab_size, cache_dir)


def model_file(kind: str, model: str, vocab_size: int, cache_dir: str | Path | None = None) -> Path:
    """`<cache root>/<kind>/<model>-v<vocab_size>.json`: a per-(model, vocabulary) cache file
    (characters other than letters, digits, `.`, `_`, `-` in the model name become `_`).

    Raises: TrainplanError on an empty model name or a vocabulary size that is not a whole
    number >= 1."""
    if not isinstance(model, str) or not model.strip():
        raise TrainplanError(f"model must be a non-empty name, got {model!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise TrainplanError(f"vocab_size must be a positive whole number, got {vocab_size!r}")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model.strip())
    return cache_root(cache_dir) / kind / f"{safe}-v{vocab_size}.json"


def save_local_law(law: LossLaw, *, model: str, vocab_size: int, fit: dict[str, Any] | None = None,
                   runs: list[str] | None = None, created: str = "",
                   cache_dir: str | Path | None = None) -> Path:
    """Write `law` as the local law of (model, vocab_size), atomically; returns the path.
    `fit` (inputs, residuals, method) and `runs` are stored alongside for the record."""
    path = law_path(model, vocab_size, cache_dir)
    record = {"format": LAW_CACHE_FORMAT, "model": model, "vocab_size": int(vocab_size),
              "created": created, "law": law_fields(law),
              "fit": fit or {}, "runs": list(runs or [])}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def read_local_law_file(path: str | Path) -> dict[str, Any]:
    """The parsed law file (all of it: law, fit inputs, residuals). Raises `TrainplanError`
    naming the path when it is missing, not JSON or of another format."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TrainplanError(f"cannot read loss law file {str(path)!r}: {e}") from None
    if not isinstance(record, dict) or record.get("format") != LAW_CACHE_FORMAT:
        got = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise TrainplanError(f"{str(path)!r} is not a trainplan loss law of format {LAW_CACHE_FORMAT} "
                             f"(got format {got!r})")
    return record


def load_local_law(model: str, vocab_size: int, cache_dir: str | Path | None = None) -> LossLaw | None:
    """The cached local law of (model, vocab_size), or None when there is none.

    A file that cannot be read back (corrupt, other format, invalid constants, written for
    another model) gives None with a `RuntimeWarning`: planning falls back to the published law
    rather than failing."""
    path = law_path(model, vocab_size, cache_dir)
    if not path.exists():
        return None
    try:
        record = read_local_law_file(path)
        if record.get("model") != model or record.get("vocab_size") != vocab_size:
            raise TrainplanError(f"{str(path)!r} was written for {record.get('model')!r} "
                                 f"v{record.get('vocab_size')}, not {model!r} v{vocab_size}")
        law = law_from_fields(record["law"])
        if "local" not in record["law"]:  # written before the field: every law file is a local fit
            law = dataclasses.replace(law, local=True, params_range=None, tokens_range=None)
        return law
    except (TrainplanError, KeyError, TypeError) as e:
        warnings.warn(f"ignoring local loss law {path}: {e}", RuntimeWarning, stacklevel=2)
        return None

