"""The listing commands of the `trainplan` command line: `trainplan presets` (the model presets
`--model` accepts) and `trainplan profiles` (the hardware profiles `--hw` accepts), each a table
on stdout; called by `trainplan.planner.cli.main.main` with the parsed arguments.

pandas, torch and the presets are imported inside the commands (`trainplan.planner.cli.commands` says why).
"""

from __future__ import annotations

import logging

__all__ = ["cmd_presets", "cmd_profiles", "preset_rows"]

logger = logging.getLogger(__name__)


def preset_rows() -> list[dict[str, object]]:
    """One row per model preset, sorted by name: name, family, params_b (parameters, 1e9, at the
    preset's vocabulary), layers, hidden, heads, kv_heads, vocab, max_seq_len (tokens), source."""
    import importlib

    importlib.import_module("trainplan.hardware_profiles")  # first: it quiets optional kernels' import-time warnings
    from trainplan.modeling.presets import get_preset, known_presets, preset_n_params

    rows = []
    for name in known_presets():
        p = get_preset(name)
        rows.append({"name": p.name, "family": p.family, "params_b": preset_n_params(name) / 1e9,
                     "layers": p.num_hidden_layers, "hidden": p.hidden_size,
                     "heads": p.num_attention_heads, "kv_heads": p.num_key_value_heads,
                     "vocab": p.vocab_size, "max_seq_len": p.max_position_embeddings, "source": p.source})
    return rows


def cmd_presets(args) -> int:
    """`trainplan presets`: the model presets as a table (the source column left out)."""
    import pandas as pd

    df = pd.DataFrame(preset_rows()).drop(columns=["source"])
    print(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return 0


def cmd_profiles(args) -> int:
    """`trainplan profiles`: the shipped accelerator profiles as a table; with `--measure-cpu`
    also this machine's `cpu` profile (measured when this host has none cached); `--template
    NAME`: profile NAME as a TOML file to edit instead.

    Raises:
        UnknownNameError: --template names no profile.
        TrainplanError: --template's profile file is invalid."""
    import pandas as pd

    from trainplan.hardware_profiles import describe_profiles

    if args.template is not None:
        from trainplan.hardware_profiles import load
        from trainplan.hardware_profiles.profile_file import template_toml

        print(template_toml(load(args.template)), end="")
        return 0
    df = pd.DataFrame(describe_profiles(include_cpu=args.measure_cpu)).drop(columns=["source"])
    print(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    if not args.measure_cpu:
        logger.info("cpu (this machine, measured) not listed: add --measure-cpu")
    return 0
