"""Fixtures shared by several test modules (plain objects; pytest fixtures live in conftest.py)."""

from __future__ import annotations

import torch
from torch import nn

from trainplan.costmodels.stopping.heldout_curve import HeldoutCurve
from trainplan.executor.record import RunRecord
from trainplan.planner.plan import Decisions, Plan, Predictions, SolverFacts


class Rotary(nn.Module):
    def __init__(self, head_dim: int):
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(head_dim // 2))

    def forward(self, x, position_ids):
        f = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat([f, f], dim=-1)
        return emb.cos(), emb.sin()



TPS = 1024.0  # tokens per step
U = 40 * TPS  # the plan's unique tokens: 40 steps an epoch
TRUE = HeldoutCurve(E=2.5, B=2.9, beta=0.17, gamma=0.055, kappa=1.34, zeta=0.6, d_ref_tokens=320 * TPS,
                    u_ref_tokens=U, tokens_per_step=TPS, unique_tokens=U)
"""A synthetic run that overfits (constants near the benchmark's): its held-out loss is lowest at
step 190 of 400; the governor decides at steps 130 to 270 over the thresholds below."""


MIB = 2**20


def make_plan(**pred_overrides) -> Plan:
    pred = dict(
        memory_bytes={"params": 100 * MIB, "grads": 100 * MIB, "optimizer": 200 * MIB,
                      "activations": 300 * MIB, "temporaries": 20 * MIB, "total": 720 * MIB},
        memory_phase="backward", memory_limit_bytes=1000 * MIB,
        step_time_s=0.5, step_time_breakdown_s={"compute": 0.3, "recompute": 0.1,
                                                "communication": 0.1},
        flops_per_step=2.0e12, model_flops_per_step=1.8e12, tokens_per_step=4096,
        total_tokens=409_600, device_hours=0.1, final_loss=3.0, mfu=0.4)
    pred.update(pred_overrides)
    return Plan(
        model="tiny-llama", model_n_params=1_000_000, model_n_layers=2, hw="h200",
        budget={"device_hours": 1.0, "devices": 1}, data_tokens=1_000_000, vocab_size=256,
        decisions=Decisions(devices=1, sp_degree=1, dp_degree=1, zero_stage=0, micro_batch=4,
                            seq_len=1024, activation_checkpoint=("none", "full"), precision="bf16-mixed",
                            optimizer_bits=32, data_fraction=1.0, data_method="random",
                            max_tokens=409_600, max_steps=100, governor_threshold=0.0),
        predictions=Predictions(**pred),
        solver=SolverFacts(status="OPTIMAL", objective=1.0, bound=1.0, wall_s=0.1, seed=0,
                           time_limit_s=10.0))


def make_record(**overrides) -> RunRecord:
    kw = dict(
        model="tiny-llama", hw_planned="h200", device="cpu", same_hardware=True, steps=80,
        tokens=327_680, step_times_s=[9.0, 9.0, 0.4, 0.5, 0.6],
        train_loss=[(s, 5.0 - 0.02 * s) for s in range(1, 81)],
        heldout_loss=[(40, 163_840, 4.5), (80, 327_680, 4.0)],
        peak_memory_bytes={"params": 100 * MIB, "grads": 100 * MIB, "optimizer": 200 * MIB,
                           "activations": 400 * MIB, "temporaries": 0.0, "total": 800 * MIB},
        flops_per_step=2.5e12, stop_reason="marginal_gain", wall_s=12.0)
    kw.update(overrides)
    return RunRecord(**kw)


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the TensorBoard event files in `folder`, read back by TensorBoard's own
    reader: tag -> [(step, value)] in the order written (values are float32)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def transformers_heldout_loss(folder, plan: Plan, corpus) -> float:
    """Held-out loss (nats/token) of the model folder `folder` (`trainplan export-weights`) loaded by
    `transformers.AutoModelForCausalLM`, on the held-out batches a run of `plan` on `corpus` (a
    `TokenCorpus`) evaluates (`trainplan.executor.train.eval_batches` of them), by the run's loss
    (`trainplan.modeling.loss.lm_loss`, `trainplan.executor.measure.heldout_loss`): a run's final held-out loss when
    `folder` holds its weights."""
    from transformers import AutoModelForCausalLM

    from trainplan.executor.data.batches import heldout_batches
    from trainplan.executor.measure import heldout_loss
    from trainplan.executor.train import eval_batches
    from trainplan.modeling.loss import lm_loss

    d = plan.decisions
    model = AutoModelForCausalLM.from_pretrained(folder)
    held = heldout_batches(corpus.heldout_tokens, seq_len=d.seq_len, micro_batch=d.micro_batch,
                           max_batches=eval_batches(d.micro_batch, d.seq_len, heldout_len=len(corpus.heldout_tokens)))
    with torch.no_grad():
        return heldout_loss(model, held, lambda x, y: lm_loss(model(input_ids=x).logits, y))
