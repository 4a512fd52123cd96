"""Hardware profiles as TOML files: a profile written in the shipped files' layout (keys with
units, `[peak_flops_per_s]`, `[sources]`), for a device that ships no profile and for the
profiles `trainplan calibrate` refits.

`HardwareProfile.from_file` reads such a file back (the round trip is exact: floats are written
in Python's shortest round-trip form, which TOML 1.0 reads unchanged); `trainplan.hardware_profiles.load`
and every `--hw` option take its path:
`HardwareProfile.from_file(write_profile_file(p, "my-gpu.toml")) == p` for every profile `p`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainplan.errors import OutputPathError
from trainplan.hardware_profiles.profile import HardwareProfile

__all__ = ["TEMPLATE_HEADER", "profile_toml", "template_toml", "write_profile_file"]

TEMPLATE_HEADER = (
    "A trainplan hardware profile (the keys of hardware_profiles/*.toml; units are in the key names).\n"
    "For a device that ships no profile: change name, the numbers and the [sources] line of each\n"
    "number you change (every number needs a source), then plan with\n"
    "  trainplan solve --hw ./THIS-FILE.toml ...\n"
    "The efficiencies (matmul_efficiency, memory_efficiency, network_efficiency), op_overhead_s and\n"
    "memory_reserve_bytes are refit from runs on the device by `trainplan calibrate RUN_DIR --hw ./THIS-FILE.toml`."
)
"""The comment `trainplan profiles --template NAME` puts above the profile."""

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_TABLES = ("peak_flops_per_s", "optimizer_s_per_param", "sources")


def _key(k: str) -> str:
    return k if _BARE_KEY.match(k) else _string(k)


def _string(s: str) -> str:
    """A TOML basic string: JSON's escapes are a subset of TOML's; DEL must be escaped too."""
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # shortest round trip, e.g. 4800000000000.0, 5e-06: both TOML floats
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def profile_toml(profile: HardwareProfile, *, header: str = "") -> str:
    """The TOML text of `profile`: top-level keys in field order, then the tables
    `[peak_flops_per_s]`, `[optimizer_s_per_param]` (when not empty) and `[sources]`; `header`
    becomes `#` comment lines above it."""
    data = profile.to_dict()
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for f in dataclasses.fields(profile):
        if f.name not in _TABLES:
            lines.append(f"{_key(f.name)} = {_value(data[f.name])}")
    for table in _TABLES:
        entries: Mapping[str, Any] = data[table]
        if not entries and table != "sources":
            continue
        lines += ["", f"[{table}]"]
        lines += [f"{_key(str(k))} = {_value(v)}" for k, v in entries.items()]
    return "\n".join(lines) + "\n"


def write_profile_file(profile: HardwareProfile, path: str | Path, *, header: str = "") -> Path:
    """Write `profile_toml(profile, header=header)` to `path` (through a temporary file beside it,
    so a reader never sees half a file); returns the path.

    Raises:
        OutputPathError: the folder is missing or the file cannot be written (named).
    """
    p = Path(path)
    if p.is_dir():
        raise OutputPathError(f"cannot write the profile file {str(p)!r}: it is a folder; give a file path "
                              f"such as {str(p / 'my-gpu.toml')!r}")
    tmp = p.with_name(p.name + ".tmp")
    try:
        tmp.write_text(profile_toml(profile, header=header), encoding="utf-8")
        tmp.replace(p)
    except OSError as e:
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        raise OutputPathError(f"cannot write the profile file {str(p)!r}: {e.strerror or e}; give a path in "
                              "an existing, writable folder") from None
    return p


def template_toml(profile: HardwareProfile) -> str:
    """`profile` as a template to edit for another device: its TOML under `TEMPLATE_HEADER`."""
    return profile_toml(profile, header=TEMPLATE_HEADER)
