"""Help text of the `trainplan` command line: the formatter that shows each flag's default, and
each command's worked examples (its `--help` epilog).

Every example is a command that runs as written, from the repository root after
`source .venv/bin/activate` (`tests/integration/test_cli_conventions.py` parses each one with the
real parser; docs/cli.md shows the same).
"""

from __future__ import annotations

import argparse

__all__ = ["EXAMPLES", "HelpFormatter", "epilog"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's help with each option's default appended as `(default: VALUE)`, the way
    `argparse.ArgumentDefaultsHelpFormatter` does, except where the help text already states its
    default (it holds `default`), the default is None or False (an unset option, a flag that is
    off), or the action is a positional; epilogs keep their line breaks (the examples)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default is None
                or action.default is False or action.default is argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


EXAMPLES: dict[str, tuple[tuple[str, str], ...]] = {
    "solve": (
        ("plan the tiny CPU model for one minute of wall clock and save the plan",
         "trainplan solve --model tiny-llama --hw cpu --seq-len 256 --budget-seconds 60 --json plan.json"),
        ("Llama-3-70B on 8 x MI300X at 128k tokens for 5000 device-hours (seconds to a minute to solve)",
         "trainplan solve --model llama3-70b --hw mi300 --devices 8 --seq-len 131072 "
         "--budget-device-hours 5000"),
        ("the plan JSON on stdout (the readable plan goes to stderr), under a FLOP budget",
         "trainplan solve --model llama3-8b --hw h100 --devices 8 --seq-len 8192 --budget-flops 1e21 "
         "--json - > plan-8b.json"),
    ),
    "run": (
        ("run a saved plan on this machine (torchrun for plans over more than one device)",
         "trainplan run plan.json --out runs/tiny"),
        ("your own corpus and learning-rate schedule (PLAN may also come after --data)",
         "trainplan run plan.json --out runs/tiny-lr --data notes.txt books/ --lr 1e-3 --warmup-steps 5"),
        ("pre-tokenized ids as nanoGPT writes them (raw uint16), used as is",
         "trainplan run plan.json --out runs/bin --data train.bin --token-dtype uint16"),
        ("parquet text (HF datasets, streamed) tokenized by the model's own tokenizer",
         "trainplan run plan.json --out runs/pq --data shards/ --text-column content --tokenizer tokenizer.json"),
        ("continue an interrupted run from its latest checkpoint",
         "trainplan run --out runs/tiny --resume"),
        ("one plan on two machines: run this on each, with --node-rank 1 on the second",
         "trainplan run plan.json --out /shared/runs/2n --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500"),
    ),
    "report": (
        ("rebuild one run's HTML report",
         "trainplan report runs/tiny"),
        ("compare two runs on one page",
         "trainplan report runs/tiny runs/tiny-lr --out reports/lr"),
    ),
    "demo": (
        ("plan, run and report tiny-llama on Shakespeare (about 5 minutes on 2 cores)",
         "trainplan demo"),
        ("a two-minute demo in another folder",
         "trainplan demo --budget-seconds 120 --out runs/quick-demo"),
        ("with the compute governor: stop once a nat of held-out loss costs more than 0.05 device-hours",
         "trainplan demo --loss-value-device-hours-per-nat 0.05"),
    ),
    "presets": (
        ("the model presets --model accepts",
         "trainplan presets"),
    ),
    "profiles": (
        ("the shipped accelerator profiles (no measurement)",
         "trainplan profiles"),
        ("also this machine's cpu profile (measured once per host if not cached, about 4 s)",
         "trainplan profiles --measure-cpu"),
        ("a profile file to edit for a device that ships none, then plan with --hw my-gpu.toml",
         "trainplan profiles --template h100 > my-gpu.toml"),
    ),
    "calibrate": (
        ("refit the cpu profile and the loss law from the demo's run",
         "trainplan calibrate runs/demo"),
        ("refit a GPU profile from runs on it, written for --hw h200-calibrated.toml",
         "trainplan calibrate runs/h200-a runs/h200-b --hw h200 --profile-out h200-calibrated.toml"),
    ),
    "export-weights": (
        ("the demo's trained model as a Hugging Face folder, in the dtype it trained in",
         "trainplan export-weights runs/demo --out models/demo"),
        ("the weights in bf16 (config.json, model.safetensors, tokenizer.json)",
         "trainplan export-weights runs/tiny --out models/tiny-bf16 --dtype bf16"),
    ),
    "export": (
        ("a saved plan as a torchtitan job TOML (torchrun -m torchtitan.train --job.config_file job.toml)",
         "trainplan export plan-8b.json --to torchtitan --out job.toml"),
        ("as a DeepSpeed config JSON on stdout (what DeepSpeed cannot express goes to stderr)",
         "trainplan export plan-8b.json --to deepspeed > ds_config.json"),
        ("as an accelerate config YAML (accelerate launch --config_file accelerate.yaml train.py)",
         "trainplan export plan.json --to accelerate --out accelerate.yaml"),
    ),
}
"""Each command's worked examples: (what it does, the command line)."""


def epilog(command: str, extra: str = "") -> str:
    """The `--help` epilog of `command`: its examples, each under a `#` comment, then `extra`
    (e.g. the exit codes, for the top-level help).

    Raises:
        KeyError: `command` has no examples."""
    lines = ["examples:"]
    for what, line in EXAMPLES[command]:
        lines += [f"  # {what}", f"  {line}"]
    return "\n".join(lines) + (f"\n\n{extra}" if extra else "")
