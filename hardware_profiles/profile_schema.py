"""The hardware profile format, declared once: `ProfileSchema`, a strict pydantic model of the keys of
`hardware_profiles/*.toml` (and of `HardwareProfile.to_dict`), through which every
`HardwareProfile` is validated, built in Python or read from a file; its JSON Schema is
`docs/schemas/hardware_profile.schema.json`.

Strict (pydantic's strict mode): a number is an int or a float, never a bool or a string; whole
numbers are ints; no NaN or infinity. Why pydantic rather than checks by hand:
`trainplan.errors.validation`. Units are in the key names, as in the files.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from trainplan.errors import TrainplanError
from trainplan.errors.validation import one_line

__all__ = ["DEVICE_TYPES", "ProfileSchema", "check_profile"]

DeviceType = Literal["cpu", "cuda", "mps", "xpu"]
DEVICE_TYPES: tuple[str, ...] = get_args(DeviceType)
"""torch device types a profile may name."""

Positive = Annotated[float, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]
"""A share of a peak: in (0, 1]."""


class ProfileSchema(BaseModel):
    """One device type's numbers as a profile file holds them (the fields of `HardwareProfile`,
    documented there). Keys a file may leave out: aliases, vendor, source, unified_memory (false),
    optimizer_s_per_param and sources; the others have no default, so a file gives every number
    of a shipped profile.
    A source for every number is a rule of files (`HardwareProfile.from_file`), not of the
    format."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True,
                              title="trainplan hardware profile")

    name: str = Field(pattern=r"^\S(.*\S)?$")
    aliases: list[Annotated[str, Field(pattern=r"\S")]] = []
    vendor: str = ""
    device_type: DeviceType
    source: str = ""
    hbm_bytes: Positive
    hbm_bandwidth_bytes_per_s: Positive
    peak_flops_per_s: dict[Annotated[str, Field(pattern=r"^[^A-Z]+$")], Positive] = Field(
        min_length=1, json_schema_extra={"additionalProperties": False})  # dtype keys in lower case
    intra_node_bandwidth_bytes_per_s: Positive
    inter_node_bandwidth_bytes_per_s: Positive
    intra_node_latency_s: NonNegative
    inter_node_latency_s: NonNegative
    devices_per_node: int = Field(ge=1)
    memory_reserve_bytes: NonNegative
    host_memory_bytes: NonNegative
    host_link_bandwidth_bytes_per_s: Positive
    unified_memory: bool = False
    matmul_efficiency: list[Annotated[tuple[Positive, Fraction], Field(strict=False)]] = Field(min_length=1)
    memory_efficiency: Fraction
    network_efficiency: Fraction
    op_overhead_s: NonNegative
    optimizer_s_per_param: dict[Literal["32", "16", "8", "4"], Positive] = {}
    sources: dict[str, str] = {}

    @field_validator("memory_reserve_bytes")
    @classmethod
    def _below_capacity(cls, v: float, info: ValidationInfo) -> float:
        hbm = info.data.get("hbm_bytes")
        if hbm is not None and v >= hbm:
            raise ValueError(f"must be < hbm_bytes ({hbm:.0f})")
        return v

    @field_validator("matmul_efficiency")
    @classmethod
    def _increasing(cls, v: list[tuple[float, float]]) -> list[tuple[float, float]]:
        if any(b[0] <= a[0] for a, b in zip(v, v[1:], strict=False)):
            raise ValueError("must list [op_flops, efficiency] pairs with op_flops strictly increasing")
        return v


def check_profile(data: Any, *, name: str = "", where: str = "") -> ProfileSchema:
    """`data` (a parsed profile file, or a profile's fields as plain lists and dicts) validated.

    Raises:
        TrainplanError: `where` followed by one line naming the first bad key (as `name.key`
            when `name` is given), its value and what is valid, or the unknown or missing keys.
    """
    try:
        return ProfileSchema.model_validate(data)
    except ValidationError as e:
        raise TrainplanError(f"{where}{one_line(e, ProfileSchema, name=name)}") from None
