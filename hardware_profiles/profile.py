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

from trainplan.errors import TrainplanError
from trainplan.hardware_profiles.profile_schema import check_profile

V = TypeVar("V")

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
    "host_memory_bytes",
    "host_link_bandwidth_bytes_per_s",
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


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    """One device type: capacity, peak rates, links and efficiency curves, each with a source.

    Build one with `trainplan.hardware_profiles.load(name)`, or directly: every field is checked against
    the file format, `trainplan.hardware_profiles.profile_schema.ProfileSchema`, which raises
    `TrainplanError` naming the field, its value and what is valid.
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
    host_memory_bytes: int = 0
    """Host (CPU) memory of one node, bytes, shared by its `devices_per_node` devices: where
    activation offload (`trainplan.modeling.offload`) keeps what it copies out. 0: none to offload into.
    On a unified-memory device, the node's unified memory (the same bytes as the devices')."""
    host_link_bandwidth_bytes_per_s: float = 32e9
    """One device's link to host memory, one direction, bytes of payload per second (a copy of n
    bytes to or from host memory takes n / this): nominal, e.g. 32e9 for PCIe 4.0 x16 (the
    default for profiles built in Python), 64e9 for PCIe 5.0 x16. On a unified-memory device,
    a memory-to-memory copy: half the memory bandwidth (the copy reads and writes it)."""
    unified_memory: bool = False
    """The device and its host share one memory (AMD MI300A's HBM; the `cpu` profile, whose
    device is the host): offload to host memory frees no device memory there."""
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
    their optimizer step is the roofline of its traffic (`trainplan.costmodels.step.model`)."""
    sources: Mapping[str, str] = field(default_factory=FrozenMap)
    """Field name (or "peak_flops_per_s.<dtype>") -> where its value comes from; read-only."""

    def __post_init__(self) -> None:
        # one validation, `ProfileSchema`'s; then the checked values, normalised: whole bytes
        # (calibration may give floats), tuples, read-only mappings
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        checked = check_profile(_plain(fields), name="HardwareProfile")
        for f in dataclasses.fields(self):
            value = getattr(checked, f.name)
            if f.name in ("hbm_bytes", "memory_reserve_bytes", "host_memory_bytes"):
                value = int(round(value))
            elif isinstance(value, dict):
                value = FrozenMap(value)
            elif isinstance(value, list):
                value = tuple(tuple(v) if isinstance(v, tuple) else v for v in value)
            object.__setattr__(self, f.name, value)  # frozen: normalise through object.__setattr__

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
        """Inverse of `to_dict` (also reads a parsed TOML profile): the keys of a profile file
        (`trainplan.hardware_profiles.profile_schema.ProfileSchema`).

        Raises `TrainplanError` naming unknown or missing keys, or an invalid value.
        """
        name = data.get("name", "?") if isinstance(data, Mapping) else "?"
        return cls._from_data(data, where=f"hardware profile {name!r}: ")

    @classmethod
    def _from_data(cls, data: Any, *, where: str) -> HardwareProfile:
        checked = check_profile(_plain(data), where=where)
        return cls(**{f.name: getattr(checked, f.name) for f in dataclasses.fields(cls)})

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
        try:
            profile = cls._from_data(data, where=f"{where}: ")
        except TrainplanError as e:
            hint = ("; a profile file gives every key of a shipped profile (`trainplan profiles --template h100` "
                    "writes them)") if ": missing key(s) " in str(e) else ""
            raise TrainplanError(f"{e}{hint}") from None
        missing = profile.missing_sources()
        if missing:
            raise TrainplanError(f"{where}: no source for {', '.join(missing)}; give each a line in its "
                                 f"[sources] table, e.g. \"{missing[0]}\" = \"measured on ...\"")
        return profile


def _plain(value: Any) -> Any:
    """`value` with mappings as dicts and tuples as lists, as a parsed file holds them (what
    `ProfileSchema` reads); anything else as it is."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _calibrated(old: str) -> str:
    return f"calibrated (replaces: {old})" if old else "calibrated"
