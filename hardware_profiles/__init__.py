"""Hardware profiles: sourced device numbers for the cost models.

One TOML file per device in this package (a100, a100-40gb, h100, h200, mi300x alias mi300, mi300a), each
number with a unit in its key and a source in its `[sources]` table; plus `cpu`, measured on the
local machine by `trainplan.hardware_profiles.cpu.measure_cpu` and cached there; plus any device's profile
in a file of the same keys, given by its path (`load("./my-gpu.toml")`,
`HardwareProfile.from_file`; `trainplan.hardware_profiles.profile_file` writes such files).

The package's public API is `__all__`: profiles by name (`load`, `known_names`, `list_profiles`,
`describe_profiles`) and the `HardwareProfile` they return (defined in
`trainplan.hardware_profiles.profile`). Measuring and caching the cpu profile is `trainplan.hardware_profiles.cpu`;
the errors raised are `trainplan.errors`'.

    >>> hw = load("mi300")            # by name or alias, any case
    >>> hw.peak("bf16")               # dense FLOP/s
    1307400000000000.0
    >>> hw.usable_bytes               # hbm_bytes - memory_reserve_bytes
    201863462912
"""

from __future__ import annotations

import importlib.resources
import logging as _logging
import tomllib
from typing import Any

from trainplan.errors import TrainplanError, UnknownNameError
from trainplan.hardware_profiles.cpu import load_cpu
from trainplan.hardware_profiles.profile import HardwareProfile

# Import-time warnings of optional kernels trainplan does not use: bitsandbytes' CPU 4-bit GEMM
# (needs the `kernels` package), torchao's CUDA extensions (also imported by transformers'
# quantizers whenever torchao is installed) and torch's pytree notes on torchao's enums. Set
# here, the package every entry point imports first (its own imports load neither torch nor those).
for _name in ("bitsandbytes.backends.cpu.ops", "torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

__all__ = [
    "CPU",
    "HardwareProfile",
    "describe_profiles",
    "known_names",
    "list_profiles",
    "load",
]

CPU = "cpu"
"""Name of the measured local profile."""

_DATASHEET: dict[str, HardwareProfile] | None = None  # name -> profile, read once


def _read_toml_profiles() -> dict[str, HardwareProfile]:
    """Every `*.toml` in this package, checked: name = file stem, a source for every number,
    no name or alias used twice. Raises `TrainplanError` naming the file otherwise."""
    profiles: dict[str, HardwareProfile] = {}
    owner: dict[str, str] = {CPU: CPU}
    files = sorted(
        (f for f in importlib.resources.files(__name__).iterdir() if f.name.endswith(".toml")),
        key=lambda f: f.name,
    )
    for f in files:
        try:
            profile = HardwareProfile.from_dict(tomllib.loads(f.read_text(encoding="utf-8")))
        except (tomllib.TOMLDecodeError, TrainplanError) as err:
            raise TrainplanError(f"hardware profile file {f.name}: {err}") from err
        stem = f.name.removesuffix(".toml")
        if profile.name != stem:
            raise TrainplanError(f"hardware profile file {f.name}: name = {profile.name!r}, expected {stem!r}")
        missing = profile.missing_sources()
        if missing:
            raise TrainplanError(f"hardware profile file {f.name}: no source for {', '.join(missing)}")
        for key in (profile.name, *profile.aliases):
            key = key.lower()
            if key in owner:
                raise TrainplanError(
                    f"hardware profile file {f.name}: name {key!r} is already used by {owner[key]!r}"
                )
            owner[key] = profile.name
        profiles[profile.name] = profile
    return profiles


def _datasheet_profiles() -> dict[str, HardwareProfile]:
    global _DATASHEET
    if _DATASHEET is None:
        _DATASHEET = _read_toml_profiles()
    return _DATASHEET


def _lookup() -> dict[str, str]:
    """Lower-case name or alias -> canonical name (cpu included)."""
    table = {CPU: CPU}
    for profile in _datasheet_profiles().values():
        for key in (profile.name, *profile.aliases):
            table[key.lower()] = profile.name
    return table


def _known_text() -> str:
    parts = []
    for name in sorted([CPU, *_datasheet_profiles()]):
        aliases = _datasheet_profiles()[name].aliases if name != CPU else ()
        if aliases:
            word = "alias" if len(aliases) == 1 else "aliases"
            parts.append(f"{name} ({word} {', '.join(aliases)})")
        else:
            parts.append(name)
    return ", ".join(parts)


def load(name_or_profile: str | HardwareProfile, *, remeasure: bool = False) -> HardwareProfile:
    """The `HardwareProfile` for a name or alias (case-insensitive), or read from a profile file
    when the string ends in `.toml` (`HardwareProfile.from_file`, read at every call); a profile
    passes through.

    "cpu" returns the local machine, measured by `trainplan.hardware_profiles.cpu.measure_cpu` and cached
    per host (see `trainplan.hardware_profiles.cpu`); `remeasure=True` forces a new measurement (other names ignore it).
    Raises `UnknownNameError` listing every known name and alias, e.g.
    "unknown hardware 'h800': known profiles are a100, a100-40gb, cpu, h100, h200, mi300a, mi300x (alias mi300)",
    and `TrainplanError` if a packaged TOML file is invalid, or naming a profile file and what is
    wrong with it (missing, not TOML, a missing or invalid key, a number without a source).
    """
    if isinstance(name_or_profile, HardwareProfile):
        return name_or_profile
    if not isinstance(name_or_profile, str):
        raise TrainplanError(
            f"hardware must be a profile name or HardwareProfile, got {type(name_or_profile).__name__}"
        )
    key = name_or_profile.strip().lower()
    if key.endswith(".toml"):
        return HardwareProfile.from_file(name_or_profile.strip())
    name = _lookup().get(key)
    if name is None:
        hint = ("; a profile file's name ends in .toml (`trainplan profiles --template h100` writes one)"
                if "/" in name_or_profile or "." in name_or_profile.strip() else "")
        raise UnknownNameError(f"unknown hardware {name_or_profile!r}: known profiles are {_known_text()}{hint}")
    if name == CPU:
        return load_cpu(remeasure=remeasure)
    return _datasheet_profiles()[name]


def known_names() -> list[str]:
    """Every name and alias `load` accepts, lower case, sorted (no measurement)."""
    return sorted(_lookup())


def list_profiles(*, include_cpu: bool = True) -> list[HardwareProfile]:
    """All profiles sorted by name; `include_cpu` loads (and if not cached, measures) "cpu"."""
    profiles = list(_datasheet_profiles().values())
    if include_cpu:
        profiles.append(load(CPU))
    return sorted(profiles, key=lambda p: p.name)


def describe_profiles(*, include_cpu: bool = True) -> list[dict[str, Any]]:
    """One row per profile for the `trainplan profiles` table (print with pandas).

    Columns: name, aliases (comma-separated), hbm_gib (GiB), hbm_tb_per_s (1e12 B/s),
    bf16_tflop_per_s and fp32_tflop_per_s (dense, 1e12 FLOP/s; None where the device has no
    such peak), intra_node_gb_per_s and inter_node_gb_per_s (1e9 B/s, per device, one way),
    devices_per_node, source.
    """
    rows = []
    for p in list_profiles(include_cpu=include_cpu):
        peaks = p.peak_flops_per_s
        rows.append({
            "name": p.name,
            "aliases": ", ".join(p.aliases),
            "hbm_gib": round(p.hbm_bytes / 2**30, 1),
            "hbm_tb_per_s": round(p.hbm_bandwidth_bytes_per_s / 1e12, 3),
            "bf16_tflop_per_s": round(peaks["bf16"] / 1e12, 3) if "bf16" in peaks else None,
            "fp32_tflop_per_s": round(peaks["fp32"] / 1e12, 3) if "fp32" in peaks else None,
            "intra_node_gb_per_s": round(p.intra_node_bandwidth_bytes_per_s / 1e9, 1),
            "inter_node_gb_per_s": round(p.inter_node_bandwidth_bytes_per_s / 1e9, 1),
            "devices_per_node": p.devices_per_node,
            "source": p.source,
        })
    return rows
