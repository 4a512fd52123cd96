"""`trainplan export-weights RUN_DIR --out DIR`: a run's trained weights as a Hugging Face model
folder (safetensors) with its tokenizer (when the run had one), called by `trainplan.planner.cli.main.main`
with the parsed arguments; prints the folder and how to load it on stdout.

The executor (torch, transformers) is imported inside the command (`trainplan.planner.cli.commands` says why).
"""

from __future__ import annotations

__all__ = ["cmd_export_weights"]


def cmd_export_weights(args) -> int:
    """`trainplan.executor.weights.export.export_weights(args.run_dir, args.out, dtype=args.dtype)`.

    Raises:
        OutputPathError: --out is a file or a folder that is not empty.
        TrainplanError: RUN_DIR is not a run folder or has no checkpoint.
        UnknownNameError: an unknown --dtype, or a checkpoint of a model that is not a preset.
    """
    from trainplan.executor.weights.export import export_weights

    out = export_weights(args.run_dir, args.out, dtype=args.dtype, progress=not getattr(args, "quiet", False))
    files = sorted(p.name for p in out.iterdir())
    print(f"weights: {out} ({', '.join(files)})")
    load = f"load: transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})"
    if "tokenizer.json" in files:  # a run on token ids without a tokenizer: the weights alone
        load += f"; transformers.AutoTokenizer.from_pretrained({str(out)!r})"
    print(load)
    return 0
