"""`SolveOptions`: every option of `trainplan.solve` beyond model, hardware and budget, in one
typed, documented, frozen object that the plan records (`trainplan.planner.plan.Plan.options`).

    >>> import trainplan
    >>> opts = trainplan.SolveOptions(seq_len=8192, global_batch_tokens=4 * 2**20)
    >>> plan = trainplan.solve("llama3-8b", "h100", trainplan.Budget(device_hours=500, devices=8), opts)

`solve(model, hw, budget, seq_len=8192)` builds the same object from keywords (`options_from`);
keywords given beside an object override its fields. The search-space options are tuples of the
values the solver may choose from; the other fields are single values.

This module imports neither torch nor the solver (the defaults `trainplan.planner.joint.space` and
`trainplan.planner.data_choice` use are defined here): `trainplan.SolveOptions` is cheap to build.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

from trainplan.costmodels.checkpoint_sets import MENU
from trainplan.errors import TrainplanError

if TYPE_CHECKING:  # annotations only: not needed to build the object
    from trainplan.costmodels.data.quality import QualityFit
    from trainplan.costmodels.loss.law import LossLaw

__all__ = ["DEFAULT_ACTIVATION_BITS", "Corpus", "DEFAULT_DATA_FRACTIONS", "DEFAULT_DATA_METHODS",
           "DEFAULT_MICRO_BATCHES", "DEFAULT_POLICIES", "SolveOptions",
           "options_from"]

DEFAULT_ACTIVATION_BITS = (32,)
"""Saved-activation widths `solve` chooses from by default: as computed. Each width is one more
capture of every region and multiplies the joint model's shape combos (llama3-8b at 8192 tokens
on 8 x h100: 4 s and OPTIMAL with (32,), a 10 s limit hit, FEASIBLE, with (32, 16, 8), on a
loaded 2-core machine); pass `activation_bits=(32, 16, 8)` (CLI `--activation-bits 32,16,8`)
where memory binds."""
DEFAULT_MICRO_BATCHES = (1, 2, 4, 8, 16)
"""Sequences per device per micro-step that `solve` chooses from by default."""
DEFAULT_DATA_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
"""Shares of the corpus `solve` chooses from by default."""
DEFAULT_POLICIES = ("none", "save_matmuls", "save_attention", "full", MENU)
"""Checkpoint menu: the built-in entries plus each block shape's solved Pareto menu."""
DEFAULT_DATA_METHODS = ("random", "dsir", "loss", "influence")
"""Methods `trainplan.planner.api.solve` considers by default (those without a known multiplier drop out)."""


class Corpus(Protocol):
    """What the planner reads of a corpus: `trainplan.executor.data.batches.TokenCorpus`, which
    `trainplan.load_corpus` returns, has it (the planner does not import the executor:
    docs/architecture.md's import contracts)."""

    name: str
    sha256: str
    vocab_size: int
    train_tokens: Any
    """(n_train_tokens,) integer token ids."""
    heldout_tokens: Any
    """(n_heldout_tokens,) integer token ids."""


@dataclass(frozen=True, kw_only=True)
class SolveOptions:
    """The options of one `trainplan.solve` call. Every field has a default; unknown names are
    refused by `options_from`. Values are checked where they are used (`solve` raises
    `TrainplanError`, `BudgetError` or `DataError` naming the value and what is valid)."""

    # ------------------------------------------------------------------ the run's shape
    seq_len: int = 2048
    """Tokens per sequence (a multiple of every SP degree the solver may pick)."""
    global_batch_tokens: int | None = None
    """Tokens every optimizer step trains, all ranks together (e.g. 4M for an 8B+ model): each plan's
    dp_degree x micro_batch x seq_len x grad_accum equals it, the solver choosing the micro-batch and
    with it the gradient accumulation. None: one micro-step per optimizer step (grad_accum 1)."""
    precision: str | None = None
    """`fp32`, `bf16-mixed` or `bf16`; None: the hardware profile's default."""
    vocab_size: int | None = None
    """Overrides the preset's vocabulary (a run uses its tokenizer's)."""
    lr: float | None = None
    """Peak AdamW learning rate the plan records and its loss prediction assumes. None: the plan's
    default (`trainplan.costmodels.loss.planned.planned_lr` at the plan's compute: DeepSeek LLM's law
    from 1e17 FLOPs up, 3e-3 below); a given rate far from the law's is warned about."""
    seed: int = 0
    """Seed of the solver's search and of the run's data order and initialisation."""

    # ------------------------------------------------------------------ the search space
    micro_batches: tuple[int, ...] = DEFAULT_MICRO_BATCHES
    """Sequences per device per micro-step to choose from."""
    optimizer_bits: tuple[int, ...] | None = None
    """Adam-state widths to choose from (32, 16, 8, 4). None: the precision's two widest that the
    executor runs (`trainplan.costmodels.step.precision.optimizer_bits_for`: 32 and 8, or 16 and 8 for
    bf16); 4 on request."""
    activation_bits: tuple[int, ...] = DEFAULT_ACTIVATION_BITS
    """Saved-activation widths to choose from (32 = as computed, 16, 8;
    `trainplan.modeling.activation_compression`); each one below 32 is captured once more."""
    policies: tuple[str, ...] = DEFAULT_POLICIES
    """Activation checkpoint entries each block may take: `none`, `full`, the built-in selective
    policies (`trainplan.costmodels.checkpoint_sets.BUILTIN`) and `remat` (each block shape's solved
    Pareto menu of saved-op sets, `trainplan.costmodels.checkpoint_sets.MENU`)."""
    data_fractions: tuple[float, ...] = DEFAULT_DATA_FRACTIONS
    """Shares of the corpus's training windows to choose from."""
    loss_chunks: tuple[int, ...] | None = None
    """Sequence chunks of the tiled LM head and loss to choose from (powers of two, 1 = not tiled;
    `trainplan.modeling.tiling`). None: `trainplan.planner.joint.space.default_tiling`."""
    mlp_chunks: tuple[int, ...] | None = None
    """Sequence chunks of the tiled MLP to choose from, as `loss_chunks`."""
    offload: tuple[bool, ...] | None = None
    """Whether checkpointed blocks' inputs may live in host memory (`trainplan.modeling.offload`):
    (False,), (True,) or (False, True). None: the default tiling's choice."""
    data_methods: tuple[str, ...] = DEFAULT_DATA_METHODS
    """Data-subset scoring methods to choose from with the fraction
    (`trainplan.planner.data_choice.choose_data_method`; a method without a known multiplier drops
    out); ("random",) keeps the solver's random subset. A comma-separated string is accepted."""

    # ------------------------------------------------------------------ limits
    data_tokens: int | None = None
    """Unique training tokens in the corpus (None: unconstrained)."""
    memory_limit_bytes: float | None = None
    """Per-device memory cap below the profile's usable bytes."""
    time_limit_s: float = 10.0
    """CP-SAT's limit per solve, in its deterministic seconds (work, not wall time: the same plan under
    any load); a plan found at the limit is FEASIBLE, not OPTIMAL."""

    # ------------------------------------------------------------------ the loss
    law: LossLaw | None = None
    """The loss law to plan with (`trainplan.costmodels.loss.law.LossLaw`). None: the published law
    for the model, carried to the corpus, or the pilots' fit (`calibrate`)."""
    data: Corpus | None = None
    """The corpus the plan will train on (`trainplan.load_corpus`'s `TokenCorpus`). On the local
    `cpu` profile, with `calibrate` and no `law`, pilot runs on it fit the plan's loss law when they
    cost at most 10% of the budget, which they are charged to (`trainplan.planner.pilots`)."""
    calibrate: bool = True
    """Run the pilots when `data` is given (see `data`)."""
    bytes_per_token: float | None = None
    """UTF-8 bytes per token of the corpus (`trainplan.executor.data.text_bytes`): the published
    law is carried to it per byte (`trainplan.costmodels.loss.transfer`). None: the law's own units."""
    data_quality: dict[str, QualityFit] | None = None
    """{method: `trainplan.costmodels.data.quality.QualityFit`} overriding the cached and published
    quality multipliers of the data methods."""

    # ------------------------------------------------------------------ output
    explain: bool = True
    """On an infeasible budget, re-solve to name the smallest change that fits
    (`trainplan.planner.joint.explain`); False raises the solver's own message at once."""
    export_path: str | None = None
    """Write the CP-SAT model to this file (`.pb.txt` text or `.pb` binary) for inspection."""
    cache_dir: str | None = None
    """Cache root for the pilot fits (default: `trainplan.hardware_profiles.cache.cache_root`)."""

    def __post_init__(self) -> None:
        # lists given for the tuple fields (from JSON, or by habit) become tuples: the object is
        # frozen and hashable-by-value in what it records
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, list):
                object.__setattr__(self, f.name, tuple(v))

    def recorded(self) -> dict[str, Any]:
        """The options as JSON values, for `Plan.options`: tuples as lists; `law` as its fields
        (`trainplan.costmodels.loss.cache.law_fields`' keys), `data` as its name, fingerprint and training
        tokens,
        `data_quality` as each fit's fields."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name not in ("law", "data"):
                out[f.name] = _json_value(getattr(self, f.name))
        out["law"] = out["data"] = None
        if self.law is not None:
            from trainplan.costmodels.loss.cache import law_fields  # the cost models, only when a law is given

            out["law"] = law_fields(self.law)
        if self.data is not None:
            d = self.data
            tokens = getattr(d, "train_tokens", None)  # a corpus-like object may carry only what the pilots read
            out["data"] = {"name": getattr(d, "name", type(d).__name__), "sha256": getattr(d, "sha256", None),
                           "n_train_tokens": None if tokens is None else len(tokens)}
        return out


def _json_value(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _json_value(getattr(v, f.name)) for f in fields(v)}
    if isinstance(v, (tuple, list)):
        return [_json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json_value(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return type(v).__name__


OPTION_NAMES = tuple(f.name for f in fields(SolveOptions))
"""The names `solve` takes as keywords."""


def options_from(options: SolveOptions | None = None, overrides: dict[str, Any] | None = None) -> SolveOptions:
    """`options` (default `SolveOptions()`) with `overrides` applied: what `solve(model, hw, budget,
    options, **overrides)` plans with.

    Raises:
        TrainplanError: `options` is not a SolveOptions, or an override names no option (the
            message names the closest option and where all are listed)."""
    if options is None:
        options = SolveOptions()
    elif not isinstance(options, SolveOptions):
        raise TrainplanError(f"options must be a trainplan.SolveOptions, got {type(options).__name__}; "
                             "pass the options as one SolveOptions or as keywords")
    overrides = overrides or {}
    unknown = [k for k in overrides if k not in OPTION_NAMES]
    if unknown:
        close = difflib.get_close_matches(unknown[0], OPTION_NAMES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TrainplanError(f"solve() has no option {unknown[0]!r}: {hint}the options are "
                             f"trainplan.SolveOptions' fields: {', '.join(OPTION_NAMES)}")
    return dataclasses.replace(options, **overrides) if overrides else options
