"""hardware_profiles: packaged TOML profiles, the HardwareProfile checks, the measured cpu profile."""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
import subprocess
import sys
import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trainplan.hardware_profiles
from trainplan.errors import TrainplanError, UnknownNameError
from trainplan.hardware_profiles import HardwareProfile, cpu, load
from trainplan.hardware_profiles.profile import NUMERIC_FIELDS

GIB = 2**30
DATASHEET = ["a100-40gb", "a100", "h100", "h200", "mi300a", "mi300x"]  # sorted by file name


def _toml_files():
    files = importlib.resources.files("trainplan.hardware_profiles").iterdir()
    return sorted((f for f in files if f.name.endswith(".toml")), key=lambda f: f.name)


def _minimal(**over):
    fields = dict(
        name="toy", hbm_bytes=8 * GIB, hbm_bandwidth_bytes_per_s=1e12,
        peak_flops_per_s={"bf16": 1e14, "fp32": 1e13},
        intra_node_bandwidth_bytes_per_s=1e11, inter_node_bandwidth_bytes_per_s=1e10,
        matmul_efficiency=[[1e6, 0.05], [1e9, 0.5], [1e12, 0.8]],
    )
    fields.update(over)
    return HardwareProfile(**fields)


# ---------------------------------------------------------------- packaged profiles


def test_every_toml_loads_and_every_number_has_a_source():
    files = _toml_files()
    assert [f.name for f in files] == [f"{n}.toml" for n in DATASHEET]
    for f in files:
        raw = tomllib.loads(f.read_text())
        sources = raw["sources"]
        numeric = [k for k, v in raw.items()
                   if isinstance(v, (int, float, list)) and not isinstance(v, bool) and k != "aliases"]
        assert set(numeric) == set(NUMERIC_FIELDS), f.name
        for key in numeric + [f"peak_flops_per_s.{d}" for d in raw["peak_flops_per_s"]]:
            assert sources.get(key, "").strip(), f"{f.name}: no source for {key}"
        profile = load(raw["name"])
        assert profile.missing_sources() == []
        assert profile.device_type == "cuda"
        assert profile.source


def test_units_in_every_numeric_key():
    units = ("_bytes", "_per_s", "_s", "_efficiency", "devices_per_node")
    for field in NUMERIC_FIELDS:
        assert field.endswith(units), field


def test_alias_and_case_insensitivity():
    assert load("mi300") is load("mi300x")
    assert load("MI300").name == "mi300x"
    assert load(" H100 ").name == "h100"
    profile = load("a100")
    assert load(profile) is profile


def test_unknown_name_lists_every_name_and_alias():
    with pytest.raises(UnknownNameError) as info:
        load("h800")
    assert str(info.value) == (
        "unknown hardware 'h800': known profiles are a100, a100-40gb, cpu, h100, h200, mi300a, mi300x (alias mi300)"
    )
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    with pytest.raises(TrainplanError, match="profile name or HardwareProfile"):
        load(3)


def test_a_profile_file_not_named_toml_gets_a_hint(tmp_path):
    path = tmp_path / "h8.txt"
    path.write_text("not read")
    with pytest.raises(UnknownNameError, match=r"unknown hardware '.*h8\.txt'.*ends in \.toml"):
        load(str(path))


def test_known_names():
    assert trainplan.hardware_profiles.known_names() == ["a100", "a100-40gb", "cpu", "h100", "h200", "mi300", "mi300a",
                                                         "mi300x"]


def test_datasheet_values():
    h100 = load("h100")
    assert h100.peak("bf16") == 989.4e12  # NVIDIA H100 whitepaper Table 3, SXM5 dense BF16
    assert h100.peak("fp8") == 1978.9e12  # same table, dense FP8 (3957.8 with sparsity)
    assert h100.hbm_bytes == 80 * GIB  # H100 SXM datasheet: 80GB
    assert h100.hbm_bandwidth_bytes_per_s == 3.35e12  # H100 SXM datasheet: 3.35 TB/s
    assert h100.intra_node_bandwidth_bytes_per_s == 450e9  # NVLink 900 GB/s both ways
    a100 = load("a100")
    assert a100.peak("bf16") == 312e12  # A100 datasheet Table 1 (SXM), dense
    assert a100.peak("fp32") == 19.5e12  # same table
    assert a100.hbm_bandwidth_bytes_per_s == 2.039e12  # A100 80GB SXM: 2,039 GB/s
    assert "fp8" not in a100.peak_flops_per_s  # Ampere has no FP8 tensor cores
    h200 = load("h200")
    assert h200.peak("bf16") == h100.peak("bf16")  # same GH100 compute (H200 datasheet)
    assert h200.hbm_bytes == 141 * GIB and h200.hbm_bandwidth_bytes_per_s == 4.8e12  # H200 datasheet
    mi300x = load("mi300x")
    assert mi300x.peak("bf16") == 1307.4e12  # AMD MI300X data sheet, dense BF16 (not 1.300e15)
    assert mi300x.hbm_bytes == 192 * GIB and mi300x.hbm_bandwidth_bytes_per_s == 5.3e12  # data sheet
    mi300a = load("mi300a")
    assert mi300a.peak("bf16") == 980.6e12  # AMD MI300A data sheet, dense BF16
    assert mi300a.devices_per_node == 4  # El Capitan: 4 APUs per node
    assert mi300a.hbm_bytes == 128 * GIB
    for name in DATASHEET:
        p = load(name)
        assert p.devices_per_node == (4 if name == "mi300a" else 8)
        # dense, not sparse: bf16 is twice tf32 on all of these parts
        assert math.isclose(p.peak("bf16"), 2 * p.peak("tf32"), rel_tol=1e-3), name
        assert 0 < p.usable_bytes < p.hbm_bytes


def test_peak_dtype_names():
    h100 = load("h100")
    assert h100.peak("bfloat16") == h100.peak("torch.bfloat16") == h100.peak("BF16") == 989.4e12
    assert h100.peak("float32") == 66.9e12
    with pytest.raises(TrainplanError, match="known dtypes are bf16, fp16, fp32, tf32"):
        load("a100").peak("fp8")


# ---------------------------------------------------------------- HardwareProfile checks


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", ""),
        ("hbm_bytes", 0),
        ("hbm_bytes", -1),
        ("hbm_bytes", True),
        ("hbm_bandwidth_bytes_per_s", math.nan),
        ("hbm_bandwidth_bytes_per_s", "fast"),
        ("intra_node_bandwidth_bytes_per_s", 0.0),
        ("inter_node_bandwidth_bytes_per_s", -5e9),
        ("intra_node_latency_s", -1e-6),
        ("inter_node_latency_s", math.inf),
        ("devices_per_node", 0),
        ("devices_per_node", 2.5),
        ("memory_reserve_bytes", 8 * GIB),
        ("memory_reserve_bytes", -1),
        ("memory_efficiency", 1.5),
        ("memory_efficiency", 0.0),
        ("network_efficiency", -0.1),
        ("device_type", "tpu"),
        ("peak_flops_per_s", {}),
        ("peak_flops_per_s", {"bf16": -1.0}),
        ("peak_flops_per_s", {"BF16": 1e12}),
        ("matmul_efficiency", []),
        ("matmul_efficiency", [[1e9, 0.5], [1e6, 0.1]]),
        ("matmul_efficiency", [[1e6, 0.1], [1e6, 0.2]]),
        ("matmul_efficiency", [[1e6, 0.0]]),
        ("matmul_efficiency", [[1e6, 1.2]]),
        ("matmul_efficiency", [[0, 0.5]]),
        ("matmul_efficiency", [[1e6]]),
        ("sources", {"hbm_bytes": 3}),
        ("aliases", 5),
    ],
)
def test_bad_values_raise_naming_the_field(field, value):
    with pytest.raises(TrainplanError, match=field.split("_")[0]) as info:
        _minimal(**{field: value})
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)


def test_profile_is_frozen_and_hashable():
    p = _minimal()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.hbm_bytes = 1
    with pytest.raises(TypeError):
        p.peak_flops_per_s["bf16"] = 1.0
    assert hash(p) == hash(_minimal()) and p == _minimal()
    assert isinstance(p.matmul_efficiency, tuple) and p.matmul_efficiency[0] == (1e6, 0.05)
    assert p.usable_bytes == 8 * GIB


@pytest.mark.parametrize("name", DATASHEET)
def test_dict_round_trip(name):
    profile = load(name)
    data = json.loads(json.dumps(profile.to_dict()))
    assert HardwareProfile.from_dict(data) == profile
    with pytest.raises(TrainplanError, match="unknown key"):
        HardwareProfile.from_dict({**data, "hbm_gb": 80})
    del data["hbm_bytes"]
    with pytest.raises(TrainplanError, match="missing key.*hbm_bytes"):
        HardwareProfile.from_dict(data)


def test_with_calibration():
    h100 = load("h100")
    cal = h100.with_calibration(memory_efficiency=0.9, peak_flops_per_s={**h100.peak_flops_per_s, "bf16": 700e12})
    assert cal.memory_efficiency == 0.9 and cal.peak("bf16") == 700e12
    assert h100.memory_efficiency == 0.8  # original untouched
    assert cal.sources["memory_efficiency"].startswith("calibrated (replaces: default assumption")
    assert cal.sources["peak_flops_per_s.bf16"].startswith("calibrated")
    assert cal.sources["peak_flops_per_s.fp8"] == h100.sources["peak_flops_per_s.fp8"]  # unchanged
    assert cal.sources["hbm_bytes"] == h100.sources["hbm_bytes"]
    explicit = h100.with_calibration(network_efficiency=0.5, sources={"network_efficiency": "nccl-tests run 7"})
    assert explicit.sources["network_efficiency"] == "nccl-tests run 7"
    with pytest.raises(TrainplanError, match="memory_efficiency"):
        h100.with_calibration(memory_efficiency=2.0)
    with pytest.raises(TrainplanError, match="unknown field.*hbm_gb"):
        h100.with_calibration(hbm_gb=80)


# ---------------------------------------------------------------- efficiency curve


def test_matmul_efficiency_interpolation():
    p = _minimal()  # (1e6, 0.05), (1e9, 0.5), (1e12, 0.8)
    assert p.matmul_efficiency_at(1.0) == 0.05  # clamped below
    assert p.matmul_efficiency_at(0) == 0.05
    assert p.matmul_efficiency_at(1e15) == 0.8  # clamped above
    assert p.matmul_efficiency_at(1e9) == pytest.approx(0.5)  # at a point
    assert p.matmul_efficiency_at(10**7.5) == pytest.approx(0.275)  # halfway in log10
    assert p.matmul_efficiency_at(1e10) == pytest.approx(0.6)
    with pytest.raises(TrainplanError, match="op_flops"):
        p.matmul_efficiency_at(math.nan)
    for name in DATASHEET:
        curve = load(name).matmul_efficiency
        assert [e for _, e in curve] == sorted(e for _, e in curve), name  # grows with size


@settings(max_examples=60, deadline=None)
@given(
    points=st.lists(
        st.tuples(st.floats(1e3, 1e15), st.floats(0.01, 1.0)), min_size=1, max_size=6,
        unique_by=lambda p: round(math.log10(p[0]), 3),
    ),
    queries=st.lists(st.floats(1.0, 1e17), min_size=2, max_size=10),
)
def test_matmul_efficiency_monotone_and_bounded(points, queries):
    xs = sorted(x for x, _ in points)
    ys = sorted(y for _, y in points)  # non-decreasing curve
    p = _minimal(matmul_efficiency=list(zip(xs, ys, strict=False)))
    values = [p.matmul_efficiency_at(q) for q in sorted(queries)]
    assert all(b >= a - 1e-12 for a, b in zip(values, values[1:], strict=False))
    assert all(ys[0] - 1e-12 <= v <= ys[-1] + 1e-12 for v in values)


# ---------------------------------------------------------------- the cpu profile


@pytest.fixture(scope="module")
def quick_cpu():
    return cpu.measure_cpu(quick=True)


@pytest.fixture
def counted(monkeypatch, tmp_path, quick_cpu):
    """Fresh cache dir and memo; measure_cpu replaced by a counter returning the quick profile."""
    monkeypatch.setenv("TRAINPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "_MEMO", {})
    calls = []

    def fake_measure(dtype="fp32", quick=False):
        calls.append(quick)
        return quick_cpu

    monkeypatch.setattr(cpu, "measure_cpu", fake_measure)
    return calls


def test_measure_cpu_quick(quick_cpu):
    p = quick_cpu
    assert p.name == "cpu" and p.device_type == "cpu" and p.devices_per_node == 1
    for dtype in ("fp32", "tf32", "bf16", "fp16"):
        assert p.peak(dtype) > 0
    assert p.hbm_bytes > 0 and 0 < p.usable_bytes < p.hbm_bytes
    assert p.memory_reserve_bytes >= 0.25 * p.hbm_bytes - 1
    assert p.hbm_bandwidth_bytes_per_s > 0 and p.inter_node_bandwidth_bytes_per_s > 0
    assert len(p.matmul_efficiency) >= 2 and p.matmul_efficiency[-1][1] <= 1.0
    effs = [e for _, e in p.matmul_efficiency]
    assert effs == sorted(effs)
    assert p.missing_sources() == []
    assert HardwareProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    # the optimizer step as the executor runs it: 32/16-bit torch AdamW, 8-bit bitsandbytes,
    # 4-bit torchao
    assert set(p.optimizer_s_per_param) == {"32", "16", "8", "4"}
    assert all(0 < v < 1e-5 for v in p.optimizer_s_per_param.values())  # under 10 us per parameter
    with pytest.raises(TrainplanError, match="known dtypes are fp32, bf16, fp16"):
        cpu.measure_cpu(dtype="fp8", quick=True)


def test_cpu_is_cached(counted, tmp_path, quick_cpu):
    first = load("cpu")
    assert counted == [False] and first == quick_cpu
    assert (tmp_path / "hardware" / "cpu.json").exists()
    assert load("CPU") == first and counted == [False]  # second load: no measurement
    cpu._MEMO.clear()  # as in a new process: read back from the file
    assert load("cpu") == first and counted == [False]
    load("cpu", remeasure=True)
    assert counted == [False, False]


def test_cpu_memo_serves_a_new_cache_dir(counted, monkeypatch, tmp_path):
    load("cpu")
    other = tmp_path / "other"
    monkeypatch.setenv("TRAINPLAN_CACHE_DIR", str(other))
    load("cpu")
    assert counted == [False] and (other / "hardware" / "cpu.json").exists()


@pytest.mark.parametrize("content", ["{not json", "[]", '{"format": 1, "hostname": "x"}', ""])
def test_corrupt_cache_is_remeasured_with_a_warning(counted, content):
    key = cpu._host_key()
    path = cpu.cache_path()
    path.parent.mkdir(parents=True)
    if content.startswith('{"format"'):  # right key, profile missing
        content = json.dumps({"format": cpu.CACHE_FORMAT, "hostname": key[0], "torch_version": key[1],
                              "num_threads": key[2]})
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match="unreadable"):
        profile = load("cpu")
    assert counted == [False] and profile.name == "cpu"
    assert json.loads(path.read_text())["profile"]["name"] == "cpu"  # rewritten


def test_cache_from_another_host_is_remeasured(counted, monkeypatch):
    load("cpu")
    cpu._MEMO.clear()
    monkeypatch.setattr(cpu, "_host_key", lambda: ("another-host", "2.13.0", 2))
    load("cpu")
    assert counted == [False, False]


def test_save_profile_is_what_load_returns(counted, quick_cpu):
    refit = quick_cpu.with_calibration(memory_efficiency=0.5)
    path = cpu.save_profile(refit)
    assert path == cpu.cache_path()
    cpu._MEMO.clear()
    assert load("cpu") == refit and counted == []
    with pytest.raises(TrainplanError, match="only the measured 'cpu' profile"):
        cpu.save_profile(load("h100"))


def test_list_and_describe_profiles(counted):
    names = [p.name for p in trainplan.hardware_profiles.list_profiles()]
    assert names == ["a100", "a100-40gb", "cpu", "h100", "h200", "mi300a", "mi300x"]
    rows = trainplan.hardware_profiles.describe_profiles(include_cpu=False)
    by_name = {r["name"]: r for r in rows}
    assert set(by_name) == set(DATASHEET)
    assert by_name["mi300x"]["aliases"] == "mi300"
    assert by_name["h100"]["bf16_tflop_per_s"] == 989.4 and by_name["h100"]["hbm_gib"] == 80.0
    assert by_name["h100"]["intra_node_gb_per_s"] == 450.0 and by_name["h100"]["inter_node_gb_per_s"] == 50.0
    assert by_name["a100"]["hbm_tb_per_s"] == 2.039
    assert all(r["source"] for r in rows)
    assert len(trainplan.hardware_profiles.describe_profiles()) == 7


def test_import_does_not_import_torch():
    code = ("import sys, trainplan.hardware_profiles; trainplan.hardware_profiles.load('h100'); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the matmul sweep under load (fake clock, no real timing) ----------------------------------


def _fake_sweep(monkeypatch, op_s):
    """Run `matmul_rates("fp32")` with torch.mm replaced by a call that advances a fake clock by
    `op_s(n)` seconds; returns (sizes timed, rates, fake seconds spent)."""
    import types

    import torch

    from trainplan.hardware_profiles import cpu_probes as probes

    clock = [0.0]
    monkeypatch.setattr(probes, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def fake_mm(a, b, out=None):
        clock[0] += op_s(a.shape[0])
        return out

    monkeypatch.setattr(torch, "mm", fake_mm)
    rates = probes.matmul_rates("fp32", quick=False, deadline=3.0)
    sizes = [round((f / 2) ** (1 / 3)) for f, _ in rates]
    return sizes, [r for _, r in rates], clock[0]


@pytest.mark.parametrize("stalled", [(64,), (64, 128, 256)], ids=["first-size", "small-sizes"])
def test_matmul_sweep_reaches_1024_after_stalled_small_sizes(monkeypatch, stalled):
    """A loaded machine stalls small products (0.3 s for the first; 50 ms each for all up to
    256, as measured on the shared 2-core machine); extrapolating their rate once stopped the
    sweep at n=256 and left the fp32 peak ~10x low. Sizes up to 1024 are timed anyway, and the
    peak is the best rate measured (50 GFLOP/s here)."""
    rate = 50e9
    stall = 0.3 if len(stalled) == 1 else 0.05
    sizes, rates, spent = _fake_sweep(monkeypatch, lambda n: stall if n in stalled else 2 * n**3 / rate)
    assert sizes[:5] == [64, 128, 256, 512, 1024], sizes
    assert max(rates) == pytest.approx(rate)
    assert spent < 10, f"the sweep took {spent:.1f} fake seconds"


def test_matmul_sweep_stops_after_a_size_that_is_really_slow(monkeypatch):
    """An emulated dtype (1 GFLOP/s: 0.27 s per n=512 product) stops after 512: n=1024 would
    take over 2 s per product."""
    sizes, _, spent = _fake_sweep(monkeypatch, lambda n: 2 * n**3 / 1e9)
    assert sizes == [64, 128, 256, 512], sizes
    assert spent < 10, f"the sweep took {spent:.1f} fake seconds"


def test_optimizer_rate_validated_and_used_by_the_step_model():
    """A measured seconds-per-parameter rate replaces the optimizer step's roofline; bad keys
    and values name the field."""
    from trainplan.planner.api import plan_for_choice

    base = load("h100")
    with pytest.raises(TrainplanError, match="optimizer_s_per_param"):
        dataclasses.replace(base, optimizer_s_per_param={"3": 1e-9})
    with pytest.raises(TrainplanError, match="optimizer_s_per_param"):
        dataclasses.replace(base, optimizer_s_per_param={"8": -1.0})
    rated = dataclasses.replace(base, optimizer_s_per_param={"8": 2e-9})
    assert HardwareProfile.from_dict(json.loads(json.dumps(rated.to_dict()))) == rated
    case = dict(seq_len=128, micro_batch=2, activation_checkpoint="none", sp_degree=1, devices=2, zero_stage=1,
                optimizer_bits=8)
    plan = plan_for_choice("tiny-llama", rated, **case)
    n = plan.model_n_params
    assert plan.predictions.step_time_breakdown_s["optimizer"] == pytest.approx(2e-9 * n / 2, rel=1e-6)
    roof = plan_for_choice("tiny-llama", base, **case).predictions.step_time_breakdown_s["optimizer"]
    assert roof != pytest.approx(2e-9 * n / 2, rel=1e-3)  # without a rate: the traffic roofline


def test_matmul_sweep_multiplies_cold_operands(monkeypatch):
    """Issue #40, item 16: each product of a size reads the next operand set of a ring twice the
    last-level cache (1 MiB here), so no two calls in a row hit the same, cached, operands; the
    ring comes round again after all its sets (`cpu_probes.matmul_rates`)."""
    import torch

    from trainplan.hardware_profiles import cpu_probes as probes

    llc = 2**20
    monkeypatch.setattr(probes, "last_level_cache_bytes", lambda: llc)
    seen: dict[int, list[int]] = {}

    def recording_mm(a, b, out=None):
        seen.setdefault(a.shape[0], []).append(a.data_ptr())
        return out

    monkeypatch.setattr(torch, "mm", recording_mm)
    probes.matmul_rates("fp32", quick=True, deadline=1e18)
    assert set(seen) == {32, 64, 128, 256}
    for n, ptrs in seen.items():
        set_bytes = 3 * n * n * 4  # a, b and the product, fp32
        k = len(set(ptrs))  # the ring's sets
        assert k * set_bytes > 2 * llc - set_bytes, f"n={n}: {k} sets of {set_bytes} B cover less than 2 x {llc} B"
        assert len(ptrs) > k, f"n={n}: {len(ptrs)} calls never came round the ring of {k}"
        assert ptrs == [ptrs[i % k] for i in range(len(ptrs))], f"n={n}: not one set after another, in a ring"


def test_last_level_cache_bytes_reads_sysfs_or_falls_back(monkeypatch, tmp_path):
    from trainplan.hardware_profiles import cpu_probes as probes

    for i, size in enumerate(("48K", "1024K", "32768K")):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    real = probes.Path
    monkeypatch.setattr(probes, "Path", lambda p: tmp_path if p == "/sys/devices/system/cpu/cpu0/cache" else real(p))
    assert probes.last_level_cache_bytes() == 32 * 2**20
    monkeypatch.setattr(probes, "Path", lambda p: tmp_path / "absent")
    assert probes.last_level_cache_bytes() == probes._LLC_FALLBACK_BYTES
