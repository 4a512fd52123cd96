"""trainplan.modeling.model_call: a model is called as its forward takes token ids (keyword, positional,
with or without `use_cache` and `position_ids`), its logits are taken from a tensor, `.logits`, a
tuple or a dict, and what holds no logits is refused with a message naming it; and
`trainplan.executor.apply_plan` trains a module that is not a transformers model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import trainplan.executor
from trainplan.errors import CaptureError, PlanMismatchError, TrainplanError
from trainplan.executor.apply import applied as applied_module
from trainplan.modeling.model_call import accepts_position_ids, forward_call, forward_logits, forward_signature
from trainplan.modeling.tiling import TiledHead
from trainplan.planner.api import plan_for_choice

V = 100


@pytest.fixture(scope="module")
def llama():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=V)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Returns the logits tensor: `forward(self, tokens)`."""

    def __init__(self, n_layers: int = 2, h: int = 32, heads: int = 2, seq: int = 64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, V, bias=False)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class NanoGPT(TinyGPT):
    """nanoGPT's contract: `forward(self, idx, targets=None)` returns `(logits, loss)`."""

    def forward(self, idx, targets=None):
        logits = super().forward(idx)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


class DictGPT(TinyGPT):
    def forward(self, input_ids, position_ids=None):
        return {"logits": super().forward(input_ids), "aux": None}


class LossOnly(TinyGPT):
    def forward(self, input_ids):
        return super().forward(input_ids).mean()


class LastOnly(TinyGPT):
    """nanoGPT at inference: the logits of the last position only."""

    def forward(self, idx):
        return super().forward(idx)[:, -1:]


def _ids(b=2, s=16, seed=0):
    return torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(seed))


def test_a_transformers_model_is_called_with_keywords_as_before(llama):
    x = _ids()
    sig = forward_signature(llama)
    assert (sig.ids_keyword, sig.use_cache, sig.position_ids) == (True, True, True)
    assert forward_call(llama, x) == ((), {"input_ids": x, "use_cache": False})
    with torch.no_grad():
        want = llama(input_ids=x, use_cache=False).logits
        assert torch.equal(forward_logits(llama, x), want)
        pos = torch.arange(4, 20).unsqueeze(0).expand(2, -1)
        shifted = forward_logits(llama, x, position_ids=pos)
        assert torch.equal(shifted, llama(input_ids=x, position_ids=pos, use_cache=False).logits)
        assert not torch.equal(shifted, want)  # the positions reached the model


def test_a_tiled_loss_head_s_scalar_passes_with_allow_scalar(llama):
    x = _ids()
    model = transformers.LlamaForCausalLM(llama.config).eval()
    head = TiledHead(model, 2)
    with torch.no_grad(), head.labels(x):
        total = forward_logits(model, x, allow_scalar=True)
        assert total.ndim == 0 and total.item() > 0
        with pytest.raises(CaptureError, match=r"whose \.logits is a 0-dim tensor"):
            forward_logits(model, x)


def test_nanogpt_style_forward_is_called_positionally_and_its_tuple_gives_the_logits():
    model, x = NanoGPT().eval(), _ids()
    assert forward_call(model, x) == ((x,), {})
    assert not accepts_position_ids(model)
    with torch.no_grad():
        want = model(x)[0]
        assert torch.equal(forward_logits(model, x), want)
        # positions 0..s-1 are what the model computes itself: allowed, and not passed
        assert torch.equal(forward_logits(model, x, position_ids=torch.arange(16).unsqueeze(0)), want)


def test_positions_a_model_cannot_take_are_refused():
    model, x = NanoGPT(), _ids()
    pos = torch.arange(16, 32).unsqueeze(0).expand(2, -1)
    with pytest.raises(PlanMismatchError, match=r"NanoGPT.forward takes no position_ids, so it cannot run a "
                                                r"sequence shard at positions 16..31 .* sp_degree=1"):
        forward_logits(model, x, position_ids=pos)


def test_a_plain_tensor_and_a_dict_give_the_logits():
    x = _ids()
    tiny = TinyGPT().eval()
    as_dict = DictGPT().eval()
    as_dict.load_state_dict(tiny.state_dict())
    assert forward_call(as_dict, x) == ((), {"input_ids": x})
    with torch.no_grad():
        want = tiny(x)
        assert want.shape == (2, 16, V)
        assert torch.equal(forward_logits(tiny, x), want)
        assert torch.equal(forward_logits(as_dict, x, position_ids=torch.arange(16).unsqueeze(0)), want)


def test_a_wrapper_is_seen_through():
    x = _ids()
    model = NanoGPT().eval()
    wrapped = nn.DataParallel(model)  # on a CPU-only machine: calls the module; its forward is (*inputs, **kwargs)
    assert forward_call(wrapped, x) == ((x,), {})
    with torch.no_grad():
        assert torch.equal(forward_logits(wrapped, x), model(x)[0])


def test_a_scalar_output_is_refused_naming_it():
    x = _ids()
    with pytest.raises(CaptureError, match=r"LossOnly returned a 0-dim tensor of shape \(\) \(a loss\?.*\) for "
                                           r"token ids of shape \(2, 16\); trainplan expects the logits"):
        forward_logits(LossOnly(), x)
    assert forward_logits(LossOnly(), x, allow_scalar=True).ndim == 0


def test_logits_of_another_shape_are_refused():
    with pytest.raises(CaptureError, match=r"LastOnly returned a 3-dim tensor of shape \(2, 1, 100\) for token ids "
                                           r"of shape \(2, 16\); .* one row per token"):
        forward_logits(LastOnly(), _ids())

    class Nothing(nn.Module):
        def forward(self, input_ids):
            return None

    with pytest.raises(CaptureError, match=r"Nothing returned a NoneType"):
        forward_logits(Nothing(), _ids())


# --- apply_plan on a module that is not a transformers model ---------------------------------


@pytest.fixture(scope="module")
def llama_plan(tiny_llama):
    """A plan of the tiny Llama's shape (2 layers, seq 32, micro-batch 2), its model fields then set to a
    TinyGPT's: `apply_plan` reads the blocks and the parameter count of the plan, not the model's class."""
    return plan_for_choice(tiny_llama(), "cpu", seq_len=32, micro_batch=2, activation_checkpoint=("none", "full"),
                           max_steps=4)


def _as_plan_for(plan, model, **decisions):
    return dataclasses.replace(plan, model_n_params=sum(p.numel() for p in model.parameters()), model_n_layers=2,
                               decisions=dataclasses.replace(plan.decisions, **decisions))


def test_apply_plan_trains_a_module_that_is_not_a_transformers_model(llama_plan, torch_threads):
    torch.manual_seed(0)
    model = TinyGPT()
    plan = _as_plan_for(llama_plan, model)
    applied = trainplan.executor.apply_plan(plan, model, check_ops=False)  # its blocks' ops are not the Llama's
    before = [p.detach().clone() for p in model.parameters()]
    x = _ids(2, 32)
    y = torch.roll(x, -1, dims=1)
    losses = []
    with torch_threads(1):
        for _ in range(2):
            loss = applied.loss(x, y)
            loss.backward()
            applied.optimizer.step()
            applied.scheduler.step()
            applied.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    assert 3.5 < losses[0] < 6.0  # about ln(100) = 4.6
    assert losses[1] < losses[0]
    assert all(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))


def test_the_op_check_calls_a_positional_forward(llama_plan):
    model = NanoGPT()  # `forward(self, idx, targets=None)`: traced with the ids passed positionally
    with pytest.raises(PlanMismatchError, match=r"blocks\.1 is not the block the plan was captured from .* op 0 of "
                                                r"its forward is aten\.native_layer_norm\.default"):
        trainplan.executor.apply_plan(_as_plan_for(llama_plan, model), model)


def test_a_tiled_loss_needs_an_output_embedding(llama_plan):
    model = TinyGPT()
    with pytest.raises(TrainplanError, match=r"TinyGPT has no output embedding \(get_output_embeddings\(\)\)"):
        trainplan.executor.apply_plan(_as_plan_for(llama_plan, model, loss_chunks=2), model, check_ops=False)


def test_sequence_parallelism_is_refused_for_a_model_without_position_ids(llama_plan, monkeypatch):
    model = NanoGPT()
    monkeypatch.setattr(applied_module, "init_world", lambda plan, dev: (0, 2))  # as if launched on 2 ranks
    plan = _as_plan_for(llama_plan, model, sp_degree=2, devices=2)
    with pytest.raises(PlanMismatchError, match=r"sequence parallelism \(sp_degree=2\).* NanoGPT.forward takes no "
                                                r"position_ids"):
        trainplan.executor.apply_plan(plan, model, check_ops=False)
