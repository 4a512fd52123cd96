"""trainplan.costmodels.step.memory: predicted peak against MemTracker on a real step (STYLE 11), model-state
formulas against published figures, and a monotonicity property."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainplan.costmodels.step.memory import CATEGORIES, model_state_bytes, zero1_partition
from trainplan.costmodels.step.model import Choice, StepModel
from trainplan.costmodels.step.optimizer_states import MIN_QUANT_NUMEL, adam_state_bytes, quantization_map_bytes
from trainplan.errors import TrainplanError
from trainplan.executor.apply.checkpointing import apply_checkpointing
from trainplan.executor.optimizers import build_optimizer
from trainplan.hardware_profiles import load

RTOL = 0.01
ATOL_BYTES = 4096 + 512
"""A page and the position ids: the head's few-hundred-byte leftovers (rotary tables, position
ids, made by the model's own forward since the capture traces it, issue #20), which the replay
keeps to the head's backward."""
POLICIES = ("none", "full", "save_matmuls", "save_attention")
SMALL, LARGE = (1, 32), (2, 64)  # (micro-batch, sequence): optimizer-step peak / backward peak

CHECKPOINTED_BACKWARD = (
    "known gap: when the peak falls in a checkpointed block's backward (b=2, s=64), MemTracker "
    "labels the recompute's tensors temporaries (made during the backward) where the replay counts "
    "them activations; the totals agree within 1% since saved tensors are held to the end of their "
    "autograd node's backward (trainplan.planner.capture.trace, issue #20)")


def _known_failures(policy: str, bits: int, size: tuple[int, int]) -> tuple[list[str], list[str]]:
    """(reasons the total fails, reasons a category fails) for one grid case."""
    if size == LARGE and policy in ("full", "save_attention"):
        return [], [CHECKPOINTED_BACKWARD]
    return [], []


def _grid(which: int):
    for policy, bits, size in itertools.product(POLICIES, (32, 8), (SMALL, LARGE)):
        reasons = _known_failures(policy, bits, size)[which]
        marks = [pytest.mark.xfail(strict=True, reason="; ".join(reasons))] if reasons else []
        yield pytest.param(policy, bits, size, marks=marks, id=f"{policy}-{bits}bit-b{size[0]}s{size[1]}")


def _measured(tiny_llama, measured_peak, policy: str, bits: int, b: int, s: int) -> dict[str, float]:
    """MemTracker's peak by category over one real step, after two warm-up steps (as the
    executor measures)."""
    model = tiny_llama()
    model.train()
    apply_checkpointing(model, (policy,) * model.config.num_hidden_layers)
    return measured_peak(model, build_optimizer(model.parameters(), bits, lr=1e-3), b, s)


def _predicted(step_model: StepModel, policy: str, bits: int, b: int, s: int, *,
               devices: int = 1, zero_stage: int = 0) -> dict[str, float]:
    c = Choice(sp_degree=1, zero_stage=zero_stage, micro_batch=b, seq_len=s,
               policies=(policy,) * len(step_model.blocks), precision="fp32",
               optimizer_bits=bits, devices=devices)
    return step_model.evaluate(c).memory.as_dict()


@pytest.fixture(scope="module")
def measurements(tiny_llama, measured_peak, one_thread):
    cache: dict = {}

    def get(policy, bits, size):
        key = (policy, bits, size)
        if key not in cache:
            cache[key] = _measured(tiny_llama, measured_peak, policy, bits, *size)
        return cache[key]

    return get


# ---------------------------------------------------------------- prediction vs MemTracker


@pytest.mark.parametrize("policy, bits, size", list(_grid(0)))
def test_peak_total_matches_memtracker(step_model, measurements, policy, bits, size):
    pred = _predicted(step_model, policy, bits, *size)["total"]
    meas = measurements(policy, bits, size)["total"]
    assert math.isclose(pred, meas, rel_tol=RTOL), (
        f"{policy}, {bits}-bit, (b, s)={size}: predicted peak {pred:.0f} B, MemTracker {meas:.0f} B "
        f"({(pred - meas) / meas:+.2%})")


@pytest.mark.parametrize("policy, bits, size", list(_grid(1)))
def test_peak_categories_match_memtracker(step_model, measurements, policy, bits, size):
    pred = _predicted(step_model, policy, bits, *size)
    meas = measurements(policy, bits, size)
    bad = {c: (pred[c], meas[c]) for c in CATEGORIES
           if not math.isclose(pred[c], meas[c], rel_tol=RTOL, abs_tol=ATOL_BYTES)}
    assert not bad, (f"{policy}, {bits}-bit, (b, s)={size}: category (predicted, measured) bytes "
                     f"off by more than {RTOL:.0%}: {bad}")


# ---------------------------------------------------------------- optimizer states, measured


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the distinct tensor storages held in the optimizer's state."""
    seen = {}
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


NUMELS = (100_000, 8192, MIN_QUANT_NUMEL, MIN_QUANT_NUMEL - 1, 1000, 1)


def _stepped(bits: int) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.randn(n)) for n in NUMELS]
    opt = build_optimizer(params, bits, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def test_adamw32_state_bytes_match_torch():
    pred = sum(adam_state_bytes(n, 32) for n in NUMELS)
    meas = _state_bytes(_stepped(32))
    assert pred == meas, f"predicted {pred} B of AdamW states, torch holds {meas} B"


def test_adamw8bit_state_bytes_match_bitsandbytes():
    pred = sum(adam_state_bytes(n, 8) for n in NUMELS) + quantization_map_bytes(8)
    meas = _state_bytes(_stepped(8))
    assert pred == meas, f"predicted {pred} B of AdamW8bit states, bitsandbytes holds {meas} B"


# ---------------------------------------------------------------- published figures


def test_mixed_precision_adam_is_16_bytes_per_parameter():
    """Rajbhandari et al. 2020, Sec. 3.1: 2 (bf16 weight) + 2 (grad) + 4 (fp32 master) + 4 + 4
    (Adam m, v) = 16 bytes per parameter."""
    numels = [10**6, 4096, 1000, 7, 1]
    n = sum(numels)
    s = model_state_bytes(numels, weight_bytes=2, grad_bytes=2, master_bytes=4, optimizer_bits=32,
                          zero_stage=0, shard_degree=1, adamw="single_tensor")
    per_param = (s.params + s.grads + s.optimizer - 4 * len(numels)) / n  # less AdamW's step tensors
    assert per_param == 16, f"{per_param} bytes per parameter, paper 16"


# Rajbhandari et al. 2020, Fig. 1: Psi = 7.5B, N = 64, K = 12; per-device model states in GB
ZERO_FIG1 = [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.88)]


@pytest.mark.parametrize("stage, paper_gb", ZERO_FIG1)
def test_zero_stages_match_the_paper(stage, paper_gb):
    psi, n = 7_500_000_000, 64
    s = model_state_bytes([psi], weight_bytes=2, grad_bytes=2, master_bytes=4, optimizer_bits=32,
                          zero_stage=stage, shard_degree=n, adamw="foreach")
    got = (s.params + s.grads + s.optimizer) / 1e9
    assert math.isclose(got, paper_gb, rel_tol=0.005), f"stage {stage}: {got:.3f} GB, paper {paper_gb} GB"
    # each stage divides exactly its own terms by N
    assert s.params == 2 * psi / (n if stage >= 3 else 1), (stage, s.params)
    assert s.grads == 2 * psi / (n if stage >= 2 else 1), (stage, s.grads)
    assert s.optimizer == (12 * psi + 4) / (n if stage >= 1 else 1), (stage, s.optimizer)


def test_zero1_shards_whole_tensors_as_torch_does():
    """torch's ZeroRedundancyOptimizer gives whole tensors, largest first, to the rank with the
    fewest elements so far: [10, 7, 5, 3, 1] over 2 ranks -> {10, 3} and {7, 5, 1}; the
    executed stage 1 counts the larger share, the paper's elementwise half of all."""
    numels = [1, 5, 10, 3, 7]
    assert sorted(numels[i] for i in zero1_partition(numels, 2)) == [3, 10]
    kw = dict(weight_bytes=4, grad_bytes=4, master_bytes=0, optimizer_bits=32, zero_stage=1,
              shard_degree=2, adamw="single_tensor")
    run = model_state_bytes(numels, as_executed=True, **kw)
    assert run.optimizer == adam_state_bytes(10, 32) + adam_state_bytes(3, 32)
    assert model_state_bytes(numels, **kw).optimizer == sum(adam_state_bytes(n, 32) for n in numels) / 2


def test_executed_zero2_keeps_parameters_sharded_at_rest():
    """FSDP2's stage 2 shards parameters between steps (all-gathered from forward to backward,
    `FsdpLayout`); the paper's stage 2 replicates them."""
    kw = dict(weight_bytes=4, grad_bytes=4, master_bytes=0, optimizer_bits=32, zero_stage=2,
              shard_degree=4, adamw="single_tensor")
    assert model_state_bytes([1000], as_executed=True, **kw).params == 1000
    assert model_state_bytes([1000], **kw).params == 4000


@pytest.mark.parametrize("numel, bits, expected", [
    (1000, 32, 2 * 1000 * 4 + 4),                      # fp32 m, v + AdamW's fp32 step tensor
    (10**6, 16, 2 * 10**6 * 2 + 4),                    # torch AdamW over bf16 parameters
    (MIN_QUANT_NUMEL - 1, 8, 2 * (MIN_QUANT_NUMEL - 1) * 4),  # bitsandbytes keeps small tensors in fp32
    (MIN_QUANT_NUMEL - 1, 4, 2 * (MIN_QUANT_NUMEL - 1) * 4 + 4),  # torchao: in the parameter dtype
    (0, 32, 4),
])
def test_adam_state_bytes_exact(numel, bits, expected):
    got = adam_state_bytes(numel, bits)
    assert got == expected, f"numel={numel}, {bits}-bit: {got} B, expected {expected} B"


@pytest.mark.parametrize("bits, per_param", [
    (8, 2 + 2 * 4 / 256),   # Dettmers et al. 2022: two 1-byte states + an fp32 absmax per 256-block
    (4, 1 + 2 * 4 / 128),   # Li et al. 2023: two 4-bit states + an fp32 absmax per 128-block
])
def test_quantized_adam_bytes_per_parameter(bits, per_param):
    numel = 2**24
    got = adam_state_bytes(numel, bits) / numel
    assert math.isclose(got, per_param, rel_tol=1e-3), f"{bits}-bit: {got:.5f} B/param, paper {per_param:.5f}"


@pytest.mark.parametrize("kwargs, match", [
    (dict(zero_stage=4), "zero_stage=4"),
    (dict(zero_stage=-1), "zero_stage=-1"),
    (dict(shard_degree=0), "shard_degree=0"),
    (dict(optimizer_bits=2), "optimizer_bits=2"),
])
def test_model_state_bytes_errors(kwargs, match):
    base = dict(weight_bytes=2, grad_bytes=2, master_bytes=4, optimizer_bits=32, zero_stage=0,
                shard_degree=1, adamw="single_tensor")
    with pytest.raises(TrainplanError, match=match):
        model_state_bytes([10], **{**base, **kwargs})


def test_empty_model_has_no_state_bytes():
    s = model_state_bytes([], weight_bytes=2, grad_bytes=2, master_bytes=4, optimizer_bits=32,
                          zero_stage=0, shard_degree=1, adamw="single_tensor")
    assert (s.params, s.grads, s.optimizer, s.optimizer_step_temp) == (0, 0, 0, 0)


# ---------------------------------------------------------------- property


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=st.sampled_from(POLICIES), bits=st.sampled_from((32, 8)),
       b=st.integers(1, 16), s=st.integers(1, 4096), db=st.integers(0, 4), ds=st.integers(0, 512))
def test_peak_is_monotone_in_micro_batch_and_sequence(step_model, policy, bits, b, s, db, ds):
    base = _predicted(step_model, policy, bits, b, s)["total"]
    for b2, s2 in ((b + db, s), (b, s + ds), (b + db, s + ds)):
        more = _predicted(step_model, policy, bits, b2, s2)["total"]
        assert more >= base, (f"{policy}, {bits}-bit: peak at (b, s)=({b2}, {s2}) is {more:.0f} B, "
                              f"below {base:.0f} B at ({b}, {s})")


def test_zero_sharding_never_adds_memory(step_model):
    """More ZeRO sharding over 8 devices never raises the per-device peak (fixed b, s, policy)."""
    h100 = load("h100")
    sm = StepModel(step_model.regions, step_model.blocks, step_model.param_numels, h100,
                   n_heads=step_model.n_heads, n_kv_heads=step_model.n_kv_heads,
                   head_dim=step_model.head_dim)
    for policy in POLICIES:
        peaks = [_predicted(sm, policy, 32, 2, 64, devices=8, zero_stage=z)["total"] for z in (0, 1, 2)]
        assert peaks == sorted(peaks, reverse=True), f"{policy}: peaks by ZeRO stage 0, 1, 2: {peaks}"
