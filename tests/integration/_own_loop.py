"""A user's own training loop on a trainplan plan: docs/where_you_train.md's "Your own training
loop", run by tests/integration/test_own_loop.py in this process (1 device) and under torchrun (2 devices:
`python -m torch.distributed.run --nproc-per-node 2 -m tests.integration._own_loop OUT 2`)."""

import sys

import torch
import transformers

import trainplan.executor
from trainplan.planner.api import plan_for_choice


def main(out: str, devices: int = 1) -> None:
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=512)
    torch.manual_seed(0)  # the same weights on every rank
    model = transformers.LlamaForCausalLM(config)  # your model
    plan = plan_for_choice(model, "cpu", seq_len=128, micro_batch=2 // devices, grad_accum=2, max_steps=6,
                           activation_checkpoint=("full", "save_matmuls", "none", "none"), devices=devices,
                           zero_stage=3 if devices > 1 else 0)  # or trainplan.planner.api.solve(model, "cpu", budget)
    applied = trainplan.executor.apply_plan(plan, model)  # checkpoint sets, FSDP2 (and DDP, ZeRO-1, Ulysses SP), AdamW
    opt, sched = applied.optimizer, applied.scheduler
    data = torch.Generator().manual_seed(applied.dp_rank)  # your data: this replica's batches

    def batch() -> tuple[torch.Tensor, torch.Tensor]:  # (micro_batch, seq_len) inputs, targets
        tokens = torch.randint(0, config.vocab_size, (applied.micro_batch, applied.seq_len + 1), generator=data)
        return tokens[:, :-1], tokens[:, 1:]

    def train_step() -> float:  # one optimizer step of grad_accum micro-steps
        losses = []
        for j in range(applied.grad_accum):
            with applied.accumulating(j):  # DDP's no_sync() but in the last micro-step
                loss = applied.loss(*batch())  # this rank's sequence shard, autocast, compression
                (loss / applied.grad_accum).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()  # the plan's warmup-stable-decay learning rate
        return sum(losses) / len(losses)

    heldout = [batch() for _ in range(2)]
    with applied.measure(out) as m:  # out/plan.json, out/record.json: `trainplan report out`
        for _ in range(applied.max_steps):
            m.step(train_step)  # peak memory, FLOPs and time as trainplan measures them
        m.evaluate(heldout)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
