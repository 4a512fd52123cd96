"""Micro-benchmarks and system probes behind `measure_cpu` (see `trainplan.hardware_profiles.cpu`).

torch is imported inside the functions that need it, so importing this module stays cheap.
"""

from __future__ import annotations

import itertools
import math
import os
import platform
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

from trainplan.errors import TrainplanError

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Matmul dtypes `measure_cpu` times -> torch dtype attribute."""

# Benchmark settings by `quick`.
_SIZES = {False: (64, 128, 256, 512, 1024, 2048), True: (32, 64, 128, 256)}
_MAX_OP_S = {False: 0.25, True: 0.05}      # largest single matmul worth timing, s
_ALWAYS_N = {False: 1024, True: 256}       # sizes up to this are timed whatever the rate so far
_SLOW_FROM_N = {False: 512, True: 128}     # ... unless one this large took over _MAX_OP_S
_SIZE_BUDGET_S = {False: 0.6, True: 0.1}   # repeats of one size stop after this long (>= 1 repeat)
_MIN_REP_S = {False: 0.02, True: 0.003}    # each timed repeat lasts at least this, s
_REPS = {False: 5, True: 3}
_COPY_BYTES = {False: 256 * 2**20, True: 16 * 2**20}
_LLC_FALLBACK_BYTES = 32 * 2**20
"""Last-level cache assumed where sysfs does not say (the 2-core AMD EPYC development VM's L3)."""
_TCP_BYTES = {False: 64 * 2**20, True: 4 * 2**20}


def best_op_s(fn: Callable[[], Any], reps: int, min_rep_s: float, budget_s: float = math.inf) -> float:
    """Seconds per call of `fn`: the best of `reps` repeats, each calling `fn` until at least
    `min_rep_s` has passed (so a repeat never outlasts `min_rep_s` plus one call). Repeats stop
    early once `budget_s` has passed since the warm-up began (at least one repeat is timed); a
    warm-up call that alone outlasts `budget_s` is the answer (one call that long hides its
    first-touch cost, and a second would double the probe's time).

    The best, not the median: on a shared machine the slower repeats measure other processes
    (a 2-thread matmul waits for a descheduled OpenMP worker), not the hardware; the Python
    `timeit` documentation gives the same advice.
    """
    start = time.perf_counter()
    fn()  # warm-up: first touch, kernel selection, thread pool start
    warm_s = time.perf_counter() - start
    if warm_s >= budget_s:
        return warm_s
    best = math.inf
    for _ in range(reps):
        if best < math.inf and time.perf_counter() - start >= budget_s:
            break
        calls = 0
        t0 = time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_rep_s:
                break
        best = min(best, elapsed / calls)
    return best


def matmul_rates(dtype: str, quick: bool, deadline: float) -> list[tuple[float, float]]:
    """[(op FLOPs, achieved FLOP/s)] for square n x n @ n x n products, n ascending.

    Cold operands: each call multiplies the next of a ring of operand sets that together hold
    twice the last-level cache (`last_level_cache_bytes`), so every product reads operands that
    are not in cache, as a training step's GEMMs do (their inputs were written by other ops, over
    activations far larger than the cache). Hot operands (one set) measured 102 GFLOP/s at
    n = 256 on the development VM's one thread against 85 cold, and the tiny-llama step's own
    256 x 256 x 256 products ran at 81 in the step (torch.profiler; issue #40, item 16).

    Every size up to `_ALWAYS_N` (1024; quick: 256) is timed, best of a few repeats within
    `_SIZE_BUDGET_S` each, whatever the smaller sizes achieved: on a loaded machine a small
    product can stall for tens of ms (a descheduled OpenMP worker), and a rate extrapolated from
    it once stopped the sweep at n=256 with the fp32 peak ~10x low. The sweep stops earlier
    only when the best call of a size from `_SLOW_FROM_N` (512) on already took over `_MAX_OP_S`
    (a dtype this CPU emulates, e.g. fp16 on x86 without AVX512-FP16: ~0.35 s at n=512, ~9 s
    at n=1024 on the 2-core machine); slow calls of smaller sizes are stalls, not arithmetic.
    A larger size is timed only when its single product, predicted from the best rate so far,
    takes at most `_MAX_OP_S` and ends before `deadline` (a `time.perf_counter()` value).
    """
    import torch

    tdtype = getattr(torch, TORCH_DTYPES[dtype])
    reps, min_rep_s = _REPS[quick], _MIN_REP_S[quick]
    out: list[tuple[float, float]] = []
    slow = False
    # the ring's operands: one buffer of twice the last-level cache (at least one set of the largest n)
    pool_numel = max(2 * last_level_cache_bytes() // tdtype.itemsize, 3 * _SIZES[quick][-1] ** 2)
    pool = torch.rand(pool_numel, generator=torch.Generator().manual_seed(0)).to(tdtype)
    for n in _SIZES[quick]:
        flops = 2.0 * n**3
        if slow:
            break
        if out and n > _ALWAYS_N[quick]:
            predicted = flops / max(rate for _, rate in out)
            if predicted > _MAX_OP_S[quick] or time.perf_counter() + predicted * (reps + 2) > deadline:
                break
        per_set = 3 * n * n
        sets = pool[: per_set * max(1, pool.numel() // per_set)].view(-1, 3, n, n)
        ring = itertools.cycle([tuple(s.unbind(0)) for s in sets])  # (a, b, out) views, made once

        def product(ring=ring):
            a, b, c = next(ring)
            torch.mm(a, b, out=c)

        with torch.no_grad():
            op_s = best_op_s(product, reps, min_rep_s, _SIZE_BUDGET_S[quick])
        out.append((flops, flops / op_s))
        slow = n >= _SLOW_FROM_N[quick] and op_s > _MAX_OP_S[quick]
    return out


def last_level_cache_bytes() -> int:
    """Bytes of this CPU's largest cache (Linux sysfs `cache/index*/size` of cpu0), else
    `_LLC_FALLBACK_BYTES`."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        with_unit = text[:-1] if text[-1:] in "KMG" else text
        if with_unit.isdigit():
            sizes.append(int(with_unit) * unit)
    return max(sizes, default=_LLC_FALLBACK_BYTES)


def op_overhead_s(quick: bool) -> float:
    """Seconds per eager op beyond its arithmetic: a chain of 16 elementwise ops on 64-element
    tensors, forward and backward (autograd included), median of repeats divided by its
    ~48 ops (16 forward, ~32 backward)."""
    import torch

    x = torch.randn(64, requires_grad=True)
    w = torch.randn(64)

    def chain():
        y = x
        for _ in range(16):
            y = y * w
        y.sum().backward()

    chain()
    n = 5 if quick else 30
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        chain()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / 48


def optimizer_s_per_param(quick: bool) -> dict[str, float]:
    """Seconds per parameter of one AdamW step as the executor builds it
    (`trainplan.executor.optimizers.build_optimizer`: torch AdamW, fused=True, for 32 bits and, over
    bf16 parameters, 16; bitsandbytes AdamW8bit for 8 bits; torchao AdamW4bit, eager as the
    executor runs it on CPU, for 4): parameters with gradients, 4 tensors of 512 x 1024
    (quick: 128 x 256), the best step of 3 (quick: 2) after one warm-up step (which allocates
    the states), divided by the parameter count; a few seconds in all on 2 cores (the
    quantized optimizers' CPU paths are the slow part). Keys "32", "16", "8", "4"; "8" and "4"
    are absent when their library does not import."""
    import torch

    rows, cols = (128, 256) if quick else (512, 1024)

    def params(dtype=torch.float32):
        ps = [torch.nn.Parameter(torch.randn(rows, cols, dtype=dtype)) for _ in range(4)]
        for p in ps:
            p.grad = torch.randn_like(p)
        return ps
    kw: dict[str, Any] = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    makers: dict[str, Callable[[], Any]] = {"32": lambda: torch.optim.AdamW(params(), fused=True, **kw),
              "16": lambda: torch.optim.AdamW(params(torch.bfloat16), fused=True, **kw)}
    try:
        import bitsandbytes as bnb

        makers["8"] = lambda: bnb.optim.AdamW8bit(params(), **kw)
    except Exception:  # noqa: BLE001 - any import failure: no 8-bit optimizer on this machine
        pass
    try:
        from torchao.optim import AdamW4bit

        makers["4"] = lambda: AdamW4bit(params(), **kw)
    except Exception:  # noqa: BLE001 - any import failure: no 4-bit optimizer on this machine
        pass
    out = {}
    with mock.patch.object(torch, "compile", lambda fn, **_: fn):  # torchao eager, as on CPU
        for bits, make in makers.items():
            opt = make()
            opt.step()  # warm-up: the states are allocated here
            times = []
            for _ in range(2 if quick else 3):
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            out[bits] = min(times) / (4 * rows * cols)
    return out


def copy_bandwidth(quick: bool) -> float:
    """Bytes/s of a large fp32 tensor copy, counting bytes read + written (best of repeats)."""
    import torch

    nbytes = min(_COPY_BYTES[quick], max(2**20, available_bytes() // 8))
    src = torch.ones(nbytes // 4)  # ones: every page touched before timing
    dst = torch.zeros_like(src)
    op_s = best_op_s(lambda: dst.copy_(src), _REPS[quick], _MIN_REP_S[quick])
    return 2.0 * src.numel() * 4 / op_s


def loopback_tcp_bandwidth(quick: bool) -> float | None:
    """Bytes/s one way through a TCP connection on 127.0.0.1 (gloo's transport between local
    processes), or None when loopback sockets are unavailable."""
    total = _TCP_BYTES[quick]
    chunk = b"\0" * (1 << 20)
    done = threading.Event()
    received = [0]

    def serve(server: socket.socket) -> None:
        try:
            conn, _ = server.accept()
            with conn:
                while received[0] < total:
                    data = conn.recv(1 << 20)
                    if not data:
                        break
                    received[0] += len(data)
        except OSError:
            pass
        finally:
            done.set()

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            server.settimeout(5)
            thread = threading.Thread(target=serve, args=(server,), daemon=True)
            thread.start()
            with socket.create_connection(server.getsockname(), timeout=5) as client:
                t0 = time.perf_counter()
                for _ in range(total // len(chunk)):
                    client.sendall(chunk)
                client.shutdown(socket.SHUT_WR)
                done.wait(10)
                elapsed = time.perf_counter() - t0
            thread.join(5)
    except OSError:
        return None
    if received[0] < total or elapsed <= 0:
        return None
    return total / elapsed


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes ({} where it does not exist)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except (OSError, ValueError, IndexError):
        return {}
    return out


def cgroup_limit() -> int | None:
    """Memory limit of this process's cgroup (v2 memory.max or v1 limit_in_bytes), if any."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            return int(text)
    return None


def total_ram_bytes() -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = meminfo().get("MemTotal", 0)
    if total <= 0:
        raise TrainplanError("cannot read this machine's RAM size (os.sysconf or /proc/meminfo)")
    limit = cgroup_limit()
    return min(total, limit) if limit else total


def available_bytes() -> int:
    info = meminfo()
    total = total_ram_bytes()
    return min(total, info.get("MemAvailable", total))


def cpu_vendor() -> str:
    vendor = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    vendor = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    vendor = vendor or platform.processor() or platform.machine()
    return {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(vendor, vendor.lower())
