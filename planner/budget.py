"""`Budget`: how much compute a plan may spend, on how many devices."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from hardware_profiles.errors import TrainplanError


@dataclass(frozen=True, kw_only=True, slots=True)
class Budget:
    """Compute budget: exactly one of device-hours, wall-clock seconds or FLOPs, and a device
    count.

    Raises:
        TrainplanError: none or several limits given, or a limit that is not a positive finite
            number, or devices < 1.
    """

    devices: int = 1
    """Devices the run may use."""
    device_hours: float | None = None
    """Device-hours (devices x wall-clock hours)."""
    wall_clock_s: float | None = None
    """Wall-clock seconds of training."""
    flops: float | None = None
    """FLOPs executed over all devices, recompute included."""

    def __post_init__(self) -> None:
        if not isinstance(self.devices, int) or isinstance(self.devices, bool) or self.devices < 1:
            raise TrainplanError(f"devices={self.devices!r} must be a whole number >= 1")
        given = {k: v for k, v in (("device_hours", self.device_hours),
                                   ("wall_clock_s", self.wall_clock_s), ("flops", self.flops))
                 if v is not None}
        if len(given) != 1:
            raise TrainplanError(
                "give exactly one budget limit: device_hours, wall_clock_s or flops "
                f"(got {', '.join(given) or 'none'})")
        (name, value), = given.items()
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise TrainplanError(f"budget {name}={value!r} must be a positive finite number")

    @property
    def kind(self) -> str:
        return "device_hours" if self.device_hours is not None else (
            "wall_clock_s" if self.wall_clock_s is not None else "flops")

    def wall_s_for(self, devices_used: int) -> float | None:
        """Wall-clock seconds available when `devices_used` devices run (None for a FLOP
        budget)."""
        if self.device_hours is not None:
            return self.device_hours * 3600.0 / devices_used
        return self.wall_clock_s

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}
