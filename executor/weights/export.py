"""A run's trained weights as a Hugging Face model folder: `config.json`, `model.safetensors` and
the run's tokenizer, loadable with `transformers.AutoModelForCausalLM` / `AutoTokenizer`.

`export_weights(run_dir, out_dir)` reads the run folder `trainplan run` wrote (`plan.json` and
`checkpoint/latest` -> `checkpoint/step-N/`, `trainplan.executor.checkpoint`), builds the plan's preset
(`trainplan.modeling.presets.build_model`, or `trainplan.modeling.configs.build_from_config` for a plan holding a
config) on the CPU at the run's vocabulary, loads the checkpoint's model state into it and
writes it with the model's own `save_pretrained` (safetensors; tied weights handled by
transformers).

One process, no process group: `torch.distributed.checkpoint.load` reads a checkpoint written
by any number of ranks (plain modules, DDP, FSDP2's sharded DTensors: each rank's shards are
read and assembled into the full tensors of the one-process state dict, keyed by parameter name,
`torch.distributed.checkpoint.state_dict.get_model_state_dict`). The optimizer state in the
checkpoint is not read.

Dtype: the checkpoint's own (what the parameters were trained in: bf16 for `precision="bf16"`,
fp32 for fp32 and bf16-mixed, whose parameters are fp32), or the one asked for (`DTYPES`).

Tokenizer: the copy the checkpoint keeps (`trainplan.executor.checkpoint.TOKENIZER`), else the file its
`trainplan.json` names (`corpus.tokenizer`), written as a `transformers.PreTrainedTokenizerFast`
with the run's document separator (`<|endoftext|>` for trainplan's BPE) as its BOS/EOS token and
the model config's.
A checkpoint that records no tokenizer (written before tokenizers were recorded, or trained on
token ids without one) gets the weights alone and a warning.

Memory: the full model on the CPU, in the checkpoint's dtype (bytes = parameters x 2 or 4), once;
the load fills it in place.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from trainplan.errors import DataError, OutputPathError, TrainplanError, UnknownNameError
from trainplan.executor.checkpoint import CHECKPOINT_DIR, LATEST, META, TOKENIZER, latest_checkpoint
from trainplan.executor.data.corpus import load_tokenizer, separator_id
from trainplan.modeling import configs, presets
from trainplan.planner.plan import Plan

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["DTYPES", "check_export_dir", "export_weights", "hf_tokenizer", "load_trained_model",
           "resolve_dtype", "run_checkpoint", "run_tokenizer_path", "trained_dtype"]

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""The dtypes weights are exported in, by the command line's names."""
MODEL_KEY = "model"
"""The model's part of the checkpoint's state (`trainplan.executor.checkpoint.save_checkpoint`)."""


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """`dtype` as a torch dtype: None (the checkpoint's), a name of `DTYPES` or one of its dtypes.

    Raises:
        UnknownNameError: any other value; the message lists the valid names.
    """
    if dtype is None or dtype in DTYPES.values():
        return dtype  # type: ignore[return-value]
    if isinstance(dtype, str) and dtype.strip().lower() in DTYPES:
        return DTYPES[dtype.strip().lower()]
    raise UnknownNameError(f"dtype {dtype!r} is not one weights are exported in; valid: "
                           f"{', '.join(DTYPES)} (default: the dtype the run trained in)")


def check_export_dir(out_dir: str | Path, *, option: str = "--out") -> Path:
    """Where an export may be written: a new folder, or an empty one.

    Raises:
        OutputPathError: empty path, a file, or a folder that holds files already.
    """
    if not str(out_dir).strip():
        raise OutputPathError(f"{option} is empty; give a new or empty folder for the model files")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputPathError(f"{option} {str(out)!r} is a file; give a new or empty folder for the "
                              "model files")
    if out.is_dir() and (held := sorted(p.name for p in out.iterdir())):
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise OutputPathError(f"{option} {str(out)!r} is not empty (it holds {shown}); give a new "
                              "or empty folder for the model files")
    return out


def run_checkpoint(run_dir: str | Path) -> tuple[Plan, Path]:
    """The plan of the run in `run_dir` and its newest complete checkpoint directory.

    Raises:
        TrainplanError: `run_dir` is not a folder, holds no plan.json (not a run folder), or
            holds no complete checkpoint (the message says how a run writes one: `trainplan run`
            for a preset, else the user's own loop or `trainplan.executor.run`).
        PlanMismatchError: its plan.json cannot be read (`trainplan.planner.plan.Plan.from_json`).
    """
    run = Path(run_dir)
    if not str(run_dir).strip() or not run.is_dir():
        raise TrainplanError(f"run folder {str(run_dir)!r} does not exist or is not a folder; pass the "
                             "--out folder of `trainplan run`")
    if not (run / "plan.json").is_file():
        raise TrainplanError(f"{str(run)!r} is not a trainplan run folder (no plan.json); pass the "
                             "--out folder of `trainplan run`")
    plan, ckpt = Plan.from_json(run / "plan.json"), latest_checkpoint(run)
    if ckpt is None and plan.hf_config is None and not _is_preset(model := plan.model):
        raise TrainplanError(
            f"run folder {str(run)!r} has no checkpoint (no {CHECKPOINT_DIR}/{LATEST}), and its model "
            f"{model!r} is not a preset, which `trainplan run` cannot build: a run of your own loop "
            "(trainplan.executor.apply_plan) keeps no checkpoint; save the weights in your loop (the model's "
            "save_pretrained), or train with trainplan.executor.run(plan, model, out=DIR) and load its checkpoint "
            "into your own model with torch.distributed.checkpoint")
    if ckpt is None:
        raise TrainplanError(
            f"run folder {str(run)!r} has no checkpoint (no {CHECKPOINT_DIR}/{LATEST} naming a complete "
            f"step-N folder): `trainplan run` writes one when a run ends or is interrupted, unless "
            f"--checkpoint-every 0; train again with `trainplan run {str(run / 'plan.json')} --out DIR`")
    return plan, ckpt


def _is_preset(name: str) -> bool:
    try:
        presets.get_preset(name)
    except UnknownNameError:
        return False
    return True


def trained_dtype(ckpt: str | Path) -> torch.dtype:
    """The dtype the checkpoint's model parameters were saved in (the most common one among the
    floating-point tensors of its model state), from the checkpoint's metadata alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainplan.executor.safe_load import read_metadata

    meta = read_metadata(ckpt).state_dict_metadata  # allow-listed unpickling (UnsafeFileError)
    counts: dict[torch.dtype, int] = {}
    for key, item in meta.items():
        if key.startswith(MODEL_KEY + ".") and isinstance(item, TensorStorageMetadata) \
                and item.properties.dtype.is_floating_point:
            counts[item.properties.dtype] = counts.get(item.properties.dtype, 0) + item.size.numel()
    return max(counts, key=lambda d: counts[d]) if counts else torch.float32


def load_trained_model(run_dir: str | Path, *, dtype: str | torch.dtype | None = None) -> nn.Module:
    """The run's model on the CPU in eval mode: its preset at the run's vocabulary, the latest
    checkpoint's parameters loaded (from any number of ranks' shards, in one process), then cast
    to `dtype` (default: the checkpoint's, `trained_dtype`).

    Raises:
        TrainplanError: not a run folder or no checkpoint (`run_checkpoint`).
        UnknownNameError: an unknown `dtype`, or a plan whose model is not a preset (the message
            says how to load the checkpoint into one's own model instead).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from trainplan.executor.safe_load import dcp_load

    want = resolve_dtype(dtype)
    plan, ckpt = run_checkpoint(run_dir)
    stored = trained_dtype(ckpt)
    try:
        model = (configs.build_from_config(plan.hf_config, device="cpu", dtype=stored, vocab_size=plan.vocab_size,
                                           seed=plan.decisions.seed, name=plan.model)
                 if plan.hf_config is not None else  # a config-built model: `trainplan solve --model config.json`
                 presets.build_model(plan.model, device="cpu", dtype=stored, vocab_size=plan.vocab_size,
                                     seed=plan.decisions.seed))
    except UnknownNameError:
        raise UnknownNameError(
            f"the run in {str(run_dir)!r} trained model {plan.model!r}, which is not a preset "
            f"({', '.join(presets.known_presets())}): export-weights builds presets only; load "
            f"{str(ckpt)!r} into your own model with torch.distributed.checkpoint "
            f"(state = {{{MODEL_KEY!r}: get_model_state_dict(model)}}; dcp.load(state, checkpoint_id=...); "
            f"set_model_state_dict(model, state[{MODEL_KEY!r}])) and call its save_pretrained") from None
    state = {MODEL_KEY: get_model_state_dict(model)}
    with warnings.catch_warnings():  # DCP warns that it assumes one process: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(state, ckpt)  # missing keys raise; the optimizer's are not read; a crafted pickle is refused
    set_model_state_dict(model, state[MODEL_KEY])
    if want is not None and want != stored:
        model.to(dtype=want)
    return model.eval()


def run_tokenizer_path(ckpt: str | Path) -> Path | None:
    """The run's tokenizer file (HF `tokenizers` JSON): the checkpoint's copy, else the path its
    `trainplan.json` records under `corpus.tokenizer` if that file still exists, else None."""
    ckpt = Path(ckpt)
    if (ckpt / TOKENIZER).is_file():
        return ckpt / TOKENIZER
    recorded = json.loads((ckpt / META).read_text()).get("corpus", {}).get("tokenizer")
    return Path(recorded) if recorded and Path(recorded).is_file() else None


def hf_tokenizer(path: str | Path):
    """A `transformers.PreTrainedTokenizerFast` over the `tokenizers` JSON at `path`, with the
    run's document separator (`trainplan.executor.data.corpus.separator_id`: `<|endoftext|>` for trainplan's
    BPE) as its BOS and EOS token (GPT-2's convention: the token stream separates documents by
    it), none when the vocabulary has no separator. It encodes as the run did for trainplan's
    BPE (which has no post-processor adding tokens); a model's own tokenizer keeps its
    post-processor (a BOS it adds is one the run did not see)."""
    from transformers import PreTrainedTokenizerFast

    tok = load_tokenizer(path)
    try:
        sep = tok.id_to_token(separator_id(tok, path))
    except DataError:
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token=sep, eos_token=sep)


def export_weights(run_dir: str | Path, out_dir: str | Path, *,
                   dtype: str | torch.dtype | None = None, progress: bool = True) -> Path:
    """Write the run's latest checkpoint to `out_dir` as a Hugging Face model folder:
    `config.json`, `generation_config.json`, `model.safetensors` (in `dtype`: None for the dtype
    the run trained in, `bf16` or `fp32`) and, when the run recorded one, its tokenizer
    (`tokenizer.json`, `tokenizer_config.json`). The folder is written beside `out_dir` and
    renamed into place, so a failed export leaves nothing at `out_dir`. `progress`: transformers'
    progress bar while the weights are written (stderr). Returns `out_dir`.

    Load it with `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` and, when the
    tokenizer was written, `transformers.AutoTokenizer.from_pretrained(out_dir)`.

    Raises:
        OutputPathError: `out_dir` is a file or a folder that is not empty.
        TrainplanError: `run_dir` is not a run folder or has no checkpoint.
        UnknownNameError: an unknown `dtype`, or a run of a model that is not a preset.
    """
    out = check_export_dir(out_dir)
    want = resolve_dtype(dtype)
    plan, ckpt = run_checkpoint(run_dir)
    model = cast("PreTrainedModel", load_trained_model(run_dir, dtype=want))
    tok_path = run_tokenizer_path(ckpt)
    tokenizer = hf_tokenizer(tok_path) if tok_path is not None else None
    model.config.use_cache = True  # trained without the KV cache; generation wants it
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        from transformers import GenerationConfig

        model.config.bos_token_id = model.config.eos_token_id = tokenizer.eos_token_id
        model.config.pad_token_id = None
        model.generation_config = GenerationConfig.from_model_config(model.config)
    from transformers.utils import logging as hf_logging

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    bar = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp)  # safetensors (transformers >= 5 writes no other format)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for path in tmp.iterdir():  # safetensors writes 0600; a model folder is meant to be shared
            os.chmod(path, 0o644)
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700
        os.replace(tmp, out)  # onto a missing or empty folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar and not progress:
            hf_logging.enable_progress_bar()
    if tokenizer is None:
        logger.warning("the checkpoint %s records no tokenizer (a run from before tokenizers were "
                       "kept with checkpoints, or one on token ids alone): %s has the weights only",
                       ckpt, out)
    logger.info("exported %s (%s, %d steps) to %s", plan.model, ckpt.name,
                json.loads((ckpt / META).read_text())["steps"], out)
    return out
