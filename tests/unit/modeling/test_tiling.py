"""trainplan.modeling.tiling: tiled logits+loss and TiledMLP equal the untiled computation (values and
gradients, fp32 and bf16 autocast, nested in the executor's block checkpointing), save the memory
one chunk's intermediates imply (MemTracker), and trace with make_fx on fake tensors as the
capture traces a region (the recompute in the backward)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from trainplan.errors import TrainplanError
from trainplan.modeling.loss import lm_loss
from trainplan.modeling.tiling import (
    UNTILED_FORWARD_ATTR,
    check_chunks,
    find_mlp,
    tile_mlp,
    tiled_forward,
    tiled_lm_loss,
    untile_mlp,
)

RTOL = 1e-5
"""fp32: tiling changes only the summation order of the loss and the weight gradients."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# --- check_chunks ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_check_chunks_refuses(bad):
    with pytest.raises(TrainplanError, match=r"loss_chunks=.*is not valid: use a whole number >= 1") as e:
        check_chunks(bad, what="loss_chunks")
    assert repr(bad) in str(e.value) and "\n" not in str(e.value)


def test_check_chunks_accepts_whole_numbers():
    import numpy as np

    assert check_chunks(1, what="mlp_chunks") == 1
    got = check_chunks(np.int64(8), what="mlp_chunks")
    assert got == 8 and type(got) is int


# --- tiled_lm_loss ----------------------------------------------------------------------------


def _loss_case(s: int, b: int = 2, h: int = 16, v: int = 40, dtype=torch.float32):
    torch.manual_seed(0)
    hidden = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    head = nn.Linear(h, v, bias=False, dtype=dtype)
    labels = torch.randint(0, v, (b, s))
    labels[0, :3] = -100
    labels[1, -2:] = -100
    return hidden, head, labels


def _loss_and_grads(loss_fn, hidden, head, labels):
    hidden.grad, head.weight.grad = None, None
    loss = loss_fn(hidden, head, labels)
    loss.backward()
    return loss.detach(), hidden.grad.clone(), head.weight.grad.clone()


@pytest.mark.parametrize("s,chunks", [(16, 1), (16, 2), (16, 3), (16, 8), (13, 4), (13, 20)])
def test_tiled_loss_equals_untiled(s, chunks):
    """Loss and gradients (hidden, head weight) as `lm_loss(head(hidden))`; uneven splits and
    more chunks than tokens included."""
    hidden, head, labels = _loss_case(s)
    want = _loss_and_grads(lambda x, hd, lab: lm_loss(hd(x), lab), hidden, head, labels)
    got = _loss_and_grads(lambda x, hd, lab: tiled_lm_loss(x, hd, lab, chunks), hidden, head, labels)
    for g, w, what in zip(got, want, ("loss", "d hidden", "d weight"), strict=True):
        assert _rel(g, w) <= RTOL, f"chunks {chunks}, s {s}: {what} off by {_rel(g, w):.2e}"
    if chunks == 1:  # the same ops: bit-identical
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_tiled_loss_ignores_all_ignored_chunk():
    """A chunk whose labels are all ignored adds nothing (the count is over the whole batch)."""
    hidden, head, labels = _loss_case(12)
    labels[:, :6] = -100
    want = lm_loss(head(hidden), labels)
    assert _rel(tiled_lm_loss(hidden, head, labels, 2), want) <= RTOL


def test_tiled_loss_bf16_autocast_smoke():
    hidden, head, labels = _loss_case(16, h=32, v=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = lm_loss(head(hidden), labels)
        got = tiled_lm_loss(hidden, head, labels, 4)
    got.backward()
    assert got.dtype == torch.float32 and hidden.grad is not None
    assert abs(got.item() - want.item()) <= 1e-2 * abs(want.item())


def test_tiled_loss_refuses_bad_chunks():
    hidden, head, labels = _loss_case(8)
    with pytest.raises(TrainplanError, match="loss_chunks=0"):
        tiled_lm_loss(hidden, head, labels, 0)


# --- memory (MemTracker) ----------------------------------------------------------------------


def _peak_bytes(step, *tracked) -> float:
    """MemTracker's peak total over `step()`, bytes."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(*tracked)
    with mt:
        step()
    snap = next(iter(mt.get_tracker_snapshot("peak").values()))
    return float(next(v for k, v in snap.items() if str(k).split(".")[-1] == "Total"))


def test_tiled_loss_saves_the_logits():
    """Forward+backward peak at 8 chunks is below 1 chunk's by at least 0.8 x 7/8 of three fp32
    logits-sized tensors (b*s*V*4 bytes each): the untiled peak is in cross-entropy's backward,
    where the saved log-softmax, nll_loss_backward's output and _log_softmax_backward_data's
    output are alive together; tiled, one chunk's. (One logits tensor, the bound chunking alone
    meets without the checkpoint, is too weak: the log-softmax of every chunk would stay.)
    The head is handed as `head.forward`: MemTracker refuses a module whose hooks run more than
    once per step (one call per chunk)."""
    b, s, h, v, chunks = 1, 512, 64, 4096, 8
    torch.manual_seed(0)
    head = nn.Linear(h, v, bias=False)
    hidden = torch.randn(b, s, h, requires_grad=True)
    labels = torch.randint(0, v, (b, s))

    def peak(n: int) -> float:
        hidden.grad, head.weight.grad = None, None
        return _peak_bytes(lambda: tiled_lm_loss(hidden, head.forward, labels, n).backward(), head, hidden)

    untiled, tiled = peak(1), peak(chunks)
    logits_bytes = b * s * v * 4
    saving = untiled - tiled
    assert saving >= 0.8 * (chunks - 1) / chunks * 3 * logits_bytes, (
        f"peak {untiled / 2**20:.2f} MiB untiled, {tiled / 2**20:.2f} MiB at {chunks} chunks: saves "
        f"{saving / 2**20:.2f} MiB, one logits tensor is {logits_bytes / 2**20:.2f} MiB")


# --- tiled MLP --------------------------------------------------------------------------------


def _llama(layers: int = 2, intermediate: int = 160):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=intermediate, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=layers, vocab_size=128,
                                   use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def llama():
    return _llama()


def _model_loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model(input_ids=ids).logits, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", [None, "full", "save_matmuls"])
def test_tiled_llama_mlp_equals_untiled(llama, policy):
    """Each layer's MLP tiled (3 chunks of 13 tokens: uneven), alone and with each block's
    forward under the executor's checkpointing: loss and every parameter gradient as untiled."""
    from trainplan.executor.apply.checkpointing import apply_checkpointing

    torch.manual_seed(1)
    ids, labels = torch.randint(0, 128, (2, 13)), torch.randint(0, 128, (2, 13))
    labels[0, :3] = -100
    want_loss, want = _model_loss_and_grads(llama, ids, labels)
    model = copy.deepcopy(llama)
    for layer in model.model.layers:
        tile_mlp(find_mlp(layer), 3)
    if policy is not None:
        apply_checkpointing(model, [policy] * 2)
    assert list(model.state_dict()) == list(llama.state_dict())
    got_loss, got = _model_loss_and_grads(model, ids, labels)
    assert _rel(got_loss, want_loss) <= RTOL
    off = {n: _rel(got[n], want[n]) for n in want}
    assert max(off.values()) <= RTOL, f"{policy}: gradients off: {max(off.items(), key=lambda kv: kv[1])}"


def test_tile_mlp_replaces_and_restores(llama):
    model = copy.deepcopy(llama)
    mlp = find_mlp(model.model.layers[0])
    untiled = mlp.forward
    tile_mlp(mlp, 4)
    assert isinstance(mlp.forward, functools.partial) and mlp.forward.args == (untiled, 4)
    tile_mlp(mlp, 2)  # replaces, never nests
    assert mlp.forward.func is tiled_forward and mlp.forward.args == (untiled, 2)
    clone = copy.deepcopy(model)  # the kept forward is bound to the copy, not to the original
    cmlp = find_mlp(clone.model.layers[0])
    assert cmlp.forward.args[0].__self__ is cmlp
    tile_mlp(mlp, 1)
    assert "forward" not in vars(mlp) and UNTILED_FORWARD_ATTR not in vars(mlp)
    untile_mlp(cmlp)
    assert "forward" not in vars(cmlp)
    untile_mlp(cmlp)  # not tiled: nothing to do

    def own(x):
        return x * 2

    mlp.forward = own  # an instance-level forward set before tiling comes back
    tile_mlp(mlp, 3)
    untile_mlp(mlp)
    assert mlp.forward is own


def test_tiled_forward():
    x = torch.randn(2, 7, 5, requires_grad=True)
    w = torch.randn(5, 5, requires_grad=True)

    def f(t, scale, *, shift):
        return torch.tanh(t @ w) * scale + shift

    got = tiled_forward(f, 3, x, 2.0, shift=1.0)
    assert torch.allclose(got, f(x, 2.0, shift=1.0), rtol=RTOL, atol=0)
    sentinel = object()
    assert tiled_forward(lambda t: sentinel, 1, x) is sentinel  # chunks == 1: orig(x) itself


def test_tiled_mlp_saves_its_intermediates():
    """A LlamaMLP (SwiGLU) keeps at least 3 (b, s, intermediate) tensors for the backward
    (gate and up outputs, silu(gate)); at 4 chunks one chunk's are alive at a time, so the
    forward+backward peak drops by at least 0.8 x 3/4 of three of them."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    b, s, inter, chunks = 1, 512, 1024, 4
    mlp = LlamaMLP(_llama(layers=1, intermediate=inter).config)
    x = torch.randn(b, s, 64, requires_grad=True)

    def peak(n: int) -> float:
        tile_mlp(mlp, n)
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        return _peak_bytes(lambda: mlp(x).sum().backward(), mlp, x)

    untiled, tiled = peak(1), peak(chunks)
    one = b * s * inter * 4
    assert untiled - tiled >= 0.8 * (chunks - 1) / chunks * 3 * one, (
        f"peak {untiled / 2**20:.2f} MiB untiled, {tiled / 2**20:.2f} MiB at {chunks} chunks")


def _block_memory(model, x) -> tuple[float, float]:
    """(kept after the forward, forward+backward peak) of layer 0 run alone, bytes without
    parameters and buffers (MemTracker)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    def tensors(state: str) -> float:
        snap = next(iter(mt.get_tracker_snapshot(state).values()))
        return float(sum(v for k, v in snap.items() if str(k).split(".")[-1] not in ("Total", "PARAM", "BUFFER")))

    layer, pos = model.model.layers[0], torch.arange(x.shape[1])[None]
    cos, sin = model.model.rotary_emb(x, pos)
    mt = MemTracker()
    mt.track_external(model, x)
    with mt:
        out = layer(x, position_embeddings=(cos, sin), position_ids=pos, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        kept = tensors("current")
        out.backward(torch.ones_like(out))
    return kept, tensors("peak")


@pytest.mark.parametrize("policy", ["full", "save_matmuls"])
def test_tiled_mlp_in_checkpointed_block_memory(policy):
    """Nested in the block's checkpoint, tiling lowers the backward peak by at least 0.8 x 3/4
    of three (b, s, intermediate) tensors; what the block keeps after its forward does not
    change: nothing of the MLP under `full`, and under `save_matmuls` every chunk's gate and up
    matmul outputs, kept by SAC's cache (whole, as untiled: a known limit, trainplan.modeling.tiling)."""
    from trainplan.executor.apply.checkpointing import apply_checkpointing

    b, s, inter, chunks = 1, 512, 1024, 4
    base = _llama(layers=1, intermediate=inter)
    x = torch.randn(b, s, 64, requires_grad=True)
    got = {}
    for n in (1, chunks):
        model = copy.deepcopy(base)
        tile_mlp(find_mlp(model.model.layers[0]), n)
        apply_checkpointing(model, [policy])
        x.grad = None
        got[n] = _block_memory(model, x)
    one = b * s * inter * 4
    assert got[chunks][0] == got[1][0], f"{policy}: kept after forward {got}"
    if policy == "save_matmuls":
        assert got[1][0] >= 2 * one  # gate and up outputs, whole
    assert got[1][1] - got[chunks][1] >= 0.8 * (chunks - 1) / chunks * 3 * one, f"{policy}: {got}"


def test_find_mlp(llama):
    layer = llama.model.layers[0]
    assert find_mlp(layer) is layer.mlp

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.feed_forward = nn.Linear(2, 2), nn.Linear(2, 2)

    block = Block()
    assert find_mlp(block) is block.feed_forward
    del block.feed_forward
    with pytest.raises(TrainplanError, match=r"Block has no MLP .*its children: attn"):
        find_mlp(block)


# --- tracing (make_fx on fake tensors, as trainplan.planner.capture traces a region) --------------------


def test_tiled_loss_traces_with_recompute():
    """make_fx (real tracing mode) inside FakeTensorMode of forward + torch.autograd.grad, the
    head's weight passed through functional_call: 4 head matmuls before the forward output, and
    the backward recomputes each chunk's logits (4 more matmuls of the logits' shape)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    chunks, (b, s, h), v = 4, (2, 8, 16), 32
    lin = nn.Linear(h, v, bias=False, device="meta")
    mode = FakeTensorMode()
    with mode:
        x = torch.randn(b, s, h, requires_grad=True)
        w = torch.randn(v, h, requires_grad=True)
        labels = torch.randint(0, v, (b, s))

    def fn(x, labels, w):
        loss = tiled_lm_loss(x, lambda t: torch.func.functional_call(lin, {"weight": w}, (t,)), labels, chunks)
        dx, dw = torch.autograd.grad(loss, [x, w])
        return loss, [dw], [dx]

    with mode:
        gm = make_fx(fn, tracing_mode="real")(x, labels, w)
    nodes = list(gm.graph.nodes)
    boundary = nodes.index(nodes[-1].args[0][0])
    mms = [(i, tuple(n.meta["val"].shape)) for i, n in enumerate(nodes)
           if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    logits_shape = (b * s // chunks, v)
    fwd = [shape for i, shape in mms if i < boundary]
    recompute = [shape for i, shape in mms if i > boundary and shape == logits_shape]
    assert fwd == [logits_shape] * chunks
    assert len(recompute) == chunks
    assert len(mms) == 4 * chunks  # forward, recompute, d hidden and d weight of each chunk
    log_softmax = [i for i, n in enumerate(nodes) if n.target == torch.ops.aten._log_softmax.default]
    assert len(log_softmax) == 2 * chunks and sum(i > boundary for i in log_softmax) == chunks
