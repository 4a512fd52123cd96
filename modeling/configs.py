"""Models from a transformers config: any causal LM that `transformers` knows, built from its
`config.json` on the meta device (planning) or with random weights (a run), with no download.

`load_config` reads a config file (or the `config.json` in a folder) into a dict and checks it;
`build_from_config` builds the model of such a dict with `AutoConfig.for_model` and
`AutoModelForCausalLM.from_config`: attention through SDPA where the model class supports it,
else eager (Gemma-2 refuses SDPA); no KV cache. The built module carries the dict
(`trainplan_config`, which a plan stores so that `trainplan run` rebuilds the same model) and a
name (`trainplan_preset`, which plans and captures use as a preset's name). `max_positions` is
the longest sequence a model (a preset or a module) was configured for, `position_warning` the
plan's warning for a longer one. A config must give the model's size (`check_config`: `SIZE_FIELDS`,
`DERIVED_FIELDS`); the fields it leaves to its class's defaults are the warning
`defaults_warning` (`trainplan_config_warning` on the module). As in `trainplan.modeling.presets`,
`transformers` is imported by the functions that need it.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainplan.errors import ModelConfigError, UnknownNameError
from trainplan.modeling.presets import cast_keeping_rotary, get_preset

CONFIG_FILE = "config.json"
"""The file a model folder holds its config in (transformers' `CONFIG_NAME`)."""
EXAMPLE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "gpt2", "gpt_neox")
"""Causal-LM model types an error names as examples of valid ones (all known to transformers 5)."""
SIZE_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
"""The size fields a config must give, by transformers' standard names (`PretrainedConfig.attribute_map`
maps them to an architecture's own, e.g. GPT-2's `n_embd`, `n_head`, `n_layer`)."""
INTERMEDIATE_NAMES = ("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim", "d_ff")
"""What architectures call the MLP's inner width; the first a config class has is its name."""
DERIVED_FIELDS = (INTERMEDIATE_NAMES, ("num_key_value_heads",), ("head_dim",))
"""Size fields a class may derive from the others: required where the class's default is a number
(Qwen2's 32 key-value heads, Gemma's head_dim 256 fit no other model), derived where it is None
(GPT-2's MLP of 4 x n_embd, head_dim = hidden / heads; as many key-value heads as heads, which the
plan warns of: a grouped-query model that leaves them out is planned with full attention)."""
DEFAULTED_FIELDS = ("max_position_embeddings", "tie_word_embeddings")
"""Fields that change a plan's parameters or its position warning and that a config may leave to
the class's default: the plan warns of each one left out (`defaults_warning`)."""


def load_config(path: str | Path) -> dict[str, Any]:
    """The config dict in `path`: a transformers `config.json`, or a folder holding one. Nothing
    is downloaded; the dict is checked as `check_config` checks it.

    Raises:
        ModelConfigError: no such file or folder, a folder without `config.json`, a file that is
            not UTF-8 JSON or not a JSON object, and what `check_config` raises.
    """
    p = Path(path)
    where = f"model config {str(path)!r}"
    if p.is_dir():
        if not (p / CONFIG_FILE).is_file():
            raise ModelConfigError(f"{where} is a folder without {CONFIG_FILE}: give a transformers {CONFIG_FILE} "
                                   "file or a folder holding one (a model folder as save_pretrained writes it)")
        p = p / CONFIG_FILE
    elif not p.exists():
        raise ModelConfigError(f"{where} does not exist: give a transformers {CONFIG_FILE} file or a folder "
                               "holding one (nothing is downloaded: fetch it first, e.g. `hf download ORG/NAME "
                               f"{CONFIG_FILE} --local-dir DIR`)")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0][:200]
        raise ModelConfigError(f"{where} is not a JSON file ({why}): give a transformers {CONFIG_FILE}, "
                               'an object such as {"model_type": "llama", "hidden_size": 4096, ...}') from None
    check_config(cfg, where=where)
    return cfg


def check_config(cfg: object, *, where: str = "model config") -> str:
    """The model type of config dict `cfg`, checked to be a causal LM that transformers knows.

    Raises:
        ModelConfigError: not a dict; no `model_type` (or not a string); a model type
            transformers does not know (the message names the nearest known ones); a model type
            whose models are not causal LMs (no `AutoModelForCausalLM` class); an encoder (a type
            with a masked-LM class, e.g. bert, roberta) not made a decoder (`is_decoder` true):
            its attention would see the future; a config that leaves out a size field
            (`SIZE_FIELDS`, or a `DERIVED_FIELDS` field of a numeric default), named as the
            architecture names it with the default it would have got. `where` starts the message (e.g. "model config
            'x/config.json'").
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    causal = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    examples = f"{', '.join(EXAMPLE_TYPES)} ({len(causal)} causal-LM types in transformers {transformers.__version__})"
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{where} is a JSON {type(cfg).__name__}, not an object: give a transformers "
                               f'{CONFIG_FILE}, an object such as {{"model_type": "llama", ...}}')
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type.strip():
        got = "has no model_type" if model_type is None else f"has model_type={model_type!r}"
        raise ModelConfigError(f"{where} {got}: a transformers config names its architecture in a model_type "
                               f"string; valid are causal-LM types such as {examples}")
    if model_type not in CONFIG_MAPPING_NAMES:
        near = difflib.get_close_matches(model_type, causal, n=3)
        hint = f"did you mean {' or '.join(map(repr, near))}? " if near else ""
        raise ModelConfigError(f"{where}: model_type {model_type!r} is not known to transformers "
                               f"{transformers.__version__}; {hint}valid are causal-LM types such as {examples} "
                               "(models that need trust_remote_code are not built)")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelConfigError(f"{where}: model_type {model_type!r} ({CONFIG_MAPPING_NAMES[model_type]}) is not a "
                               "causal language model (transformers has no AutoModelForCausalLM class for it); "
                               f"trainplan trains decoder LMs: valid are causal-LM types such as {examples}")
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and cfg.get("is_decoder") is not True:
        raise ModelConfigError(f"{where}: model_type {model_type!r} is an encoder (bidirectional attention: a "
                               "causal LM built from it would see the future); set \"is_decoder\": true to train "
                               f"it as a decoder, or give a decoder type such as {', '.join(EXAMPLE_TYPES[:5])}")
    missing, _ = _unset_fields(cfg, model_type)
    if missing:
        cls = _config_class(model_type)
        shown = ", ".join(f"{k}={v}" for k, v in missing.items())
        raise ModelConfigError(f"{where} ({model_type}) leaves out {', '.join(missing)}: a model's size is not taken "
                               f"from transformers' defaults ({cls.__name__}: {shown}); give "
                               f"{'it' if len(missing) == 1 else 'them'} in the config, e.g. from the model's "
                               f"published {CONFIG_FILE}")
    return model_type


def _config_class(model_type: str) -> type:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def _field_defaults(cls: type) -> dict[str, Any]:
    """The fields of config class `cls` with their defaults (dataclass fields in transformers 5,
    else `__init__`'s keyword parameters); a field without a plain default maps to `...`."""
    try:
        return {f.name: (f.default if f.default is not dataclasses.MISSING else ...) for f in dataclasses.fields(cls)}
    except TypeError:
        return {k: (p.default if p.default is not p.empty else ...)
                for k, p in inspect.signature(cls).parameters.items()}


def _unset_fields(cfg: dict[str, Any], model_type: str) -> tuple[dict[str, Any], list[str]]:
    """The size fields config dict `cfg` of `model_type` leaves out, as the architecture names them,
    with its class's defaults (`SIZE_FIELDS`, and `DERIVED_FIELDS` of a numeric default), and the
    fields it leaves to the class (`DERIVED_FIELDS` of default None, `DEFAULTED_FIELDS`). A class with a `text_config`
    (a multimodal model's language model) is checked there, the names prefixed "text_config."."""
    cls = _config_class(model_type)
    sub = getattr(cls, "sub_configs", None) or {}
    if "text_config" in sub and isinstance(sub["text_config"], type) and "hidden_size" not in _field_defaults(cls):
        inner = cfg.get("text_config")
        inner = inner if isinstance(inner, dict) else {}
        return _unset_in(inner, sub["text_config"], prefix="text_config.")
    return _unset_in(cfg, cls, prefix="")


def _unset_in(cfg: dict[str, Any], cls: type, *, prefix: str) -> tuple[dict[str, Any], list[str]]:
    defaults = _field_defaults(cls)
    alias = dict(getattr(cls, "attribute_map", {}) or {})
    missing: dict[str, Any] = {}
    defaulted: list[str] = []
    for std in SIZE_FIELDS:
        name = alias.get(std, std)
        if name in defaults and name not in cfg and std not in cfg:
            missing[prefix + name] = defaults[name]
    for names in DERIVED_FIELDS:
        name = next((n for n in names if n in defaults), None)
        if name is None or name in cfg or defaults[name] is ...:
            continue
        if defaults[name] is None:
            if name == "num_key_value_heads":
                defaulted.append(name)
        else:
            missing[prefix + name] = defaults[name]
    for std in DEFAULTED_FIELDS:
        name = alias.get(std, std)
        if name in defaults and name not in cfg and std not in cfg:
            defaulted.append(name)
    return missing, defaulted


def defaults_warning(cfg: dict[str, Any], hf_config: Any, *, name: str) -> str:
    """The plan's warning for the fields (`DEFAULTED_FIELDS`, derived `DERIVED_FIELDS`) that config dict
    `cfg` leaves to its class, with the values `hf_config` (the built transformers config) took,
    or "" when it gives them all."""
    model_type = str(cfg.get("model_type"))
    _, defaulted = _unset_fields(cfg, model_type)
    if not defaulted:
        return ""
    text = getattr(hf_config, "text_config", None)
    src = text if text is not None and "hidden_size" not in _field_defaults(type(hf_config)) else hf_config
    shown = ", ".join(f"{k}={getattr(src, k, None)!r}" for k in defaulted)
    return (f"model config {name!r} leaves out {', '.join(defaulted)}: planned with {type(src).__name__}'s "
            f"defaults ({shown}); give them in the config if the model has others")


def config_name(cfg: dict[str, Any], path: str | Path | None = None) -> str:
    """The name a plan gives the model of config `cfg` read from `path`: the config's
    `_name_or_path` when it has one, else `<model_type>-<name>` with the file's stem, or its
    folder's name for a `config.json` (`qwen2-mymodel` for `mymodel/config.json`)."""
    named = cfg.get("_name_or_path")
    if isinstance(named, str) and named.strip():
        return named.strip()
    label = ""
    if path is not None:
        p = Path(path).resolve()
        p = p / CONFIG_FILE if p.is_dir() else p
        label = p.parent.name if p.name == CONFIG_FILE else p.stem
    return f"{cfg.get('model_type', 'model')}-{label}" if label else str(cfg.get("model_type", "model"))


def build_from_config(cfg: dict[str, Any], *, device: str | torch.device = "meta",
                      dtype: torch.dtype = torch.float32, vocab_size: int | None = None, seed: int = 0,
                      name: str | None = None) -> nn.Module:
    """The causal LM of transformers config dict `cfg` (as `load_config` returns it, or a plan's
    `hf_config`), no KV cache, attention through SDPA where its class supports it, else eager.

    On `device="meta"` nothing is allocated; on a real device the weights are randomly
    initialised with `seed`. It is built in fp32 (whatever `dtype` the config names), then cast to
    `dtype` with the rotary frequencies kept fp32 (`trainplan.modeling.presets.cast_keeping_rotary`).
    `vocab_size` overrides the config's (a run uses its tokenizer's). The module carries
    `trainplan_config` (`cfg`, with `vocab_size` when given) and `trainplan_preset` (`name`,
    default `config_name(cfg)`).

    Raises:
        ModelConfigError: what `check_config` raises; a config transformers refuses to build
            (e.g. a hidden size its heads do not divide; the message quotes transformers').
    """
    import transformers

    where = f"model config {name!r}" if name else "model config"
    model_type = check_config(cfg if vocab_size is None or not isinstance(cfg, dict)
                              else {**cfg, "vocab_size": vocab_size}, where=where)
    stored = dict(cfg) if vocab_size is None else {**cfg, "vocab_size": vocab_size}
    fields = {k: v for k, v in stored.items() if k != "model_type"}
    try:
        hf = transformers.AutoConfig.for_model(model_type, **fields)
        hf.use_cache = False
        if str(device) != "meta":
            torch.manual_seed(seed)
        with torch.device(device):
            model = _with_attention(hf)
    except ModelConfigError:
        raise
    except Exception as e:  # transformers' own checks of the config's values
        why = " ".join(line.strip() for line in str(e).splitlines() if line.strip())[:300] or type(e).__name__
        raise ModelConfigError(f"{where}: transformers cannot build a {model_type} model from it: {why}; "
                               "fix that field of the config") from None
    cast_keeping_rotary(model, dtype)
    model.config.use_cache = False
    # how a Plan names the model and rebuilds it (`Plan.model`, `Plan.hf_config`)
    model.trainplan_config = stored
    model.trainplan_preset = name or config_name(cfg)
    # the defaults the config left to its class: a warning the plan carries (`with_model_facts`)
    model.trainplan_config_warning = defaults_warning(stored, hf, name=model.trainplan_preset)
    return model


def _with_attention(hf) -> Any:
    """`AutoModelForCausalLM.from_config(hf)` in fp32 with SDPA attention, or eager where the
    class refuses SDPA (transformers raises ValueError naming the class)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa", dtype=torch.float32)
    except (ValueError, ImportError) as e:
        if "scaled_dot_product_attention" not in str(e) and "sdpa" not in str(e).lower():
            raise
    return AutoModelForCausalLM.from_config(hf, attn_implementation="eager", dtype=torch.float32)


def config_n_params(cfg: dict[str, Any], *, vocab_size: int | None = None) -> int:
    """Parameters of the model of config `cfg` (built on the meta device: no memory).

    Raises:
        ModelConfigError: as `build_from_config`."""
    return sum(p.numel() for p in build_from_config(cfg, device="meta", vocab_size=vocab_size).parameters())


def max_positions(model: nn.Module | str) -> int | None:
    """The longest sequence `model` (a preset name or a module with a transformers `config`)
    was configured for: `max_position_embeddings` (`n_positions` for GPT-2), or None when its
    config names neither (or it has no config)."""
    if isinstance(model, str):
        try:
            return get_preset(model).max_position_embeddings
        except UnknownNameError:
            return None
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def position_warning(name: str, max_pos: int | None, seq_len: int) -> str:
    """The plan's warning for a sequence beyond the positions model `name` was configured for
    (`max_positions`), or "" when `seq_len` is within them (or they are unknown)."""
    if max_pos is None or seq_len <= max_pos:
        return ""
    return (f"seq_len={seq_len:,} is beyond {name}'s max_position_embeddings={max_pos:,}, the longest sequence "
            "its config was made for (a learned position table has no entry past it; rotary embeddings "
            f"extrapolate, and rope scaling assumes it): plan at --seq-len {max_pos} or less, or use a model "
            "configured for more positions")
