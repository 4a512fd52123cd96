"""trainplan.modeling.offload: saved activations in host memory, bit-exact round trips, what the hooks see
under activation checkpointing, the stats, parameters left alone; the accelerator path (pinned
buffers, side stream) runs where an accelerator is."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from trainplan.errors import TrainplanError
from trainplan.executor.apply.checkpointing import apply_checkpointing
from trainplan.modeling import offload
from trainplan.modeling.offload import (
    OffloadedTensor,
    OffloadStats,
    offload_block,
    offload_saved_activations,
    unoffload_block,
)

B, S, HIDDEN, LAYERS = 2, 24, 64, 2
"""The step's shape: b*s = 48 rows, no parameter has 48 rows or columns."""


@pytest.fixture(scope="module")
def llama(tiny_llama, one_thread):
    """The brief's tiny Llama: hidden 64, MLP 160, 4 heads, 2 KV heads, 2 layers, vocabulary 128."""
    return tiny_llama(intermediate_size=160, vocab_size=128)


def train_step(model, autocast: torch.dtype | None = None):
    """(loss, {name: grad}) of one step on fixed tokens (b, s) = (2, 24)."""
    ids = torch.randint(0, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_same_step(ref, got):
    assert torch.equal(ref[0], got[0])
    assert ref[1].keys() == got[1].keys()
    for name, grad in ref[1].items():
        assert torch.equal(grad, got[1][name]), name


class Spy(offload_saved_activations):
    """Records what each pack offloaded (the tensor as autograd handed it)."""

    seen: list[torch.Tensor] = []

    def pack(self, t):
        out = super().pack(t)
        if isinstance(out, OffloadedTensor):
            Spy.seen.append(t)
        return out


@pytest.fixture
def spy(monkeypatch):
    Spy.seen = []
    monkeypatch.setattr(offload, "offload_saved_activations", Spy)
    return Spy.seen


def count_calls(module: nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))  # the recompute stops early
    return calls


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "full-checkpoint"])
def test_train_step_is_bit_exact_and_counts_the_block_inputs(llama, checkpointed, spy):
    ref = train_step(llama)
    model, stats = copy.deepcopy(llama), OffloadStats()
    if checkpointed:  # the order offload_block documents: checkpoint first, offload outside it
        apply_checkpointing(model, ["full"] * LAYERS)
    for layer in model.model.layers:
        offload_block(layer, stats=stats)
    mlp_calls = count_calls(model.model.layers[0].mlp)
    assert_same_step(ref, train_step(model))
    assert stats.host_bytes == 0  # every item was unpacked and released by the backward
    assert stats.host_peak_bytes == stats.offloaded_bytes
    if checkpointed:
        # the outer hook sees only the checkpoint's saved inputs: each block's hidden states
        assert stats.offloaded_bytes == LAYERS * B * S * HIDDEN * 4
        assert stats.tensors == LAYERS and [tuple(t.shape) for t in spy] == [(B, S, HIDDEN)] * LAYERS
        assert stats.prefetched == 1  # unpacking block 1's input started block 0's
        assert mlp_calls[0] == 2  # forward, then the recompute in the backward
    else:
        assert stats.tensors > 10 * LAYERS and stats.offloaded_bytes > 10 * LAYERS * B * S * HIDDEN * 4
        assert mlp_calls[0] == 1


def test_offload_inside_the_checkpoint_takes_everything_and_nothing_is_recomputed(llama):
    """The wrong order: the offload hooks are innermost, the checkpoint's hooks see nothing."""
    ref, plain = train_step(llama), OffloadStats()
    model = copy.deepcopy(llama)
    for layer in model.model.layers:
        offload_block(layer, stats=plain)
    train_step(model)  # the offload of every saved tensor, no checkpoint
    model, inside = copy.deepcopy(llama), OffloadStats()
    for layer in model.model.layers:
        offload_block(layer, stats=inside)
    apply_checkpointing(model, ["full"] * LAYERS)
    mlp_calls = count_calls(model.model.layers[0].mlp)
    assert_same_step(ref, train_step(model))
    assert (inside.tensors, inside.offloaded_bytes) == (plain.tensors, plain.offloaded_bytes)
    assert mlp_calls[0] == 1


def test_parameters_and_their_casts_are_never_offloaded(llama, spy):
    model = copy.deepcopy(llama)
    for layer in model.model.layers:
        offload_block(layer)
    for autocast in (None, torch.bfloat16):
        spy.clear()
        train_step(model, autocast)
        assert spy
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        shapes = {s for p in model.parameters() for s in (tuple(p.shape), tuple(p.shape)[::-1])}
        for t in spy:
            assert not isinstance(t, nn.Parameter) and t.untyped_storage().data_ptr() not in params
            assert tuple(t.shape) not in shapes, tuple(t.shape)


def test_non_contiguous_saved_tensors_round_trip():
    """Transposed, gapped, expanded and offset views: values and strides come back exact."""
    torch.manual_seed(0)
    a = torch.randn(64, 48, requires_grad=True)
    w = nn.Parameter(torch.randn(64, 32))
    v = torch.randn(1, 48, requires_grad=True)

    def loss_fn():
        h = a.sin()
        e = (v * 2).expand(64, 48)  # stride (0, 1)
        return ((h.t() @ w).square().sum() + (h[:, ::2] * h[:, 1::2]).sum() + (e * h).sum()
                + h[5:].mul(h[5:].cos()).sum())

    ref_loss = loss_fn()
    ref = torch.autograd.grad(ref_loss, (a, w, v))
    Spy.seen = []
    with Spy(min_numel=1):
        loss = loss_fn()
    assert torch.equal(loss, ref_loss)
    for r, g in zip(ref, torch.autograd.grad(loss, (a, w, v)), strict=True):
        assert torch.equal(r, g)
    # h.t(), the gapped slices, the expand and the offset view h[5:] were offloaded
    assert {(tuple(t.stride()), t.storage_offset()) for t in Spy.seen} >= {((1, 48), 0), ((48, 2), 0), ((0, 1), 0),
                                                                             ((48, 2), 1), ((48, 1), 240)}

    hooks = offload_saved_activations(min_numel=1)
    base = torch.randn(10, 12, 8)
    for t in (base.transpose(0, 2), base[:, ::3, 1:], base[2:], base[:1].expand(5, 12, 8), base.permute(2, 0, 1)):
        p = hooks.pack(t)
        assert isinstance(p, OffloadedTensor)
        assert p.host.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
        out = hooks.unpack(p)
        assert torch.equal(out, t) and out.stride() == t.stride() and out.dtype == t.dtype
        assert out.untyped_storage().data_ptr() not in (base.untyped_storage().data_ptr(),
                                                         p.host.untyped_storage().data_ptr())


def test_stats_dedup_and_release():
    stats = OffloadStats()
    a = torch.randn(32, 64, requires_grad=True)
    w1, w2 = nn.Parameter(torch.randn(32, 64)), nn.Parameter(torch.randn(32, 64))
    h = torch.randn(32, 64).exp()
    with offload_saved_activations(stats=stats) as counters:
        y1 = (h * w1).sum() + (a * 2).sin().sum()  # saves h and a * 2
        y2 = (h * w2).sum()  # saves h again: the same item
    assert counters is stats
    one = 32 * 64 * 4
    assert (stats.tensors, stats.offloaded_bytes, stats.host_bytes) == (2, 2 * one, 2 * one)
    y1.backward()  # frees y1's nodes: a * 2 is released, h is still saved by y2's mul
    assert stats.host_bytes == one
    y2.backward()
    assert (stats.host_bytes, stats.host_peak_bytes) == (0, 2 * one)
    stats.reset()
    assert (stats.offloaded_bytes, stats.host_peak_bytes, stats.tensors, stats.prefetched) == (0, 0, 0, 0)
    with offload_saved_activations(stats=stats) as counters:
        small = (torch.randn(10, 10, requires_grad=True) * 2).sin()  # saves 100 elements < min_numel
    assert stats.tensors == 0 and small.requires_grad
    hooks = offload_saved_activations(stats=stats)
    for t in (torch.arange(4096), torch.ones(4096, dtype=torch.bool), torch.randn(1023), torch.randn(0, 4096)):
        assert hooks.pack(t) is t
    with pytest.raises(TrainplanError, match="min_numel"):
        offload_saved_activations(min_numel=-1)


def test_offload_block_wraps_and_unwraps(llama):
    model = copy.deepcopy(llama)
    layer = model.model.layers[0]
    names = [n for n, _ in model.named_parameters()]
    offload_block(layer)
    assert [n for n, _ in model.named_parameters()] == names and isinstance(layer.offload_stats, OffloadStats)
    with pytest.raises(TrainplanError, match="already offloaded"):
        offload_block(layer)
    unoffload_block(layer)
    assert "forward" not in layer.__dict__
    with pytest.raises(TrainplanError, match="not offloaded"):
        unoffload_block(layer)
    apply_checkpointing(model, ["full"] * LAYERS)
    checkpointed = layer.forward
    offload_block(layer)
    unoffload_block(layer)
    assert layer.forward is checkpointed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs a CUDA or ROCm device")
def test_accelerator_path_pinned_side_stream_and_bit_exact():
    device = torch.accelerator.current_accelerator()
    torch.manual_seed(0)
    base = torch.randn(64, 48, 8, device=device)
    hooks = offload_saved_activations(min_numel=1)
    for t in (base, base.transpose(0, 2), base[:, ::3], base[:1].expand(4, 48, 8)):
        p = hooks.pack(t)
        assert p.host.device.type == "cpu" and p.host.is_pinned() and p.event is not None
        out = hooks.unpack(p)
        assert out.device == t.device and out.stride() == t.stride() and torch.equal(out, t)

    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
                            for _ in range(4)]).to(device)
    x = torch.randn(512, 256, device=device, requires_grad=True)
    ref_loss = model(x).square().mean()
    ref = torch.autograd.grad(ref_loss, [x, *model.parameters()])
    stats = OffloadStats()
    for block in model:
        offload_block(block, stats=stats)
    torch.accelerator.synchronize()
    before = torch.accelerator.memory_allocated()
    loss = model(x).square().mean()
    torch.accelerator.synchronize()
    kept = torch.accelerator.memory_allocated() - before
    got = torch.autograd.grad(loss, [x, *model.parameters()])
    assert torch.equal(loss, ref_loss)
    for r, g in zip(ref, got, strict=True):
        assert torch.equal(r, g)
    assert stats.offloaded_bytes >= 4 * 2 * 512 * 1024 * 4  # each block's GELU input and output
    assert kept < stats.offloaded_bytes / 2  # what autograd saved is on the host, not the device
    assert stats.prefetched > 0 and stats.host_bytes == 0
