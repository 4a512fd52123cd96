"""Collective communication time (alpha-beta model) and the bytes that SP and ZeRO move.

Time of a collective over n ranks on a link of bandwidth bw (bytes/s per device, one direction,
times the achieved `efficiency`) and per-message latency a, for the ring / pairwise algorithms
NCCL uses at large sizes:

| collective      | time (s)                                    | nbytes means                   |
|-----------------|---------------------------------------------|--------------------------------|
| all-reduce      | 2 (n-1)/n * nbytes / bw + 2 (n-1) a         | the buffer every rank holds    |
| all-gather      | (n-1)/n * nbytes / bw + (n-1) a             | the full, gathered buffer      |
| reduce-scatter  | (n-1)/n * nbytes / bw + (n-1) a             | the full, unscattered buffer   |
| all-to-all      | (n-1)/n * nbytes / bw + (n-1) a             | each rank's send buffer        |

Sources: Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in
MPICH" (IJHPCA 19(1)): the cost model (a message of n bytes costs a + n b) and its analyses of the
ring allgather ((p-1) a + (p-1)/p n b), reduce-scatter (same bandwidth term), allreduce as
reduce-scatter then allgather (Rabenseifner; bandwidth term 2 (p-1)/p n b) and the pairwise-exchange
alltoall ((p-1) a + (p-1)/p n b, n the per-rank buffer); NCCL tests, doc/PERFORMANCE.md ("bus
bandwidth"): algorithm-to-bus bandwidth factors 2(n-1)/n for all-reduce and (n-1)/n for all-gather,
reduce-scatter, all-to-all. The ring latency term (n-1 or 2(n-1) hops) is pessimistic for NCCL's
tree/NVLS algorithms at small sizes; `Link.latency_s` is fitted, so it absorbs the difference.

Time and bytes sent only; the memory the Ulysses exchanges take (send and receive buffers, the copy
each block keeps for `o_proj`) is `trainplan.costmodels.step.ulysses`'.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar

from trainplan.errors import TrainplanError

#: Factor on nbytes for the bytes each rank sends, relative to (n-1)/n (Thakur et al. 2005;
#: NCCL tests PERFORMANCE.md bus-bandwidth factors).
_VOLUME_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}

#: Backward repeats the forward's four Ulysses all-to-alls on the gradients (Jacobs et al. 2023,
#: Sec. 3): fwd + bwd = 2x the forward bytes. Recomputing attention under activation
#: checkpointing adds one more forward pass (3x).
ULYSSES_PER_STEP_FACTOR = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """One interconnect level as the alpha-beta model sees it."""

    bandwidth_bytes_per_s: float
    """Peak bandwidth per device, one direction, bytes/s (e.g. NVLink 4: 450e9 of the quoted
    900 GB/s bidirectional)."""
    latency_s: float
    """Per-message (per ring step) latency, seconds."""
    efficiency: float = 1.0
    """Fraction of the peak bandwidth achieved, in (0, 1]; measured bus bandwidth / peak."""

    def __post_init__(self) -> None:
        bw = self.bandwidth_bytes_per_s
        if _real_non_negative("Link.bandwidth_bytes_per_s", bw) == 0:
            raise TrainplanError(f"Link.bandwidth_bytes_per_s must be > 0, got {bw!r}")
        _real_non_negative("Link.latency_s", self.latency_s)
        eff = self.efficiency
        if isinstance(eff, bool) or not isinstance(eff, numbers.Real) or not 0 < eff <= 1:
            raise TrainplanError(f"Link.efficiency must be in (0, 1], got {eff!r}")

    @property
    def achieved_bytes_per_s(self) -> float:
        """bandwidth_bytes_per_s * efficiency, bytes/s."""
        return self.bandwidth_bytes_per_s * self.efficiency


def _int_at_least_1(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise TrainplanError(f"{name} must be an integer >= 1, got {v!r}")
    return int(v)


def _real_non_negative(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
        raise TrainplanError(f"{name} must be a finite number >= 0, got {v!r}")
    return float(v)


def _check(nbytes: float, n: int) -> tuple[float, int]:
    return _real_non_negative("nbytes", nbytes), _int_at_least_1("n (ranks)", n)


def _ring_s(nbytes: float, n: int, link: Link, factor: float) -> float:
    b, n = _check(nbytes, n)
    if n == 1 or b == 0:
        return 0.0
    return factor * (n - 1) / n * b / link.achieved_bytes_per_s + factor * (n - 1) * link.latency_s


def all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds for a ring all-reduce of a buffer of `nbytes` bytes held by each of `n` ranks.

    2 (n-1)/n * nbytes / bw + 2 (n-1) * latency: ring reduce-scatter then ring all-gather
    (Thakur et al. 2005, allreduce; NCCL tests PERFORMANCE.md, all-reduce bus factor 2(n-1)/n).
    n == 1 or nbytes == 0 -> 0.0 (no collective is issued).
    Raises: TrainplanError if n < 1, n not an integer, or nbytes negative / non-finite.
    """
    return _ring_s(nbytes, n, link, 2.0)


def all_gather_s(nbytes_total: float, n: int, link: Link) -> float:
    """Seconds for a ring all-gather whose *gathered* buffer is `nbytes_total` bytes (each rank
    contributes nbytes_total / n).

    (n-1)/n * nbytes_total / bw + (n-1) * latency (Thakur et al. 2005, ring allgather; NCCL tests
    PERFORMANCE.md, factor (n-1)/n). n == 1 or nbytes_total == 0 -> 0.0.
    Raises: TrainplanError as `all_reduce_s`.
    """
    return _ring_s(nbytes_total, n, link, 1.0)


def reduce_scatter_s(nbytes_total: float, n: int, link: Link) -> float:
    """Seconds for a ring reduce-scatter of a full buffer of `nbytes_total` bytes per rank (each
    rank keeps nbytes_total / n reduced).

    (n-1)/n * nbytes_total / bw + (n-1) * latency (Thakur et al. 2005, reduce-scatter; NCCL tests
    PERFORMANCE.md, factor (n-1)/n). n == 1 or nbytes_total == 0 -> 0.0.
    Raises: TrainplanError as `all_reduce_s`.
    """
    return _ring_s(nbytes_total, n, link, 1.0)


def all_to_all_s(nbytes_per_rank: float, n: int, link: Link) -> float:
    """Seconds for an all-to-all where each rank's send buffer is `nbytes_per_rank` bytes, split
    in n equal parts, of which (n-1) leave the rank.

    (n-1)/n * nbytes_per_rank / bw + (n-1) * latency: pairwise exchange, n-1 steps (Thakur et al.
    2005, pairwise-exchange alltoall; NCCL tests PERFORMANCE.md, factor (n-1)/n). Assumes a full-bisection
    link (true within an NVLink/xGMI node). n == 1 or nbytes_per_rank == 0 -> 0.0.
    Raises: TrainplanError as `all_reduce_s`.
    """
    return _ring_s(nbytes_per_rank, n, link, 1.0)


_TIME_FN = {
    "all_reduce": all_reduce_s,
    "all_gather": all_gather_s,
    "reduce_scatter": reduce_scatter_s,
    "all_to_all": all_to_all_s,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One collective call: its kind, its buffer size and its group size."""

    kind: str
    """"all_reduce", "all_gather", "reduce_scatter" or "all_to_all"."""
    nbytes: float
    """Buffer size in bytes, with the meaning of the matching `*_s` function's first argument
    (full buffer for all-reduce / all-gather / reduce-scatter, send buffer for all-to-all)."""
    n_ranks: int
    """Ranks in the group."""

    KINDS: ClassVar[tuple[str, ...]] = tuple(_TIME_FN)

    def __post_init__(self) -> None:
        if self.kind not in _TIME_FN:
            raise TrainplanError(f"Collective.kind={self.kind!r}; valid: {list(_TIME_FN)}")
        _check(self.nbytes, self.n_ranks)

    def time_s(self, link: Link) -> float:
        """Seconds on `link`, by the matching alpha-beta formula above."""
        return _TIME_FN[self.kind](self.nbytes, self.n_ranks, link)

    @property
    def sent_bytes(self) -> float:
        """Bytes each rank sends: factor * (n-1)/n * nbytes, factor 2 for all-reduce, else 1
        (Thakur et al. 2005; the "volume" of Rajbhandari et al. 2020, Sec. 7)."""
        if self.n_ranks == 1:
            return 0.0
        return _VOLUME_FACTOR[self.kind] * (self.n_ranks - 1) / self.n_ranks * self.nbytes


def _divisors(x: int) -> list[int]:
    return [p for p in range(1, x + 1) if x % p == 0]


def _kv_ok(p: int, n_kv_heads: int) -> bool:
    return n_kv_heads % p == 0 if n_kv_heads >= p else p % n_kv_heads == 0


def valid_sp_degrees(seq_len: int, n_heads: int, n_kv_heads: int) -> list[int]:
    """Ulysses degrees P that fit a model: P divides seq_len and n_heads, and either divides
    n_kv_heads (P <= n_kv_heads) or is a multiple of it (K/V heads replicated; Jacobs et al.
    2023). Returns the sorted list; always contains 1.
    Raises: TrainplanError on non-positive sizes or n_heads not a multiple of n_kv_heads.
    """
    seq_len = _int_at_least_1("seq_len", seq_len)
    n_heads = _int_at_least_1("n_heads", n_heads)
    n_kv_heads = _int_at_least_1("n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise TrainplanError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads} (GQA)")
    return [p for p in _divisors(math.gcd(seq_len, n_heads)) if _kv_ok(p, n_kv_heads)]


def sp_degrees_within_node(degrees, *, devices: int, devices_per_node: int) -> list[int]:
    """The SP degrees of `degrees` whose groups stay inside one node: SP inside a node, data
    parallelism (and ZeRO sharding) across nodes.

    A run of `devices` ranks fills nodes of `devices_per_node` in rank order, and SP groups are
    consecutive ranks. When the run fits in one node (devices <= devices_per_node) every degree
    qualifies; otherwise a degree must divide `devices_per_node`, so that each node holds whole
    SP groups (Ulysses all-to-alls on the intra-node link, NVLink / Infinity Fabric; Jacobs et
    al. 2023 place SP groups the same way). Degrees that also divide `devices` are the caller's
    concern. Returns them sorted.
    Raises: TrainplanError if devices or devices_per_node is not an integer >= 1.
    """
    devices = _int_at_least_1("devices", devices)
    per_node = _int_at_least_1("devices_per_node", devices_per_node)
    return sorted(p for p in degrees if devices <= per_node or per_node % p == 0)


def nodes_for(devices: int, devices_per_node: int) -> int:
    """Nodes a run of `devices` ranks occupies: ceil(devices / devices_per_node).
    Raises: TrainplanError if either is not an integer >= 1."""
    devices = _int_at_least_1("devices", devices)
    return -(-devices // _int_at_least_1("devices_per_node", devices_per_node))


def ulysses_all_to_all_bytes(
    *,
    micro_batch: int,
    seq_len: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    sp_degree: int,
    bytes_per_element: float,
) -> dict[str, float]:
    """Per-rank send-buffer bytes of each forward all-to-all of one attention layer under
    DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling
    Training of Extreme Long Sequence Transformer Models", arXiv:2309.14509, Sec. 3).

    Before attention, q, k, v go from a sequence shard to a head shard; after it, out goes back.
    With b = micro_batch, s = seq_len, P = sp_degree, d = head_dim, each rank's buffers are
    (elements): q and out: b * (s/P) * n_heads * d; k and v: b * (s/P) * max(n_kv_heads, P) * d,
    because with GQA and n_kv_heads < P every rank needs at least one K/V head, so K/V are
    replicated up to P heads before the exchange (a convention of later Ulysses GQA
    implementations; Jacobs et al. 2023 assume P divides every head count). Pass each value to `all_to_all_s`, which
    charges the (P-1)/P that leaves the rank. Backward repeats the four (gradients): see
    `ulysses_comm_bytes_per_layer` and ULYSSES_PER_STEP_FACTOR.

    Returns: {"q", "k", "v", "out"} -> bytes. P == 1 gives the same buffers (time is 0).
    Raises: TrainplanError if P does not divide seq_len or n_heads, if P <= n_kv_heads and does
    not divide it, or P > n_kv_heads and is not a multiple of it; the message names both numbers
    and the valid degrees. Also on non-positive sizes.
    """
    micro_batch = _int_at_least_1("micro_batch", micro_batch)
    head_dim = _int_at_least_1("head_dim", head_dim)
    p = _int_at_least_1("sp_degree", sp_degree)
    if _real_non_negative("bytes_per_element", bytes_per_element) == 0:
        raise TrainplanError(f"bytes_per_element must be > 0, got {bytes_per_element!r}")
    valid = valid_sp_degrees(seq_len, n_heads, n_kv_heads)
    seq_len, n_heads, n_kv_heads = int(seq_len), int(n_heads), int(n_kv_heads)
    for name, value in (("seq_len", seq_len), ("n_heads", n_heads)):
        if value % p:
            raise TrainplanError(
                f"sp_degree={p} does not divide {name}={value}; valid sp_degree: {valid}"
            )
    if not _kv_ok(p, n_kv_heads):
        rel = "divide" if n_kv_heads >= p else "be a multiple of"
        raise TrainplanError(
            f"sp_degree={p} must {rel} n_kv_heads={n_kv_heads}; valid sp_degree: {valid}"
        )
    tokens_local = micro_batch * (seq_len // p)
    q = tokens_local * n_heads * head_dim * bytes_per_element
    kv = tokens_local * max(n_kv_heads, p) * head_dim * bytes_per_element
    return {"q": float(q), "k": float(kv), "v": float(kv), "out": float(q)}


def ulysses_comm_bytes_per_layer(*, backward: bool = True, **shape: Any) -> float:
    """Total per-rank all-to-all send-buffer bytes of one attention layer per micro-batch:
    the four forward all-to-alls (`ulysses_all_to_all_bytes`), times 2 when `backward`
    (the backward pass runs the same four on gradients; Jacobs et al. 2023, Sec. 3).

    Add one more forward (x3 in total) when attention is recomputed by activation checkpointing.
    Keyword arguments: those of `ulysses_all_to_all_bytes`.
    Returns: bytes; time = all_to_all_s(bytes, sp_degree, link) since all four share a group.
    Raises: as `ulysses_all_to_all_bytes`.
    """
    fwd = sum(ulysses_all_to_all_bytes(**shape).values())
    return fwd * (ULYSSES_PER_STEP_FACTOR if backward else 1)


def zero_comm_bytes(
    n_params: float,
    *,
    stage: int,
    dp_degree: int,
    grad_bytes_per_param: float,
    param_bytes_per_param: float,
) -> dict[str, Collective]:
    """Collectives one rank issues per optimizer step for data parallelism with ZeRO.

    Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
    Models" (SC20; arXiv:1910.02054), Sec. 7 (with Psi = n_params):
    - stage 0 (plain DP): all-reduce of the gradients, volume 2 Psi (Sec. 7.1).
    - stage 1 and 2: reduce-scatter of the gradients, then all-gather of the updated parameters
      after the step: also 2 Psi (Sec. 7.2.1: P_os and P_os+g add no communication). Stage 1 is
      grouped with stage 2, not stage 0: each rank updates only its optimizer shard, so the
      updated parameters must be gathered either way.
    - stage 3 (FSDP): all-gather of the parameters in forward and again in backward, plus the
      gradient reduce-scatter: 3 Psi = 1.5x stage 0 (Sec. 7.2.2).
    Volumes in bytes use grad_bytes_per_param for gradient collectives and
    param_bytes_per_param for parameter ones; the 1.5x holds when the two are equal.
    `dp_degree` is the sharding group: data-parallel x sequence-parallel ranks (SP ranks hold
    replicated weights and reduce gradients too).

    Returns: {purpose: Collective}; purposes are "grads", "params_after_step" (stages 1-2),
    "params_forward", "params_backward" (stage 3). Time: sum(c.time_s(link)); bytes each rank
    sends: sum(c.sent_bytes). dp_degree == 1 gives zero time and volume.
    Raises: TrainplanError on a stage not in (0, 1, 2, 3), dp_degree < 1, or negative sizes.
    """
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise TrainplanError(f"stage={stage!r}; valid ZeRO stages: [0, 1, 2, 3]")
    n = _int_at_least_1("dp_degree", dp_degree)
    n_params = _real_non_negative("n_params", n_params)
    grads = n_params * _real_non_negative("grad_bytes_per_param", grad_bytes_per_param)
    params = n_params * _real_non_negative("param_bytes_per_param", param_bytes_per_param)
    if stage == 0:
        return {"grads": Collective(kind="all_reduce", nbytes=grads, n_ranks=n)}
    if stage in (1, 2):
        return {
            "grads": Collective(kind="reduce_scatter", nbytes=grads, n_ranks=n),
            "params_after_step": Collective(kind="all_gather", nbytes=params, n_ranks=n),
        }
    return {
        "params_forward": Collective(kind="all_gather", nbytes=params, n_ranks=n),
        "params_backward": Collective(kind="all_gather", nbytes=params, n_ranks=n),
        "grads": Collective(kind="reduce_scatter", nbytes=grads, n_ranks=n),
    }


__all__ = [
    "Collective",
    "Link",
    "ULYSSES_PER_STEP_FACTOR",
    "all_gather_s",
    "all_reduce_s",
    "all_to_all_s",
    "nodes_for",
    "reduce_scatter_s",
    "sp_degrees_within_node",
    "ulysses_all_to_all_bytes",
    "ulysses_comm_bytes_per_layer",
    "valid_sp_degrees",
    "zero_comm_bytes",
]


def link_for(hw: Any, group: int) -> Link:
    """The link a ring collective over `group` consecutive ranks of hardware profile `hw` runs
    on: the intra-node link inside one node; across nodes, the ring's bus bandwidth is the node's
    NICs together, devices_per_node x the per-device NIC share, at most the intra-node link: NCCL
    runs one ring channel per NIC and its bus bandwidth is channels x per-channel inter-node speed
    (NCCL `src/graph/tuning.cc`, `ncclTopoTuneModel`: busBw = nChannels * speedInter), and each
    channel's data also crosses the intra-node links."""
    if group <= hw.devices_per_node:
        return Link(bandwidth_bytes_per_s=hw.intra_node_bandwidth_bytes_per_s,
                    latency_s=hw.intra_node_latency_s, efficiency=hw.network_efficiency)
    bw = min(hw.intra_node_bandwidth_bytes_per_s, hw.devices_per_node * hw.inter_node_bandwidth_bytes_per_s)
    return Link(bandwidth_bytes_per_s=bw, latency_s=hw.inter_node_latency_s, efficiency=hw.network_efficiency)
