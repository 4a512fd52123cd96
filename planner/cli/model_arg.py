"""The `--model` of `trainplan solve`: a preset name, or a transformers config (a `config.json`
file or a folder holding one) built on the meta device by `trainplan.modeling.configs`; and the
sequence-parallel hint of an infeasible plan, from the model's heads.

A value is a config when it is not a preset name and ends in `.json`, names a path (has a `/`)
or exists; so a folder named like a preset (e.g. one `trainplan export-weights` wrote) is taken
as a config only when written as a path: `./tiny-llama`. torch and transformers are imported by
the functions that build (`trainplan.planner.cli.commands` says why).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["is_config_path", "solve_model", "sp_note"]


def is_config_path(value: str) -> bool:
    """Whether `--model VALUE` names a transformers config rather than a preset (see above)."""
    from trainplan.modeling.presets import known_presets

    text = str(value).strip()
    if text.lower() in known_presets():
        return False
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return text.lower().endswith(".json") or any(s in text for s in seps) or Path(text).exists()


def solve_model(value: str):
    """The model `trainplan solve --model VALUE` plans: the preset name as given, or the causal LM
    of the config VALUE names, built on the meta device (`trainplan.modeling.configs.build_from_config`,
    named by `trainplan.modeling.configs.config_name`).

    Raises:
        UnknownNameError: neither a preset nor a config path; the message lists the presets and
            says a config.json is valid too.
        ModelConfigError: a config that cannot be read or built (`trainplan.modeling.configs.load_config`).
    """
    from trainplan.errors import UnknownNameError
    from trainplan.modeling.presets import get_preset

    if not is_config_path(value):
        try:
            get_preset(value)
        except UnknownNameError as e:
            raise UnknownNameError(f"{e}; or give a transformers config.json (a file, or a folder holding "
                                   "one)") from None
        return value
    from trainplan.modeling.configs import build_from_config, config_name, load_config

    cfg = load_config(value)
    return build_from_config(cfg, device="meta", name=config_name(cfg, value))


def sp_note(model, *, devices: int, seq_len: int) -> str:
    """A hint when `seq_len` rules out SP degrees that the devices and `model`'s heads (a preset
    name, or a module with a transformers config) would allow (`trainplan.modeling.presets.sp_degree_note`),
    else ""."""
    from trainplan.errors import UnknownNameError
    from trainplan.modeling.presets import get_preset, sp_degree_note

    heads: object = None
    kv: object = None
    if isinstance(model, str):
        try:
            pre = get_preset(model)
        except UnknownNameError:
            return ""
        heads, kv = pre.num_attention_heads, pre.num_key_value_heads
    else:
        cfg = getattr(model, "config", None)
        heads = getattr(cfg, "num_attention_heads", None)
        kv = getattr(cfg, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or not isinstance(kv, int):
        return ""
    return sp_degree_note(n_heads=heads, n_kv_heads=kv, devices=devices, seq_len=seq_len)
