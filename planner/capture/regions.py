"""The captured regions of a model by key, sequence-tiled variants traced on first use.

A region key (`trainplan.costmodels.graph.variant_key`) is `{region}[@mp][@m{k}|@l{k}][@a{bits}]`:

- `region`: `head`, `tail` or a block region (`block0`, ...);
- `@mp`: traced under FSDP2's mixed-precision policy (bf16 parameters, no autocast,
  `trainplan.planner.capture.setup.with_mixed_precision_variants`);
- `@m{k}`: a block whose MLP runs over `k` sequence chunks; `@l{k}`: the tail's LM head and loss
  over `k` chunks (`trainplan.modeling.tiling`, ALST's tiled MLP and tiled loss, Bekman et al. 2025,
  arXiv:2506.13996);
- `@a{bits}`: saved activations compressed to `bits` (`trainplan.modeling.activation_compression`).

The untiled regions are traced by `trainplan.planner.capture.graph.capture`. A tiled variant is one trace
per chunk count (the trace unrolls its chunks), so `RegionTable` traces it when a cost model
first asks for it: a plan that never considers tiling never pays for it, and one that does pays
only for the counts it prices.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping

from trainplan.costmodels.graph import Region
from trainplan.errors import TrainplanError

Tracer = Callable[[str, int, int], Region]
"""(region, activation_bits, chunks) -> the region traced so (`RegionTracer.trace`)."""

_KEY = re.compile(r"^(?P<base>[^@]+)(?P<mp>@mp)?(?:@(?P<kind>[ml])(?P<chunks>\d+))?(?:@a(?P<bits>\d+))?$")


def parse_key(key: str) -> tuple[str, bool, int, int]:
    """(region, mixed_precision, activation_bits, chunks) of a region key.

    Raises:
        KeyError: not a region key."""
    m = _KEY.match(key)
    if m is None:
        raise KeyError(key)
    chunks = int(m["chunks"]) if m["chunks"] else 1
    if m["kind"] is not None and (m["kind"] == "l") != (m["base"] == "tail"):
        raise KeyError(key)  # @l is the tail's, @m a block's
    return m["base"], m["mp"] is not None, int(m["bits"]) if m["bits"] else 32, chunks


class RegionTable(Mapping[str, Region]):
    """Regions by key: those captured, plus sequence-tiled variants traced on first lookup by
    the tracer of their precision (`tracers[""]`, `tracers["mp"]`) and kept. Iteration and `len`
    cover the regions traced so far."""

    def __init__(self, regions: Mapping[str, Region], tracers: Mapping[str, Tracer]):
        self._regions = dict(regions)
        self._tracers = dict(tracers)

    def __getitem__(self, key: str) -> Region:
        if key in self._regions:
            return self._regions[key]
        region, mp, bits, chunks = parse_key(key)
        tracer = self._tracers.get("mp" if mp else "")
        if chunks == 1 or tracer is None:
            raise KeyError(key)
        try:
            traced = tracer(region, bits, chunks)
        except TrainplanError as e:
            raise KeyError(f"{key}: {e}") from e
        self._regions[key] = dataclasses.replace(traced, name=key)
        return self._regions[key]

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        try:
            self[key]
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._regions))

    def __len__(self) -> int:
        return len(self._regions)

    def with_variants(self, other: RegionTable, rename: Callable[[str], str], tracer_key: str) -> RegionTable:
        """This table plus `other`'s regions under `rename(key)`, and `other`'s tracer for the
        variants of `tracer_key` (`"mp"`: `trainplan.planner.capture.setup.with_mixed_precision_variants`)."""
        extra = {rename(k): dataclasses.replace(r, name=rename(k)) for k, r in other._regions.items()}
        return RegionTable({**self._regions, **extra},
                           {**self._tracers, tracer_key: other._tracers[""]})
