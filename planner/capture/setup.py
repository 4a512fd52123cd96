"""Model setup for `trainplan.planner.api` and `trainplan.planner.joint.problem`: the default precision, the model's
capture on the meta device (`capture_model`), the step model on a hardware profile
(`setup_model`) and the loss law a plan predicts with (`loss_law_for`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from trainplan.costmodels.loss.cache import load_local_law
from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.loss.transfer import carry_law
from trainplan.costmodels.step.model import StepModel
from trainplan.errors import CaptureError, TrainplanError
from trainplan.hardware_profiles import HardwareProfile
from trainplan.hardware_profiles import load as load_profile
from trainplan.modeling.activation_compression import check_activation_bits
from trainplan.modeling.presets import build_model, get_preset
from trainplan.planner.capture.graph import ModelGraph, capture

PRECISION_DTYPE = {"fp32": "fp32", "bf16-mixed": "bf16", "bf16": "bf16"}
"""Training precision -> the dtype of the profile's peak FLOP rate its matmuls run at."""


def default_precision(hw: HardwareProfile) -> str:
    """fp32 on CPUs (bf16 matmuls are slow there), bf16 mixed precision on accelerators."""
    return "fp32" if hw.device_type == "cpu" else "bf16-mixed"


def capture_model(model: nn.Module | str, precision: str, *, vocab_size: int | None = None,
                  activation_bits: tuple[int, ...] = (),
                  device_type: str = "cpu", seq_len: int | None = None) -> tuple[ModelGraph, str, tuple[int, ...]]:
    """Build (if a preset name) and capture `model` on the meta device, with the regions of
    each saved-activation width in `activation_bits` (`trainplan.planner.capture.graph.capture`), with
    the attention and dropout kernels of `device_type` (a profile's: `cpu` or `cuda`).

    Returns the graph, the model's name and its parameter tensor sizes.

    Raises:
        UnknownNameError: unknown preset.
        TrainplanError: not a module or preset name; a module not laid out as a causal LM.
        CaptureError: the module's forward+backward cannot be traced (e.g. a graph break).
    """
    # bf16-mixed is torch.autocast over fp32 parameters; bf16 keeps parameters in bf16 too
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    autocast = torch.bfloat16 if precision == "bf16-mixed" else None
    if isinstance(model, str):
        get_preset(model)  # typed error for unknown names
        module = build_model(model, device="meta", dtype=dtype, vocab_size=vocab_size)
        name = model
    elif isinstance(model, nn.Module):
        module, name = model, getattr(model, "trainplan_preset", type(model).__name__)
    else:
        raise TrainplanError(f"model must be an nn.Module or a preset name, got {type(model).__name__}")
    try:
        graph = capture(module, dtype=dtype, name=name, autocast_dtype=autocast,
                        activation_bits=tuple(activation_bits), device_type=device_type, seq_len=seq_len)
        if precision == "bf16-mixed":  # FSDP2's MixedPrecisionPolicy: bf16 parameters, no autocast
            mp = capture(module, dtype=torch.bfloat16, name=name, activation_bits=tuple(activation_bits),
                         device_type=device_type, seq_len=seq_len)
            graph = with_mixed_precision_variants(graph, mp)
    except TrainplanError:
        raise
    except Exception as e:  # a graph break: data-dependent control flow, an untraceable op, ...
        why = (str(e).strip().splitlines() or [""])[0][:200]
        raise CaptureError(
            f"cannot capture {name}: tracing its forward+backward on fake tensors failed with "
            f"{type(e).__name__}: {why}; trainplan needs a model without data-dependent control "
            "flow (no .item(), no branching on tensor values): use a preset or a transformers "
            "*ForCausalLM model") from e
    return graph, name, tuple(p.numel() for p in module.parameters())


def mixed_precision_key(key: str) -> str:
    """Region key of `key` traced under FSDP2's mixed-precision policy: `block0` -> `block0@mp`,
    `block0@a8` -> `block0@mp@a8` (`trainplan.costmodels.step.model.StepModel.region_name`)."""
    base, sep, rest = key.partition("@")
    return f"{base}@mp{sep}{rest}"


def with_mixed_precision_variants(graph: ModelGraph, mp: ModelGraph) -> ModelGraph:
    """`graph` (bf16-mixed under autocast: fp32 parameters, what DDP runs) with the regions of
    `mp` (the same model traced with bf16 parameters and no autocast: what FSDP2 runs under
    `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`) added under
    `mixed_precision_key`, and its tracer for their sequence-tiled variants
    (`trainplan.planner.capture.regions.RegionTable`)."""
    return dataclasses.replace(graph, regions=graph.regions.with_variants(mp.regions, mixed_precision_key, "mp"))


def setup_model(model: nn.Module | str, hw: str | HardwareProfile, *, precision: str | None,
                vocab_size: int | None, activation_bits: object = (32,), overlap: bool = True,
                seq_len: int | None = None) -> tuple[HardwareProfile, str, ModelGraph, str, StepModel]:
    """Load `hw`, settle the precision (None: `default_precision`), check the saved-activation
    widths (`check_activation_bits_options`), capture `model` (with `hw`'s attention and dropout
    kernels, `trainplan.planner.capture.device_kernels`; `overlap=False`: the step model adds every
    collective to compute, `trainplan.costmodels.step.model.StepModel`) (`capture_model`; `seq_len`: the
    plans' sequence when known, for a sliding window's mask) and build its step model on the
    profile.

    Returns (profile, precision, graph, model name, step model).

    Raises:
        UnknownNameError: unknown hardware or preset.
        TrainplanError: an unknown precision or activation width; not a causal LM.
        CaptureError: the model cannot be traced."""
    profile = load_profile(hw)
    precision = precision or default_precision(profile)
    if precision not in PRECISION_DTYPE:
        raise TrainplanError(f"precision={precision!r} is not known: use {', '.join(PRECISION_DTYPE)}")
    activation_bits = check_activation_bits_options(activation_bits)
    graph, name, numels = capture_model(model, precision, vocab_size=vocab_size, activation_bits=activation_bits,
                                        device_type=profile.device_type, seq_len=seq_len)
    step_model = StepModel(graph.regions, graph.blocks, numels, profile, n_heads=graph.n_heads,
                           n_kv_heads=graph.n_kv_heads, head_dim=graph.head_dim, overlap=overlap)
    return profile, precision, graph, name, step_model


def loss_law_for(law: LossLaw | None, profile: HardwareProfile, name: str, graph: ModelGraph,
                 bytes_per_token: float | None = None) -> LossLaw:
    """The loss law a plan of model `name` on `profile` predicts with, bounded by ln(vocabulary):
    `law` when given; on the cpu profile the law `trainplan calibrate` fitted for (model,
    vocabulary), if one is cached (`trainplan.costmodels.loss.cache.load_local_law`); else Besiroglu et
    al. 2024's, carried per byte to the corpus's `bytes_per_token` when it is known
    (`trainplan.costmodels.loss.transfer.carry_law`)."""
    if law is None and profile.name == "cpu":  # a law fitted by `trainplan calibrate`, if any
        law = load_local_law(name, graph.vocab_size)
    if law is None:
        law = LossLaw.besiroglu2024()
        if bytes_per_token is not None:
            law = carry_law(law, bytes_per_token)
    if law.vocab_size is None and graph.vocab_size >= 2:
        law = dataclasses.replace(law, vocab_size=int(graph.vocab_size))
    return law


def check_activation_bits_options(activation_bits: object) -> tuple[int, ...]:
    """Saved-activation widths to choose from (one width or several) as a tuple, each checked.

    Raises:
        TrainplanError: an unknown width (`trainplan.modeling.activation_compression.check_activation_bits`),
            or none at all."""
    widths = (activation_bits if isinstance(activation_bits, Iterable) and not isinstance(activation_bits, int)
              else (activation_bits,))
    out = tuple(check_activation_bits(b) for b in widths)
    if not out:
        raise TrainplanError("activation_bits is empty: give at least one of 32, 16, 8")
    return out
