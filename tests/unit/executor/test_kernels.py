"""What a run records on an accelerator, tested without one: the kernel time split
(`trainplan.executor.kernels`), the record's accelerator fields and their absence on CPU
(`trainplan.executor.measure.measured_step`), and whether a device is the plan's hardware."""

from __future__ import annotations

import math

import pytest
import torch

from trainplan.executor.kernels import KINDS, kernel_kind, merge_splits, profile_step, split_kernels
from trainplan.executor.measure import (
    WARMUP_STEPS_UNMEASURED,
    accelerator_fn,
    device_name,
    measured_step,
    record_device_memory,
)
from trainplan.executor.record import RunRecord, same_hardware


@pytest.mark.parametrize(("name", "kind"), [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("ncclKernel_ReduceScatter_RING_LL_Sum_float", "communication"),  # RCCL names its kernels so too
    ("nvjet_tst_128x256_64x4_2x1_v_bz_TNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", "matmul"),
    ("Cijk_Alik_Bljk_BBS_BH_MT128x128x64_MI32x32x8x1", "matmul"),  # rocBLAS / hipBLASLt
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "matmul"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", "matmul"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>", "other"),
    ("Memcpy DtoD (Device -> Device)", "other"),
])
def test_kernel_kind(name, kind):
    assert kernel_kind(name) == kind


def test_split_sums_each_kind_and_counts_overlap_once():
    kernels = [("gemm_a", 0.0, 4.0), ("ncclDevKernel_AllGather", 1.0, 6.0), ("elementwise", 5.0, 7.0),
               ("gemm_b", 10.0, 12.0), ("empty", 13.0, 13.0)]
    split = split_kernels(kernels)
    assert {k: split[k] for k in KINDS} == {"matmul": 6.0, "communication": 5.0, "other": 2.0}
    assert split["busy"] == 9.0  # [0, 7] and [10, 12]
    assert split_kernels([]) == {"matmul": 0.0, "communication": 0.0, "other": 0.0, "busy": 0.0}


def test_merge_splits_keeps_the_mean_per_step():
    a = {"matmul": 2.0, "wall": 4.0}
    merged = merge_splits(merge_splits(None, a), {"matmul": 4.0, "wall": 8.0})
    assert merged == {"matmul": 3.0, "wall": 6.0, "steps": 2.0}
    assert merge_splits(merged, {"matmul": 6.0, "wall": 12.0})["matmul"] == pytest.approx(4.0)


def test_cpu_is_not_profiled_and_has_no_accelerator_memory():
    cpu = torch.device("cpu")
    assert profile_step(lambda: 7, cpu) == (7, None)
    assert accelerator_fn(cpu, "max_memory_allocated") is None
    rec = RunRecord(model="m", hw_planned="cpu", device="cpu", same_hardware=True)
    record_device_memory(rec, cpu)
    assert rec.peak_memory_bytes == {} and rec.device_memory_bytes is None


def test_measured_step_on_cpu_times_and_leaves_the_accelerator_fields_none():
    rec = RunRecord(model="m", hw_planned="cpu", device="cpu", same_hardware=True)
    for step in (0, 1, WARMUP_STEPS_UNMEASURED + 2, WARMUP_STEPS_UNMEASURED + 3, 6):  # profiled steps too
        assert measured_step(step, lambda s: float(s), rec, torch.device("cpu"), None, None) == float(step)
    assert len(rec.step_times_s) == 5 and len(rec.step_cpu_times_s) == 5
    assert rec.step_max_allocated_bytes is None and rec.step_max_reserved_bytes is None
    assert rec.kernel_time_s is None and rec.device_memory_bytes is None
    assert math.isnan(rec.max_allocated_bytes) and math.isnan(rec.max_reserved_bytes)


def test_record_round_trips_the_accelerator_fields(tmp_path):
    rec = RunRecord(model="m", hw_planned="h200", device="cuda:0 (NVIDIA H200)", same_hardware=True,
                    step_times_s=[0.1, 0.1, 0.1], step_max_allocated_bytes=[3e9, 4e9, 3.5e9],
                    step_max_reserved_bytes=[5e9, 5e9, 6e9], device_memory_bytes={"total": 1.5e11, "used": 7e9,
                                                                                   "reserved": 6e9},
                    kernel_time_s={"matmul": 0.05, "communication": 0.01, "other": 0.02, "busy": 0.07,
                                   "wall": 0.12, "steps": 2.0})
    back = RunRecord.from_json(rec.to_json(tmp_path / "record.json"))
    assert back == rec
    assert back.max_allocated_bytes == 4e9 and back.max_reserved_bytes == 6e9
    old = RunRecord.from_json('{"model": "m", "hw_planned": "cpu", "device": "cpu", "same_hardware": true}')
    assert old.kernel_time_s is None and old.step_max_allocated_bytes is None


def test_same_hardware():
    assert same_hardware("cpu", device_name(torch.device("cpu"))) and not same_hardware("h200", "cpu")
    assert not same_hardware("cpu", "cuda:0 (NVIDIA H200)")
    assert same_hardware("h200", "cuda:0 (NVIDIA H200)")
    assert not same_hardware("h100", "cuda:0 (NVIDIA H200)") and not same_hardware("h200", "cuda")
    assert same_hardware("a100", "cuda:1 (NVIDIA A100-SXM4-80GB)")
    assert not same_hardware("my-gpu", "cuda:0 (NVIDIA H200)")  # a profile from a file: not known by name
    assert same_hardware("mi300", "cuda:0 (AMD Instinct MI300X)")
    assert not same_hardware("mi300a", "cuda:0 (AMD Instinct MI300X)")
    assert not same_hardware("h200", "xpu:0 (NVIDIA H200)")  # another device type


def test_measured_step_on_an_accelerator_records_peaks_and_the_split(monkeypatch):
    """The accelerator bookkeeping with torch's device functions replaced: peaks reset before every
    step and read after it, per timed step into the lists, every step into the total; the
    profiled steps' split averaged; the device's memory noted."""
    import trainplan.executor.measure as measure

    peak = {"now": 0.0}
    resets = []
    fake = {"max_memory_allocated": lambda dev: peak["now"], "max_memory_reserved": lambda dev: peak["now"] + 100,
            "memory_reserved": lambda dev: 500.0, "get_memory_info": lambda dev: (1000, 5000),
            "reset_peak_memory_stats": lambda dev: resets.append(dev)}
    split = {"matmul": 1.0, "communication": 0.5, "other": 0.25, "busy": 1.5, "wall": 2.0}
    monkeypatch.setattr(measure, "accelerator_fn", lambda dev, name: fake.get(name))
    monkeypatch.setattr(measure, "_synchronize", lambda dev: None)
    monkeypatch.setattr(measure, "profile_step", lambda fn, dev: (fn(), dict(split)))

    def train_step(step: int) -> float:
        peak["now"] = 1000.0 + 10 * step if step != 4 else 9999.0  # the largest peak in a profiled step
        return float(step)

    rec = RunRecord(model="m", hw_planned="h200", device="cuda:0 (NVIDIA H200)", same_hardware=True)
    for step in range(8):
        measured_step(step, train_step, rec, torch.device("cuda"), None, None)
    assert len(resets) == 8
    assert rec.step_max_allocated_bytes == [1000.0, 1010.0, 1020.0, 1060.0, 1070.0]  # steps 0, 1, 2, 6, 7
    assert rec.step_max_reserved_bytes == [1100.0, 1110.0, 1120.0, 1160.0, 1170.0]
    assert len(rec.step_times_s) == 5 and rec.max_allocated_bytes == 1070.0
    assert rec.peak_memory_bytes == {"total": 9999.0}
    assert rec.kernel_time_s == {**split, "steps": 2.0}
    assert rec.device_memory_bytes == {"total": 5000.0, "used": 4000.0, "reserved": 500.0}
