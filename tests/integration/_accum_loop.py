"""A training loop with gradient accumulation on `trainplan.executor.apply_plan`, at one shape of the small
Llama of tests/integration/_own_loop.py (hidden 256, 4 layers, vocab 512), for
tests/integration/test_grad_accum_memory.py: in this process (`main`) or under torchrun
(`python -m torch.distributed.run --nproc-per-node 2 -m tests.integration._accum_loop OUT JSON`,
JSON the keyword arguments of `main`)."""

import json
import sys

import torch
import transformers

import trainplan.executor
from trainplan.planner.api import plan_for_choice

CONFIG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=512)
MAX_STEPS = 4  # step 2 measured under MemTracker, step 3 under FlopCounterMode


def main(out: str, *, seq_len: int, micro_batch: int, grad_accum: int, checkpoint: str | list[str] = "none",
         devices: int = 1, zero_stage: int = 0, sp_degree: int = 1) -> None:
    """Plan the given knobs (`plan_for_choice`), train MAX_STEPS optimizer steps of `grad_accum`
    micro-steps on random tokens and write `out/plan.json`, `out/record.json`."""
    torch.manual_seed(0)  # the same weights on every rank
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    plan = plan_for_choice(model, "cpu", seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum,
                           max_steps=MAX_STEPS, activation_checkpoint=checkpoint if isinstance(checkpoint, str)
                           else tuple(checkpoint), devices=devices, zero_stage=zero_stage, sp_degree=sp_degree)
    applied = trainplan.executor.apply_plan(plan, model)
    opt, sched = applied.optimizer, applied.scheduler
    data = torch.Generator().manual_seed(applied.dp_rank)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, CONFIG["vocab_size"], (applied.micro_batch, applied.seq_len + 1), generator=data)
        return tokens[:, :-1], tokens[:, 1:]

    def train_step() -> float:
        losses = []
        for j in range(applied.grad_accum):
            with applied.accumulating(j):
                loss = applied.loss(*batch())
                (loss / applied.grad_accum).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        return sum(losses) / len(losses)

    heldout = [batch()]
    with applied.measure(out) as m:
        for _ in range(applied.max_steps):
            m.step(train_step)
        m.evaluate(heldout)


if __name__ == "__main__":
    main(sys.argv[1], **json.loads(sys.argv[2]))
