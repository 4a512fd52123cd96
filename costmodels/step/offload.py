"""Activation offload: checkpointed blocks' inputs held in host memory between their forward and
their backward, as `trainplan.modeling.offload` runs it (ALST's activation checkpoint offload, Bekman et al.
2025, arXiv:2506.13996).

A fully checkpointed block keeps only its input (the hidden states, b x s x h) from its forward
to its backward; over L blocks that is L inputs, the largest activation term left at long
sequence. With offload each input is copied to host memory on a side stream once the block's
forward has used it, and copied back, one block ahead, during the backward (the executor
prefetches block i-1's input when block i's is unpacked). Per device, as modelled here:

- memory: the block's retained bytes less its input, plus one input in flight in each block
  phase (in the forward the previous block's copy out, in the backward the next block's copy
  in) and in the tail (the last block's copy out);
- host memory: the inputs of every offloaded block, which must fit the device's share of the
  node's host memory (`host_limit_bytes`);
- time: each copy runs on the host link (`HardwareProfile.host_link_bandwidth_bytes_per_s`, one
  direction, at its nominal rate) beside the block's compute, exposed only where a copy takes
  longer than the compute it overlaps (`exposed_s`), plus the first fetch of the backward, which
  nothing precedes.

On a unified-memory device (MI300A, whose CPU and GPU share the HBM, and the `cpu` profile) host
memory is device memory: offload frees nothing and only its copies cost time, at the memory
bandwidth.
"""

from __future__ import annotations

from dataclasses import replace

from trainplan.costmodels.step.memory import MemoryBreakdown, RegionMemory
from trainplan.hardware_profiles import HardwareProfile


def offloaded(m: RegionMemory, hw: HardwareProfile) -> RegionMemory:
    """Block memory `m` (a checkpointed block's) with its input offloaded to host memory: retained
    bytes less the input, one input more in its forward and backward peaks (the neighbouring
    block's copy in flight), the input counted as host bytes. On a unified-memory device
    (`HardwareProfile.unified_memory`) the copy is device memory too: retained bytes unchanged, and
    in its forward and backward the copy and the original (the input made, the copy fetched
    back) are both alive for a moment."""
    x = m.input_bytes
    more = MemoryBreakdown(activations=x)
    if hw.unified_memory:
        return replace(m, fwd_peak=m.fwd_peak + more, bwd_peak=m.bwd_peak + more,
                       bwd_peak_accumulating=m.bwd_peak_accumulating + more)
    return replace(m, retained=m.retained - x, fwd_peak=m.fwd_peak + more, bwd_peak=m.bwd_peak + more,
                   bwd_peak_accumulating=m.bwd_peak_accumulating + more, offloaded_bytes=x)


def in_flight(m: RegionMemory, hw: HardwareProfile) -> RegionMemory:
    """Tail memory `m` with the last block's input in flight to host memory (its hidden-state
    input has the same bytes), during the tail's forward and backward; unchanged on a
    unified-memory device."""
    if hw.unified_memory:
        return m
    more = MemoryBreakdown(activations=m.input_bytes)
    return replace(m, fwd_peak=m.fwd_peak + more, bwd_peak=m.bwd_peak + more,
                   bwd_peak_accumulating=m.bwd_peak_accumulating + more)


def copy_s(nbytes: float, hw: HardwareProfile) -> float:
    """Seconds of one copy of `nbytes` between device and host memory: over the host link at its
    nominal one-direction rate, or, on a unified-memory device, a device copy (read and write)
    at the memory bandwidth (`hbm_bandwidth_bytes_per_s` x `memory_efficiency`)."""
    if hw.unified_memory:
        return 2 * nbytes / (hw.hbm_bandwidth_bytes_per_s * hw.memory_efficiency)
    return nbytes / hw.host_link_bandwidth_bytes_per_s


def exposed_s(nbytes: float, fwd_s: float, bwd_s: float, hw: HardwareProfile) -> float:
    """Seconds one offloaded block adds to a micro-step: its copy out beyond the next block's
    forward (`fwd_s`) and its copy in beyond the later block's backward it overlaps (`bwd_s`),
    each on a side stream; on a unified-memory device the copies run on the compute stream
    (`trainplan.modeling.offload` copies synchronously there), all exposed."""
    t = copy_s(nbytes, hw)
    if hw.unified_memory:
        return 2 * t
    return max(0.0, t - fwd_s) + max(0.0, t - bwd_s)


def host_limit_bytes(hw: HardwareProfile) -> float:
    """Host memory one device may fill: the node's (`host_memory_bytes`) shared evenly among its
    `devices_per_node` devices."""
    return hw.host_memory_bytes / hw.devices_per_node
