"""The local `cpu` profile: measured by a micro-benchmark, cached per host.

`load_cpu()` (what `trainplan.hardware_profiles.load("cpu")` calls) returns, in order: the cache file
`<cache root>/hardware/cpu.json` (`trainplan.hardware_profiles.cache.cache_root`: $TRAINPLAN_CACHE_DIR, else
the platform's user cache, `~/.cache/trainplan` on Linux) when it was written on this host with
the same torch version and thread count; else a profile measured earlier in this process under
the same key; else a fresh `measure_cpu()`, which it writes to the cache. A cache file that
cannot be read back is re-measured with a warning.

The thread count is the one runs use: `trainplan.hardware_profiles.threads.threads_per_rank(1)` (the
OMP_NUM_THREADS the user set, else the usable cores), which `trainplan.executor.train.run` sets for a
one-process run; `measure_cpu` measures at it, whatever torch's threads are in the calling
process. (A run of n processes gives each cores // n threads; the profile describes a
one-process run.)

torch is imported inside the functions that need it (as in `trainplan.hardware_profiles.cpu_probes`):
every entry point imports `hardware_profiles`, and a datasheet profile needs no torch.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import time
import warnings
from pathlib import Path

import trainplan.hardware_profiles.cpu_probes as probes
from trainplan.errors import TrainplanError
from trainplan.hardware_profiles.cache import cache_root
from trainplan.hardware_profiles.profile import HardwareProfile
from trainplan.hardware_profiles.threads import threads_per_rank, torch_threads

CACHE_FORMAT = 6
"""Version of the cache file layout and of what its probes measure (4: AdamW fused; 5: host
memory, host link and unified memory; 6: matmuls on cold operands); another version is
re-measured."""

RESERVE_FRACTION = 0.25
"""Share of RAM `measure_cpu` keeps back from tensors at least (OS, other processes, the
Python/torch process itself); an engineering choice, not a measurement."""

GLOO_LATENCY_S = 50e-6
"""Assumed startup latency of one gloo collective step over loopback, s (to be calibrated)."""
GLOO_LATENCY_SOURCE = "assumption: 50 us for a gloo collective step over loopback; to be refit by trainplan calibrate"
"""The `sources` entry of both link latencies of a measured profile."""

# key (hostname, torch version, threads) -> profile measured or loaded in this process
_MEMO: dict[tuple[str, str, int], HardwareProfile] = {}


def cache_path() -> Path:
    """Path of the cached cpu profile: `<cache root>/hardware/cpu.json`
    (`trainplan.hardware_profiles.cache.cache_root`)."""
    return cache_root() / "hardware" / "cpu.json"


def _host_key() -> tuple[str, str, int]:
    """(hostname, torch version, the threads a one-process run uses: `threads_per_rank(1)`)."""
    import torch

    return (socket.gethostname(), torch.__version__, threads_per_rank(1))


# ---------------------------------------------------------------- the profile


def measure_cpu(dtype: str = "fp32", quick: bool = False, threads: int | None = None) -> HardwareProfile:
    """Measure this machine as a `HardwareProfile` named "cpu" (one "device" = the whole CPU).

    Every probe runs at `threads` torch threads (default `threads_per_rank(1)`: the count a
    one-process run uses, see the module text); torch's threads are restored after.

    - Matmul: square `torch.mm` on cold operands (a ring of operand sets of twice the last-level
      cache) at n = 64 .. 2048 (quick: 32 .. 256), best of 5 (quick: 3) timed repeats of at
      least 20 ms (quick: 3 ms) each, within 0.6 s per size (see `cpu_probes.best_op_s` for why
      the best); every size up to 1024 (quick: 256) is timed unless the best call at 512 (quick:
      128) took over 0.25 s (quick: 0.05 s), and 2048 only when it would take at most that
      (`cpu_probes.matmul_rates`). `peak_flops_per_s[d]` is the best
      achieved rate for d in fp32, bf16, fp16; `tf32` repeats fp32 (CPUs have no TF32 unit and
      torch runs such matmuls in fp32). `matmul_efficiency` is achieved / peak by op FLOPs for
      `dtype`, made non-decreasing (running maximum) so noise on a shared machine does not
      predict a larger GEMM slower per FLOP than a smaller one.
    - `hbm_bandwidth_bytes_per_s`: a 256 MiB (quick: 16 MiB) fp32 `copy_`, bytes read +
      written over time; already an achieved rate, so `memory_efficiency` = 1.
    - `hbm_bytes`: total RAM (`os.sysconf`, else /proc/meminfo), capped by the cgroup limit.
      `memory_reserve_bytes` = max(25% of it, what is in use when measured: total minus
      MemAvailable), capped at 90%: the OS, other processes and this process's own torch
      libraries hold RAM that tensors cannot use.
    - `optimizer_s_per_param`: one AdamW step per parameter as the executor runs it, 32-bit
      (torch) and 8-bit (bitsandbytes, when it imports); see `cpu_probes.optimizer_s_per_param`.
    - Host memory: the device is the host (`unified_memory` = True: offload frees nothing);
      `host_memory_bytes` = total RAM, as `hbm_bytes`; `host_link_bandwidth_bytes_per_s` = half
      the copy bandwidth (a copy of n bytes reads n and writes n, so n bytes take 2n / the copy
      bandwidth).
    - Links: `devices_per_node` = 1; intra-node bandwidth = the copy bandwidth (assumption:
      gloo through shared memory); inter-node bandwidth = one-way TCP throughput on 127.0.0.1
      (gloo's transport between local processes; the copy bandwidth / 10 where sockets fail);
      both latencies = 50 us (assumption for gloo over loopback, to be calibrated);
      `network_efficiency` = 1 as the rates are achieved ones.

    Takes about 4-7 s on 2 cores under load (quick: well under 2 s). Raises `TrainplanError` for a dtype
    other than fp32, bf16 or fp16, or a thread count that is not a whole number >= 1.
    """
    if dtype not in probes.TORCH_DTYPES:
        raise TrainplanError(f"measure_cpu(dtype={dtype!r}): known dtypes are {', '.join(probes.TORCH_DTYPES)}")
    with torch_threads(threads_per_rank(1, threads)) as n:
        return _measure(dtype, quick, n)


def _measure(dtype: str, quick: bool, threads: int) -> HardwareProfile:
    """`measure_cpu`'s body, at the `threads` torch threads it has set."""
    import torch

    budget_s = 1.0 if quick else 6.0  # for the matmuls; copy and TCP add well under a second
    host, version = socket.gethostname(), torch.__version__
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    where = (f"measured by trainplan.hardware_profiles.cpu.measure_cpu on {host}, {threads} torch threads, "
             f"torch {version}, {when}")
    if quick:
        where += " (quick)"

    order = [dtype] + [d for d in probes.TORCH_DTYPES if d != dtype]
    for d in order:  # start the thread pool and pick kernels before anything is timed
        x = torch.ones(128, 128, dtype=getattr(torch, probes.TORCH_DTYPES[d]))
        torch.mm(x, x)
    rates: dict[str, list[tuple[float, float]]] = {}
    for i, d in enumerate(order):
        # the curve's dtype gets half the budget, the others share the rest
        share = 0.5 if i == 0 else 0.5 / (len(order) - 1)
        deadline = time.perf_counter() + share * budget_s
        rates[d] = probes.matmul_rates(d, quick, deadline)
    peaks = {d: max(r for _, r in pts) for d, pts in rates.items()}
    peaks["tf32"] = peaks["fp32"]
    curve, best = [], 0.0
    for flops, rate in rates[dtype]:
        best = max(best, rate / peaks[dtype])
        curve.append((flops, min(1.0, best)))

    copy_bw = probes.copy_bandwidth(quick)
    overhead = probes.op_overhead_s(quick)
    opt_rates = probes.optimizer_s_per_param(quick)
    tcp_bw = probes.loopback_tcp_bandwidth(quick)
    total = probes.total_ram_bytes()
    in_use = max(0, total - probes.available_bytes())
    reserve = min(int(0.9 * total), max(int(RESERVE_FRACTION * total), in_use))

    sources = {
        "hbm_bytes": f"total RAM (os.sysconf, cgroup limit applied); {where}",
        "hbm_bandwidth_bytes_per_s": f"fp32 tensor copy_, bytes read + written / best time; {where}",
        "intra_node_bandwidth_bytes_per_s": (
            f"assumption: equal to the measured copy bandwidth (gloo through shared memory); {where}"),
        "inter_node_bandwidth_bytes_per_s": (
            f"one-way TCP throughput on 127.0.0.1 (gloo's transport between local processes); {where}"
            if tcp_bw else f"assumption: copy bandwidth / 10 (loopback TCP could not be measured); {where}"
        ),
        "intra_node_latency_s": GLOO_LATENCY_SOURCE,
        "inter_node_latency_s": GLOO_LATENCY_SOURCE,
        "devices_per_node": "the cpu profile treats the whole machine as one device",
        "memory_reserve_bytes": (
            f"max(25% of RAM, RAM in use at measurement: total - MemAvailable), at most 90%; {where}"),
        "host_memory_bytes": f"total RAM, as hbm_bytes: the device is the host (unified_memory); {where}",
        "host_link_bandwidth_bytes_per_s": (
            f"half the measured fp32 copy_ bandwidth (bytes read + written / time): the payload rate of a copy "
            f"within RAM, the device being the host; {where}"),
        "unified_memory": "the cpu profile's device is the host: its memory is host memory",
        "matmul_efficiency": f"achieved / peak of square {dtype} torch.mm on cold operands by op FLOPs, "
                             f"running maximum; {where}",
        "memory_efficiency": "1: hbm_bandwidth_bytes_per_s is already an achieved copy rate",
        "network_efficiency": "1: the link bandwidths are already achieved (or assumed) rates",
        "op_overhead_s": f"median seconds per op of a forward+backward chain of tiny autograd ops; {where}",
        "optimizer_s_per_param": (f"best of timed AdamW steps (torch, fused=True: 32; bitsandbytes "
                                  f"AdamW8bit: 8) on 4 fp32 tensors of 512 x 1024, per parameter; {where}"),
        "peak_flops_per_s.tf32": "CPUs have no TF32 unit; torch runs these matmuls in fp32, so the fp32 peak",
    }
    for d in probes.TORCH_DTYPES:
        sources[f"peak_flops_per_s.{d}"] = f"best achieved square {d} torch.mm rate on cold operands; {where}"

    profile = HardwareProfile(
        name="cpu",
        vendor=probes.cpu_vendor(),
        device_type="cpu",
        source=where,
        hbm_bytes=total,
        hbm_bandwidth_bytes_per_s=copy_bw,
        peak_flops_per_s=peaks,
        intra_node_bandwidth_bytes_per_s=copy_bw,
        inter_node_bandwidth_bytes_per_s=tcp_bw or copy_bw / 10,
        intra_node_latency_s=GLOO_LATENCY_S,
        inter_node_latency_s=GLOO_LATENCY_S,
        devices_per_node=1,
        memory_reserve_bytes=reserve,
        host_memory_bytes=total,
        host_link_bandwidth_bytes_per_s=copy_bw / 2,
        unified_memory=True,
        matmul_efficiency=tuple(curve),
        memory_efficiency=1.0,
        network_efficiency=1.0,
        op_overhead_s=overhead,
        optimizer_s_per_param=opt_rates,
        sources=sources,
    )
    return profile


def save_profile(profile: HardwareProfile) -> Path:
    """Write `profile` as this host's cached cpu profile (what `load("cpu")` returns next);
    calibration refits the measured profile and saves it here. Returns the file's path.

    The cache is keyed by hostname, torch version and the thread count runs use when it is saved
    (`threads_per_rank(1)`).
    Raises `TrainplanError` for a profile not named "cpu" (the GPU profiles are the TOML files).
    """
    if profile.name != "cpu":
        raise TrainplanError(
            f"save_profile: only the measured 'cpu' profile is cached, got {profile.name!r}; "
            "datasheet profiles live in hardware_profiles/*.toml"
        )
    host, version, threads = _host_key()
    record = {
        "format": CACHE_FORMAT,
        "hostname": host,
        "torch_version": version,
        "num_threads": threads,
        "saved_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "profile": profile.to_dict(),
    }
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    _MEMO[(host, version, threads)] = profile
    return path


def _read_cache(path: Path, key: tuple[str, str, int]) -> HardwareProfile | None:
    """The cached profile if it matches `key`; None if it belongs to another host/torch/threads.
    Raises ValueError (or TrainplanError, a subclass) if the file is unreadable."""
    record = json.loads(path.read_text())
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if record.get("format") != CACHE_FORMAT:
        return None
    if (record.get("hostname"), record.get("torch_version"), record.get("num_threads")) != key:
        return None
    profile = HardwareProfile.from_dict(record["profile"])
    if profile.name != "cpu" or not all(math.isfinite(v) for v in profile.peak_flops_per_s.values()):
        raise ValueError("not a cpu profile")
    return profile


def load_cpu(remeasure: bool = False) -> HardwareProfile:
    """The local cpu profile: cached if valid for this host, torch version and thread count,
    else measured with `measure_cpu()` and cached. `remeasure=True` always measures.

    A cache file that cannot be parsed is re-measured with a `RuntimeWarning`, never an error.
    """
    key = _host_key()
    path = cache_path()
    if not remeasure:
        corrupt = False
        if path.exists():
            try:
                cached = _read_cache(path, key)
            except (OSError, ValueError, KeyError, TypeError) as err:
                corrupt = True
                warnings.warn(
                    f"cpu hardware profile cache {path} is unreadable ({err}); re-measuring",
                    RuntimeWarning, stacklevel=3,
                )
            else:
                if cached is not None:
                    _MEMO[key] = cached
                    return cached
        if not corrupt and key in _MEMO:  # measured earlier in this process, other cache dir
            _save_quietly(_MEMO[key], path)
            return _MEMO[key]
    profile = measure_cpu()
    _save_quietly(profile, path)
    return profile


def _save_quietly(profile: HardwareProfile, path: Path) -> None:
    try:
        save_profile(profile)
    except OSError as err:  # a read-only home must not stop planning
        warnings.warn(f"could not write cpu hardware profile cache {path}: {err}", RuntimeWarning, stacklevel=4)
