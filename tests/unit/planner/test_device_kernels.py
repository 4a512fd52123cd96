"""Capture with the target device's kernels (`trainplan.planner.capture.device_kernels`): a plan for a GPU
profile sees flash attention and 1-byte dropout masks; the CPU profile keeps the CPU's."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from trainplan.planner.capture.device_kernels import gpu_dropout, gpu_sdpa, target_kernels


def _llama(attention_dropout: float):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=512, attention_dropout=attention_dropout,
                                   use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def _attention_ops(graph) -> list[str]:
    r = graph.regions["block0"]
    return [r.graph.nodes[n]["op"] for n in r.fwd_nodes() if "attention" in r.graph.nodes[n]["op"]]


def _retained_at(graph, s: int) -> float:
    from trainplan.costmodels.step.memory import simulate_region

    return simulate_region(graph.regions["block0"], 1, s).retained


@pytest.fixture(scope="module")
def captures():
    from trainplan.planner.capture.setup import capture_model

    out = {}
    for device in ("cpu", "cuda"):
        for p in (0.0, 0.1):
            out[device, p] = capture_model(_llama(p), "bf16-mixed", device_type=device)[0]
    return out


def test_gpu_capture_runs_flash_attention_and_the_cpu_capture_the_cpus(captures):
    assert _attention_ops(captures["cuda", 0.0]) == ["aten._scaled_dot_product_flash_attention.default"]
    assert _attention_ops(captures["cpu", 0.0]) == ["aten._scaled_dot_product_flash_attention_for_cpu.default"]
    # without dropout both flash kernels keep the same tensors, to the philox seed and offset
    for s in (128, 512):
        cpu, gpu = _retained_at(captures["cpu", 0.0], s), _retained_at(captures["cuda", 0.0], s)
        assert abs(gpu - cpu) <= 64, (s, cpu, gpu)


def test_attention_dropout_keeps_no_s_squared_tensor_on_a_gpu(captures):
    """With dropout the CPU falls back to the math kernel, which keeps the s x s attention
    probabilities and mask; CUDA's flash kernel regenerates its mask from a seed: the GPU
    capture's saved bytes grow linearly in s, the CPU capture's quadratically."""
    gpu, cpu = captures["cuda", 0.1], captures["cpu", 0.1]
    assert _attention_ops(gpu) == ["aten._scaled_dot_product_flash_attention.default"]
    g = [_retained_at(gpu, s) for s in (256, 512, 768)]
    c = [_retained_at(cpu, s) for s in (256, 512, 768)]
    assert g[2] - g[1] == pytest.approx(g[1] - g[0], rel=1e-6)  # linear in s
    assert c[2] - c[1] > 1.3 * (c[1] - c[0])  # quadratic in s
    assert g[2] < 0.5 * c[2]


def test_gpu_dropout_keeps_a_one_byte_mask():
    with FakeTensorMode():
        x = torch.empty(8, 16, dtype=torch.bfloat16, requires_grad=True)
        with target_kernels("cuda"):
            y = torch.nn.functional.dropout(x, 0.1, True)
        assert y.grad_fn is not None
        _, mask = torch.ops.aten.native_dropout(x, 0.1, True)
        assert mask.dtype == torch.bool
    assert gpu_dropout(x, 0.0, True) is x and gpu_dropout(x, 0.5, False) is x


def test_fp32_and_masked_attention_use_memory_efficient_attention_with_repeated_kv():
    with FakeTensorMode():
        q = torch.empty(1, 4, 32, 16, requires_grad=True)
        kv = torch.empty(1, 2, 32, 16, requires_grad=True)
        out = gpu_sdpa(q, kv, kv, is_causal=True)
        assert out.shape == q.shape
        assert "efficient" in str(out.grad_fn).lower()


def test_cpu_target_changes_nothing():
    f = torch.nn.functional.scaled_dot_product_attention
    with target_kernels("cpu"):
        assert torch.nn.functional.scaled_dot_product_attention is f
    with target_kernels("cuda"):
        assert torch.nn.functional.scaled_dot_product_attention is gpu_sdpa
    assert torch.nn.functional.scaled_dot_product_attention is f
