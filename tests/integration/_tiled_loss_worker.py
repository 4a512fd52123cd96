"""A tiled-loss plan trained by a user's own loop, on 1 process or under torchrun on 2 (FSDP2 ZeRO-3,
gloo): run by tests/integration/test_long_context_parallel.py. Writes the step losses, averaged
over the data-parallel ranks, to OUT (JSON).

    python -m tests.integration._tiled_loss_worker OUT DEVICES LOSS_CHUNKS ZERO_STAGE
"""

import json
import sys

import torch
import transformers

import trainplan.executor
from trainplan.planner.api import plan_for_choice


def main(out: str, devices: int, loss_chunks: int, zero_stage: int) -> None:
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    plan = plan_for_choice(model, "cpu", seq_len=64, micro_batch=2 // devices, max_steps=3, devices=devices,
                           zero_stage=zero_stage, loss_chunks=loss_chunks, activation_checkpoint="full",
                           optimizer_bits=32)
    applied = trainplan.executor.apply_plan(plan, model)
    data = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, 512, (2, 65), generator=data)  # the global batch: each replica its rows
        rows = slice(applied.dp_rank * applied.micro_batch, (applied.dp_rank + 1) * applied.micro_batch)
        loss = applied.loss(tokens[rows, :-1], tokens[rows, 1:])
        loss.backward()
        applied.optimizer.step()
        applied.optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if devices > 1:
            torch.distributed.all_reduce(mean)
            mean /= devices
        losses.append(mean.item())
    if applied.rank == 0:
        with open(out, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:5]))
