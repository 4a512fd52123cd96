"""Any model a user brings (issue #20): tiny versions of the architectures people train, built
from transformers configs (and one nanoGPT-style module written here), planned by the capture
through their own forward and trained for real on this CPU: predicted peak memory within 1% of
MemTracker and FLOPs equal to FlopCounterMode's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import trainplan.executor
from trainplan.executor.record import RunRecord
from trainplan.planner.api import plan_for_choice
from trainplan.planner.capture.graph import capture

VOCAB, STEPS = 512, 5
_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
_NO_DROPOUT = dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)

CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _BASE),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_BASE, sliding_window=32)),  # window below the sequence
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _BASE),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_BASE, head_dim=16)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_BASE, head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_BASE, head_dim=16, sliding_window=32)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _BASE),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _BASE),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=256,
                                                     bos_token_id=None, eos_token_id=None, **_NO_DROPOUT)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_BASE, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_BASE, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                       num_experts_per_tok=2)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=VOCAB, bos_token_id=None, eos_token_id=None)),
}


class _Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """A nanoGPT-style model: learned positions, pre-norm blocks in a ModuleList, tied head,
    forward(idx, targets=None) -> logits; no transformers config."""

    def __init__(self, vocab: int = VOCAB, d: int = 64, n_layer: int = 2, n_head: int = 4, block_size: int = 256):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block_size, d),
                                              h=nn.ModuleList(_Block(d, n_head) for _ in range(n_layer)),
                                              ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def build(arch: str) -> nn.Module:
    torch.manual_seed(0)
    if arch == "nanogpt":
        return NanoGPT()
    cfg_cls, model_cls, kw = CONFIGS[arch]
    cfg = getattr(transformers, cfg_cls)(**kw)
    for impl in ("sdpa", "eager"):  # Gemma-2 refuses SDPA
        cfg._attn_implementation = impl
        try:
            return getattr(transformers, model_cls)(cfg)
        except ValueError:
            continue
    raise AssertionError(arch)


def run(arch: str, out, *, micro_batch: int, seq_len: int, checkpoint: str = "none"):
    model = build(arch)
    plan = plan_for_choice(model, "cpu", seq_len=seq_len, micro_batch=micro_batch, max_steps=STEPS,
                           optimizer_bits=32, activation_checkpoint=checkpoint)
    applied = trainplan.executor.apply_plan(plan, model)
    data = torch.Generator().manual_seed(0)

    def step() -> float:
        tokens = torch.randint(0, VOCAB, (micro_batch, seq_len + 1), generator=data)
        loss = applied.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        applied.optimizer.step()
        applied.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    with applied.measure(out) as m:
        for _ in range(STEPS):
            m.step(step)
    return plan, RunRecord.from_json(out / "record.json")


GEMMA2_EAGER_MASKS = pytest.mark.xfail(strict=True, reason=(
    "known over-prediction: Gemma-2's eager attention adds its two (b, 1, s, s) fp32 masks to the "
    "scores and saves neither, so with no block checkpointed they are freed after the forward; "
    "the replay keeps what the head hands the blocks to block 0's backward (trainplan.costmodels.step.memory."
    "step_phases, a constant the joint model can count): +1.1% at b=1, s=64 and +3.0% at b=2, s=128 "
    "on this 512-token vocabulary (within 1% checkpointed)"))
CELLS = ([pytest.param(arch, 2, 128, "none", id=f"{arch}-b2s128",
                       marks=[GEMMA2_EAGER_MASKS] if arch == "gemma2" else []) for arch in [*CONFIGS, "nanogpt"]]
         + [pytest.param(arch, 1, 64, "none", id=f"{arch}-b1s64", marks=[GEMMA2_EAGER_MASKS] if arch == "gemma2"
                         else []) for arch in ("gemma2", "gpt2", "mixtral")]
         + [pytest.param(arch, 1, 64, "full", id=f"{arch}-b1s64-full") for arch in ("gemma2", "gpt2")]
         + [pytest.param(arch, 2, 128, "full", id=f"{arch}-b2s128-full")
            for arch in ("llama", "mistral", "gemma2", "gpt2", "mixtral", "nanogpt")])


@pytest.mark.parametrize("arch, micro_batch, seq_len, checkpoint", CELLS)
def test_tiny_run_peak_within_1_percent_flops_exact(arch, micro_batch, seq_len, checkpoint, tmp_path,
                                                      torch_threads):
    with torch_threads(1):
        plan, record = run(arch, tmp_path, micro_batch=micro_batch, seq_len=seq_len, checkpoint=checkpoint)
    pred, meas = plan.predictions.memory_bytes["total"], record.peak_memory_bytes["total"]
    assert math.isclose(pred, meas, rel_tol=0.01), (
        f"{arch}: predicted peak {pred:.0f} B, MemTracker {meas:.0f} B ({(pred - meas) / meas:+.2%})")
    assert record.flops_per_step > 0 and plan.predictions.flops_per_step == record.flops_per_step, arch


def test_alternating_layers_are_distinct_regions_and_features_are_named():
    g = capture(build("gemma2"))
    assert g.blocks == ("block0", "block1"), g.blocks  # sliding and global attention
    assert "sliding_window=32" in g.features and "attn_logit_softcapping=50.0" in g.features, g.features
    assert "final_logit_softcapping=30.0" in g.features, g.features
    assert capture(build("mistral")).features == ("sliding_window=32",)
    assert capture(NanoGPT()).features == ("attention=own", "positions=none")
    assert capture(build("mixtral")).features == ("experts=4", "experts_per_token=2")


def test_sp_is_not_offered_where_ulysses_cannot_run_and_the_plan_says_why():
    from trainplan.errors import TrainplanError
    from trainplan.planner.api import solve
    from trainplan.planner.budget import Budget

    plan = solve(build("mistral"), "h100", Budget(devices=8, device_hours=100), seq_len=1024, vocab_size=VOCAB)
    assert plan.decisions.sp_degree == 1
    assert any("sp_degree 1 only" in w and "sliding_window=32" in w for w in plan.warnings), plan.warnings
    moe = plan_for_choice(build("mixtral"), "cpu", seq_len=128, micro_batch=1, devices=2, zero_stage=3)
    assert any("mixture of 4 experts: no expert parallelism; experts sharded by ZeRO-3" in w
               for w in moe.warnings), moe.warnings
    with pytest.raises(TrainplanError, match="sp_degree=2 cannot run.*sliding_window"):
        plan_for_choice(build("mistral"), "cpu", seq_len=128, micro_batch=1, sp_degree=2, devices=2)


def test_a_sequence_past_a_learned_position_table_is_refused():
    from trainplan.errors import TrainplanError

    with pytest.raises(TrainplanError, match=r"seq_len=512 is beyond GPT2LMHeadModel's 256 learned positions "
                                             r"\(transformer\.wpe, an nn.Embedding of 256 rows\)"):
        plan_for_choice(build("gpt2"), "cpu", seq_len=512, micro_batch=1)
    rotary = plan_for_choice(build("llama"), "cpu", seq_len=8192, micro_batch=1)  # RoPE: a warning only
    assert any("max_position_embeddings" in w for w in rotary.warnings), rotary.warnings


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_a_mixture_of_experts_is_predicted_from_its_active_parameters(arch):
    """Issue #37, item 5: the loss law sees the parameters a token runs through (k of E routed
    experts, every shared one), not the total; the plan records both and says so."""
    from trainplan.costmodels.loss.cache import law_from_fields
    from trainplan.costmodels.loss.planned import run_loss

    model = build(arch)
    g = capture(model)
    routed = sum(p.numel() for n, p in model.named_parameters() if "experts" in n.split("."))
    assert routed > 0 and g.n_active_params == g.n_params - routed + routed * 2 // 4  # k=2 of E=4
    plan = plan_for_choice(model, "cpu", seq_len=128, micro_batch=1, max_steps=50)
    assert plan.model_n_params == g.n_params and plan.model_n_active_params == g.n_active_params
    assert plan.law_n_params == g.n_active_params < plan.model_n_params
    law = law_from_fields(plan.predictions.loss_law)
    p = plan.predictions
    at = {n: run_loss(law, n, steps=50, tokens_per_step=p.tokens_per_step, warmup_steps=plan.decisions.warmup_steps)
          for n in (g.n_active_params, g.n_params)}
    assert p.final_loss == pytest.approx(at[g.n_active_params]) and p.final_loss > at[g.n_params]
    assert any("loss law is evaluated at the" in w and "Clark et al. 2022" in w for w in plan.warnings)
    dense = plan_for_choice(build("llama"), "cpu", seq_len=128, micro_batch=1, max_steps=50)
    assert dense.model_n_active_params is None and dense.law_n_params == dense.model_n_params


@pytest.mark.parametrize("per_token", [0, 5])
def test_a_mixture_routing_to_more_experts_than_it_has_is_refused_by_name(per_token):
    from trainplan.errors import TrainplanError

    model = build("mixtral")  # 4 experts
    model.config.num_experts_per_tok = per_token
    with pytest.raises(TrainplanError, match=rf"num_experts_per_tok={per_token} of num_local_experts=4 .*"
                                             r"1 <= num_experts_per_tok <= 4"):
        capture(model)
