"""Gradient accumulation in `trainplan.executor.train.run`: an optimizer step of `grad_accum` micro-steps
on consecutive micro-batches trains the same parameters as one step on the whole batch (fp32,
one process), and counts tokens, steps and loss per optimizer step; DDP defers its all-reduce to
the last micro-step (`accumulation_sync`).

The runs step with plain SGD (`build_optimizer` replaced): the update is then the accumulated
gradient itself. AdamW's first step, m / sqrt(v), is the same for any scale of the gradient, so
it could not tell a missing division by `grad_accum`."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from trainplan.executor.accumulation import accumulation_sync
from trainplan.executor.data.batches import TokenCorpus
from trainplan.executor.train import run
from trainplan.modeling import presets
from trainplan.planner.plan import Decisions, Plan, Predictions, SolverFacts, edited_layout, layout_fields

VOCAB = 256
SEQ = 32


@pytest.fixture(scope="module")
def corpus() -> TokenCorpus:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (8192,), generator=gen)
    return TokenCorpus(name="random", sha256="0" * 64, vocab_size=VOCAB, train_tokens=tokens[:7168],
                       heldout_tokens=tokens[7168:], tokenizer_path="")


def _model():
    return presets.build_model("tiny-llama", device="cpu", dtype=torch.float32, vocab_size=VOCAB, seed=0)


def _plan(micro_batch: int, grad_accum: int, model, steps: int = 1) -> Plan:
    """An fp32 plan of `steps` steps on one cpu process (no capture: its predictions are
    placeholders the run does not read, consistent with its layout)."""
    layers = model.config.num_hidden_layers
    tps = micro_batch * SEQ * grad_accum
    d = Decisions(devices=1, sp_degree=1, dp_degree=1, zero_stage=0, micro_batch=micro_batch,
                  grad_accum=grad_accum, seq_len=SEQ, activation_checkpoint=("none",) * layers, precision="fp32",
                  optimizer_bits=32, data_fraction=1.0, data_method="random", max_tokens=steps * tps,
                  max_steps=steps,
                  warmup_steps=1, lr=0.1, seed=0)
    p = Predictions(memory_bytes={"total": 1.0}, memory_phase="", memory_limit_bytes=2.0**40, step_time_s=1.0,
                    step_time_breakdown_s={}, flops_per_step=1.0, model_flops_per_step=1.0,
                    tokens_per_step=tps, total_tokens=steps * tps, device_hours=1.0, final_loss=1.0, mfu=0.0,
                    made_for=layout_fields(d))
    plan = Plan(model="tiny-llama", model_n_params=sum(x.numel() for x in model.parameters()),
                model_n_layers=layers, hw="cpu", budget={"devices": 1}, data_tokens=7168, vocab_size=VOCAB,
                decisions=d, predictions=p,
                solver=SolverFacts(status="FIXED", objective=0.0, bound=0.0, wall_s=0.0, seed=0, time_limit_s=0.0))
    assert edited_layout(plan) is None
    return plan


def _sgd(params, *, lr: float, **_):
    return torch.optim.SGD(params, lr=lr)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory, torch_threads):
    """(model, record) after one optimizer step, by (micro_batch, grad_accum)."""
    out = {}
    with torch_threads(1), pytest.MonkeyPatch.context() as mp:
        mp.setattr("trainplan.executor.apply.applied.build_optimizer", _sgd)
        for mb, ga in ((4, 1), (2, 2), (2, 1)):
            model = _model()
            rec = run(_plan(mb, ga, model), model, corpus, out=tmp_path_factory.mktemp(f"mb{mb}ga{ga}"),
                      device="cpu", progress=False, checkpoint_every=0, check_fits=False)
            out[mb, ga] = model, rec
    return out


def _moved(model) -> dict[str, torch.Tensor]:
    """How far the step moved each parameter from its initial value: -lr x the gradient."""
    init = dict(_model().named_parameters())
    return {k: (v - init[k]).detach() for k, v in model.named_parameters()}


def test_two_micro_steps_train_what_one_step_of_twice_the_batch_does(trained):
    """The same update to fp32 rounding: the two halves' gradients are summed in another order
    than the whole batch's (relative 1e-4), and each update is rounded to its fp32 parameter
    (4 units in the last place of the tensor's largest parameter)."""
    params = dict(trained[4, 1][0].named_parameters())
    whole, accum = _moved(trained[4, 1][0]), _moved(trained[2, 2][0])
    for k, want in whole.items():
        assert want.abs().max() > 0, k  # every parameter took part in the step
        ulp = torch.finfo(torch.float32).eps * params[k].abs().max().item()
        torch.testing.assert_close(accum[k], want, rtol=1e-4, atol=4 * ulp, msg=lambda m, k=k: f"{k}: {m}")


def test_the_second_micro_batch_is_the_next_one(trained):
    """One micro-step on the first half alone moves the parameters elsewhere: the accumulated
    step read the batch's second half too."""
    half, accum = _moved(trained[2, 1][0]), _moved(trained[2, 2][0])
    gap = max(((half[k] - accum[k]).abs().max() / accum[k].abs().max()).item() for k in half)
    assert gap > 0.1, gap


def test_steps_tokens_and_loss_are_per_optimizer_step(trained):
    _, whole = trained[4, 1]
    _, accum = trained[2, 2]
    assert accum.steps == whole.steps == 1
    assert accum.tokens == whole.tokens == 4 * SEQ
    assert [s for s, _ in accum.train_loss] == [0]
    assert accum.train_loss[0][1] == pytest.approx(whole.train_loss[0][1], rel=1e-5)  # the batch's mean


@pytest.fixture(scope="module")
def measured(corpus, tmp_path_factory, torch_threads):
    """Records of 4 AdamW steps (step 2 under MemTracker, step 3 under FlopCounterMode), by
    (micro_batch, grad_accum)."""
    out = {}
    with torch_threads(1):
        for mb, ga in ((4, 1), (2, 2)):
            model = _model()
            out[mb, ga] = run(_plan(mb, ga, model, steps=4), model, corpus, device="cpu", progress=False,
                              out=tmp_path_factory.mktemp(f"measured{mb}{ga}"), checkpoint_every=0,
                              check_fits=False)
    return out


def test_the_measured_step_holds_the_accumulated_gradients(measured):
    """MemTracker measures the whole optimizer step, every micro-step (its module statistics
    cleared between them, `trainplan.executor.accumulation.reset_memory_tracker_modules`): from the second
    micro-step on every fp32 gradient is held, as `trainplan.planner.joint.combos.accumulated_grad_bytes`
    counts them; FlopCounterMode counts both micro-steps, the whole batch's FLOPs."""
    n_params = sum(p.numel() for p in _model().parameters())
    accum, whole = measured[2, 2], measured[4, 1]
    assert accum.steps == 4 and accum.peak_memory_bytes["grads"] == 4 * n_params, accum.peak_memory_bytes
    assert accum.flops_per_step == whole.flops_per_step > 0


class _DDPLike:
    def __init__(self):
        self.calls = 0

    def no_sync(self):
        self.calls += 1
        return nullcontext()


@pytest.mark.parametrize("zero_stage, world, last, deferred", [
    (0, 2, False, True), (1, 4, False, True), (0, 2, True, False),  # DDP: all-reduce in the last one
    (2, 2, False, False), (3, 2, False, False),                      # FSDP2: reduce-scatter every one
    (0, 1, False, False),                                            # one process: nothing to reduce
])
def test_ddp_defers_its_all_reduce_to_the_last_micro_step(zero_stage, world, last, deferred):
    model = _DDPLike()
    with accumulation_sync(model, zero_stage=zero_stage, world=world, last=last):
        pass
    assert model.calls == int(deferred)
