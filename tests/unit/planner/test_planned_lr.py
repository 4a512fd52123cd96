"""Issue #37, item 5: a plan's peak learning rate and warmup come from a cited hyperparameter law
(DeepSeek LLM, Bi et al. 2024, eq. 1) from 1e17 FLOPs up, and a rate far from it is warned about."""

from __future__ import annotations

import dataclasses

import pytest

from trainplan.costmodels.loss.planned import (
    LAW_MIN_FLOPS,
    SMALL_RUN_LR,
    law_batch_tokens,
    law_lr,
    lr_warning,
    planned_lr,
    planned_warmup_steps,
    warmup_steps_for,
)
from trainplan.errors import TrainplanError
from trainplan.planner import Budget, solve


def test_the_law_and_its_range():
    assert law_lr(1e20) == pytest.approx(0.3118 * 1e20 ** -0.125)
    assert law_batch_tokens(1e20) == pytest.approx(0.2920 * 1e20 ** 0.3271)
    assert law_lr(1e23) < law_lr(1e20) and law_batch_tokens(1e23) > law_batch_tokens(1e20)
    assert planned_lr(LAW_MIN_FLOPS / 10) == SMALL_RUN_LR and planned_lr(1e22) == law_lr(1e22)
    assert planned_warmup_steps(100_000, 1e22) == 2000 and planned_warmup_steps(5_000, 1e22) == 500
    assert planned_warmup_steps(5_000, 1e15) == warmup_steps_for(5_000) == 20
    assert lr_warning(law_lr(1e22) * 2.9, 1e22) == "" and "above" in lr_warning(law_lr(1e22) * 3.1, 1e22)
    assert "below" in lr_warning(law_lr(1e22) / 4, 1e22)
    assert lr_warning(1.0, 1e15) == ""  # outside the law's range: nothing said
    with pytest.raises(TrainplanError, match="compute_flops"):
        law_lr(0.0)


@pytest.fixture(scope="module")
def big():
    return solve("llama3-8b", "h100", Budget(devices=8, device_hours=2000), seq_len=8192)


def test_a_large_preset_plan_takes_the_laws_rate_and_warmup(big):
    c = big.compute_flops
    assert c > 1e21
    assert big.decisions.lr == pytest.approx(law_lr(c)) and 2e-4 < big.decisions.lr < 1e-3
    assert big.decisions.warmup_steps == 2000
    assert any("DeepSeek LLM's hyperparameter law" in n for n in big.notes)
    assert not big.warnings


def test_a_users_rate_far_from_the_law_is_warned_about(big):
    from trainplan.planner.api import with_planned_lr  # what `solve(..., lr=...)` applies to its plan
    from trainplan.planner.cli.checks import with_schedule

    given = with_planned_lr(dataclasses.replace(big, decisions=dataclasses.replace(big.decisions, lr=3e-3)), 3e-3)
    assert given.decisions.lr == 3e-3
    assert any("peak learning rate 0.003 is" in w and "Bi et al. 2024" in w for w in given.warnings)

    edited = with_schedule(big, lr=5e-3)
    assert edited.decisions.lr == 5e-3 and any("5x above" in w or "x above" in w for w in edited.warnings)
    assert not with_schedule(big, lr=big.decisions.lr * 1.5).warnings


def test_a_small_cpu_plan_keeps_the_small_run_default():
    small = solve("tiny-llama", "cpu", Budget(flops=4e14), seq_len=256)
    assert small.compute_flops < LAW_MIN_FLOPS
    assert small.decisions.lr == SMALL_RUN_LR and small.decisions.warmup_steps == 20
    assert not any("learning rate" in w for w in small.warnings)
