"""`HardwareProfile`: one device's sourced numbers and efficiency curves, as a frozen value.

Units are in the field names (`_bytes`, `_flops_per_s`, `_bytes_per_s`, `_s`). Peaks are dense
(not sparse) datasheet figures; the efficiency curves turn a peak into an expected achieved rate
(Calculon's approach: Isaev et al. 2023, "Calculon: a methodology and tool for high-level
co-design of systems and large language models", systems files `matrix.gflops_efficiency`).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from trainplan_errors import TrainplanError

V = TypeVar("V")

#: torch device types a profile may name.
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")

#: Other spellings of the dtype keys of `peak_flops_per_s` accepted by `HardwareProfile.peak`.
DTYPE_SYNONYMS = {
    "float32": "fp32",
    "float": "fp32",
    "tensorfloat32": "tf32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "e4m3": "fp8",
    "e5m2": "fp8",
}

#: Fields holding a number that needs a source in `sources` (the TOML loader checks this);
#: each dtype of `peak_flops_per_s` needs its own key `peak_flops_per_s.<dtype>`.
NUMERIC_FIELDS = (
    "hbm_bytes",
    "hbm_bandwidth_bytes_per_s",
    "intra_node_bandwidth_bytes_per_s",
    "inter_node_bandwidth_bytes_per_s",
    "intra_node_latency_s",
    "inter_node_latency_s",
    "devices_per_node",
    "memory_reserve_bytes",
    "matmul_efficiency",
    "memory_efficiency",
    "network_efficiency",
    "op_overhead_s",
)


class FrozenMap(Mapping[str, V]):
    """A read-only, hashable mapping (so a `HardwareProfile` can be hashed and cached)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, V] | None = None) -> None:
        self._data: dict[str, V] = dict(data or {})

    def __getitem__(self, key: str) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


def _bad(field_name: str, value: Any, want: str) -> TrainplanError:
    return TrainplanError(f"HardwareProfile.{field_name} = {value!r}: {want}")


def _number(field_name: str, value: Any, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(field_name, value, "must be a finite number")
    if positive and value <= 0:
        raise _bad(field_name, value, "must be > 0")
    if not positive and value < 0:
        raise _bad(field_name, value, "must be >= 0")
    return value


def _fraction(field_name: str, value: Any) -> float:
    value = _number(field_name, value)
    if value > 1:
        raise _bad(field_name, value, "must be in (0, 1]")
    return float(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    """One device type: capacity, peak rates, links and efficiency curves, each with a source.

    Build one with `hardware_profiles.load(name)`, or directly (all numbers checked in
    `__post_init__`, which raises `TrainplanError` naming the field and its value).
    """

    name: str
    """Canonical lower-case name, e.g. "h100"."""
    aliases: tuple[str, ...] = ()
    """Other names `load` accepts, e.g. ("mi300",)."""
    vendor: str = ""
    """Maker: "nvidia", "amd" or, for the measured local profile, the CPU's vendor."""
    device_type: str = "cuda"
    """torch device type: "cuda" for NVIDIA and for AMD under ROCm, "cpu" for the cpu profile."""
    source: str = ""
    """One-line summary of where the numbers come from (per-number sources are in `sources`)."""
    hbm_bytes: int
    """Device memory capacity, bytes (binary: the datasheet's "80GB" is 80 GiB)."""
    hbm_bandwidth_bytes_per_s: float
    """Peak device-memory bandwidth, bytes/s."""
    peak_flops_per_s: Mapping[str, float]
    """Dense peak FLOP/s by dtype key (fp32, tf32, bf16, fp16, fp8); read-only."""
    intra_node_bandwidth_bytes_per_s: float
    """Per device, one direction, inside a node (NVLink / Infinity Fabric), bytes/s."""
    inter_node_bandwidth_bytes_per_s: float
    """Per device, one direction, between nodes (NIC share of one device), bytes/s."""
    intra_node_latency_s: float = 0.0
    """Startup latency of one collective step inside a node, s."""
    inter_node_latency_s: float = 0.0
    """Startup latency of one collective step between nodes, s."""
    devices_per_node: int = 8
    """Devices sharing the fast intra-node links."""
    memory_reserve_bytes: int = 0
    """Bytes per device not available to tensors (runtime context, communication buffers,
    allocator fragmentation, memory the driver does not expose)."""
    matmul_efficiency: tuple[tuple[float, float], ...] = ((1.0, 1.0),)
    """(op FLOPs, achieved fraction of peak) points, sorted by op FLOPs; interpolated in
    log10(op FLOPs) by `matmul_efficiency_at`."""
    memory_efficiency: float = 1.0
    """Achieved fraction of `hbm_bandwidth_bytes_per_s` for elementwise (memory-bound) ops."""
    network_efficiency: float = 1.0
    """Achieved fraction of link bandwidth for collectives."""
    op_overhead_s: float = 0.0
    """Seconds each eager op costs beyond its roofline time (dispatch, autograd bookkeeping,
    kernel launch), s."""
    optimizer_s_per_param: Mapping[str, float] = field(default_factory=FrozenMap)
    """Measured seconds per parameter of one optimizer step, by optimizer bits ("32", "8"),
    where the optimizer's implementation on this device is not the memory-bound kernel the
    roofline assumes (bitsandbytes' 8-bit AdamW on a CPU runs unfused torch code, ~6-10x the
    time of 32-bit AdamW's traffic; measured by `measure_cpu`). Empty for the GPU profiles:
    their optimizer step is the roofline of its traffic (`costmodels.step.model`)."""
    sources: Mapping[str, str] = field(default_factory=FrozenMap)
    """Field name (or "peak_flops_per_s.<dtype>") -> where its value comes from; read-only."""

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__  # frozen: normalise through object.__setattr__
        if not isinstance(self.name, str) or not self.name.strip() or self.name != self.name.strip():
            raise _bad("name", self.name, "must be a non-empty string without surrounding spaces")
        aliases: tuple[object, ...]
        try:
            aliases = (self.aliases,) if isinstance(self.aliases, str) else tuple(self.aliases)
        except TypeError:
            aliases = (None,)
        if not all(isinstance(a, str) and a.strip() for a in aliases):
            raise _bad("aliases", self.aliases, "must be a list of non-empty strings")
        setattr_(self, "aliases", aliases)
        if not isinstance(self.vendor, str):
            raise _bad("vendor", self.vendor, "must be a string")
        if self.device_type not in DEVICE_TYPES:
            raise _bad("device_type", self.device_type, f"must be one of {', '.join(DEVICE_TYPES)}")
        if not isinstance(self.source, str):
            raise _bad("source", self.source, "must be a string")

        for name in ("hbm_bytes", "memory_reserve_bytes"):
            value = _number(name, getattr(self, name), positive=name == "hbm_bytes")
            setattr_(self, name, int(round(value)))  # bytes are whole; calibration may give floats
        if self.memory_reserve_bytes >= self.hbm_bytes:
            raise _bad(
                "memory_reserve_bytes", self.memory_reserve_bytes,
                f"must be < hbm_bytes ({self.hbm_bytes})",
            )
        for name in ("hbm_bandwidth_bytes_per_s", "intra_node_bandwidth_bytes_per_s",
                     "inter_node_bandwidth_bytes_per_s"):
            setattr_(self, name, float(_number(name, getattr(self, name))))
        for name in ("intra_node_latency_s", "inter_node_latency_s"):
            setattr_(self, name, float(_number(name, getattr(self, name), positive=False)))
        dpn = self.devices_per_node
        if isinstance(dpn, bool) or not isinstance(dpn, int) or dpn < 1:
            raise _bad("devices_per_node", dpn, "must be an integer >= 1")
        for name in ("memory_efficiency", "network_efficiency"):
            setattr_(self, name, _fraction(name, getattr(self, name)))

        if not isinstance(self.peak_flops_per_s, Mapping) or not self.peak_flops_per_s:
            raise _bad("peak_flops_per_s", self.peak_flops_per_s, "must be a non-empty mapping dtype -> FLOP/s")
        peaks = {}
        for dtype, value in self.peak_flops_per_s.items():
            if not isinstance(dtype, str) or dtype != dtype.lower():
                raise _bad("peak_flops_per_s", dict(self.peak_flops_per_s), f"dtype key {dtype!r} must be lower case")
            peaks[dtype] = float(_number(f"peak_flops_per_s[{dtype!r}]", value))
        setattr_(self, "peak_flops_per_s", FrozenMap(peaks))

        setattr_(self, "matmul_efficiency", self._checked_curve(self.matmul_efficiency))

        if not isinstance(self.optimizer_s_per_param, Mapping):
            raise _bad("optimizer_s_per_param", self.optimizer_s_per_param,
                       "must be a mapping optimizer bits (\"32\", \"8\") -> seconds per parameter")
        rates = {}
        for bits, value in self.optimizer_s_per_param.items():
            if str(bits) not in ("32", "16", "8", "4"):
                raise _bad("optimizer_s_per_param", dict(self.optimizer_s_per_param),
                           f"key {bits!r} must be optimizer bits 32, 16, 8 or 4")
            rates[str(bits)] = float(_number(f"optimizer_s_per_param[{bits!r}]", value))
        setattr_(self, "optimizer_s_per_param", FrozenMap(rates))

        if not isinstance(self.sources, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.sources.items()
        ):
            raise _bad("sources", self.sources, "must be a mapping of field name -> source string")
        setattr_(self, "sources", FrozenMap(self.sources))

    @staticmethod
    def _checked_curve(curve: Any) -> tuple[tuple[float, float], ...]:
        try:
            points = tuple((p[0], p[1]) for p in curve if len(p) == 2)
            ok = len(points) == len(curve) and len(points) > 0
        except (TypeError, IndexError, KeyError):
            ok = False
        if not ok:
            raise _bad("matmul_efficiency", curve, "must be a non-empty list of [op_flops, efficiency] pairs")
        out = []
        for op_flops, eff in points:
            out.append((float(_number("matmul_efficiency op_flops", op_flops)),
                        _fraction("matmul_efficiency efficiency", eff)))
        if any(b[0] <= a[0] for a, b in zip(out, out[1:], strict=False)):
            raise _bad("matmul_efficiency", curve, "op_flops must be strictly increasing")
        return tuple(out)

    # ---------------------------------------------------------------- queries

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype` ("bf16", "fp32", ...; also "bfloat16", "torch.float16").

        Raises `TrainplanError` listing this profile's dtypes when it has no peak for `dtype`
        (e.g. fp8 on an A100, which has no fp8 tensor cores).
        """
        key = str(dtype).lower().removeprefix("torch.")
        key = DTYPE_SYNONYMS.get(key, key)
        try:
            return self.peak_flops_per_s[key]
        except KeyError:
            known = ", ".join(sorted(self.peak_flops_per_s))
            raise TrainplanError(
                f"hardware {self.name!r} has no peak for dtype {dtype!r}: known dtypes are {known}"
            ) from None

    def matmul_efficiency_at(self, op_flops: float) -> float:
        """Expected achieved fraction of peak for one GEMM of `op_flops` FLOPs.

        Piecewise-linear in log10(op_flops) between the `matmul_efficiency` points, clamped to
        the first/last point outside them (and for op_flops <= 0). Raises `TrainplanError`
        for a NaN or infinite `op_flops`.
        """
        if not isinstance(op_flops, (int, float)) or not math.isfinite(op_flops):
            raise TrainplanError(f"op_flops = {op_flops!r}: must be a finite number")
        curve = self.matmul_efficiency
        if op_flops <= curve[0][0]:
            return curve[0][1]
        if op_flops >= curve[-1][0]:
            return curve[-1][1]
        i = bisect.bisect_right([p[0] for p in curve], op_flops)
        (x0, y0), (x1, y1) = curve[i - 1], curve[i]
        t = (math.log10(op_flops) - math.log10(x0)) / (math.log10(x1) - math.log10(x0))
        return y0 + t * (y1 - y0)

    @property
    def usable_bytes(self) -> int:
        """Bytes per device available to tensors: hbm_bytes - memory_reserve_bytes."""
        return self.hbm_bytes - self.memory_reserve_bytes

    def missing_sources(self) -> list[str]:
        """Numeric fields (and "peak_flops_per_s.<dtype>" keys) without an entry in `sources`."""
        keys = list(NUMERIC_FIELDS) + [f"peak_flops_per_s.{d}" for d in self.peak_flops_per_s]
        return [k for k in keys if not self.sources.get(k, "").strip()]

    # ---------------------------------------------------------------- derived profiles

    def with_calibration(self, **fields: Any) -> HardwareProfile:
        """A copy with `fields` replaced (`dataclasses.replace`), e.g. refit efficiencies.

        Each replaced field's source becomes "calibrated (replaces: <old source>)" unless
        `sources=` is also given, whose entries are merged over the old ones. Raises
        `TrainplanError` for an unknown field name or an invalid value.
        """
        valid = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(fields) - valid)
        if unknown:
            raise TrainplanError(
                f"with_calibration: unknown field(s) {', '.join(unknown)}; fields are {', '.join(sorted(valid))}"
            )
        sources = dict(self.sources)
        for name in fields:
            if name in ("sources", "name", "aliases"):
                continue
            if name == "peak_flops_per_s":  # only the dtypes whose value changed
                for dtype, value in dict(fields[name]).items():
                    key = f"peak_flops_per_s.{dtype}"
                    if self.peak_flops_per_s.get(dtype) != value:
                        sources[key] = _calibrated(self.sources.get(key, ""))
            else:
                sources[name] = _calibrated(self.sources.get(name, ""))
        sources.update(fields.pop("sources", {}) or {})
        return dataclasses.replace(self, sources=sources, **fields)

    # ---------------------------------------------------------------- serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable dict (lists for tuples, dicts for mappings)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Mapping):
                value = dict(value)
            elif f.name == "matmul_efficiency":
                value = [list(p) for p in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HardwareProfile:
        """Inverse of `to_dict` (also reads a parsed TOML profile).

        Raises `TrainplanError` naming unknown or missing keys, or an invalid value.
        """
        if not isinstance(data, Mapping):
            raise TrainplanError(f"hardware profile must be a mapping, got {type(data).__name__}")
        fields_ = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields_))
        if unknown:
            raise TrainplanError(
                f"hardware profile {data.get('name', '?')!r}: unknown key(s) {', '.join(unknown)}; "
                f"valid keys are {', '.join(fields_)}"
            )
        missing = sorted(
            n for n, f in fields_.items()
            if n not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        if missing:
            raise TrainplanError(
                f"hardware profile {data.get('name', '?')!r}: missing key(s) {', '.join(missing)}"
            )
        return cls(**dict(data))

    @classmethod
    def from_file(cls, path: str | Path) -> HardwareProfile:
        """Read a profile from a TOML file with the shipped files' keys (`hardware_profiles/h100.toml`;
        `trainplan profiles --template h100` prints one), a source for every number in `[sources]`.

        Raises `TrainplanError` naming the file and what is wrong: missing or unreadable, not
        TOML (with the parser's line), an unknown or missing key (with the valid ones), an invalid
        value (with what is valid), or numbers without a source.
        """
        where = f"hardware profile file {str(path)!r}"
        p = Path(path)
        if not p.is_file():
            raise TrainplanError(f"{where} does not exist or is not a file; give a .toml file with a shipped "
                                 "profile's keys (`trainplan profiles --template h100 > my-gpu.toml`)")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise TrainplanError(f"{where} cannot be read: {getattr(e, 'strerror', None) or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise TrainplanError(f"{where} is not valid TOML: {e}") from None
        optional = ("aliases", "vendor", "source", "optimizer_s_per_param", "sources")  # a shipped file's keys:
        if absent := [f.name for f in dataclasses.fields(cls) if f.name not in optional and f.name not in data]:
            raise TrainplanError(f"{where}: missing key(s) {', '.join(absent)}; a profile file gives every "
                                 "key of a shipped profile (`trainplan profiles --template h100` writes them)")
        try:
            profile = cls.from_dict(data)
        except TrainplanError as e:
            raise TrainplanError(f"{where}: {e}") from None
        missing = profile.missing_sources()
        if missing:
            raise TrainplanError(f"{where}: no source for {', '.join(missing)}; give each a line in its "
                                 f"[sources] table, e.g. \"{missing[0]}\" = \"measured on ...\"")
        return profile


def _calibrated(old: str) -> str:
    return f"calibrated (replaces: {old})" if old else "calibrated"
