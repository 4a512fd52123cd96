"""Data selection during a run: `DynamicSelector` (re-scores the kept windows every K steps with
the model being trained) and `PlannedBatches` (a plan's data subset for `trainplan.executor.train.run`),
with the held-out target slice (`target_slice`) and the dynamic-selection log
(`SELECTION_FILE`). Scoring, the score cache and `select` are in `trainplan.executor.data.selection`.

In a run (`trainplan.executor.train.run` -> `PlannedBatches`): the plan's `data_method` scores every training
window (static: once before training, keeping exactly `data_fraction` of them; dynamic, when
`selection_every_steps` = K > 0: a seeded random subset first, re-scored every K steps with the
model being trained); influence and DSIR take as target a held-out slice after the run's
evaluation windows (`target_slice`); the scoring FLOPs go into `RunRecord.selection_flops`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from trainplan.errors import TrainplanError
from trainplan.executor.data import scorers
from trainplan.executor.data.batches import TokenBatches
from trainplan.executor.data.corpus import atomic_write
from trainplan.executor.data.dsir import DSIR_BUCKETS, score_dsir
from trainplan.executor.data.scorers import as_numpy_tokens, check_tokens
from trainplan.executor.data.selection import CRITERIA, DEFAULT_RANK, METHODS, apply_criterion, score_windows, select

__all__ = ["DynamicSelector", "PlannedBatches", "SELECTION_FILE", "TARGET_WINDOWS", "target_slice"]


class DynamicSelector:
    """Re-select the kept windows every `rescore_every` steps with the model being trained.

    At step 0 `maybe_rescore` returns the initial subset (`initial_keep`, else a random one from
    `seed`); at every later multiple of `rescore_every` it scores the candidate windows with
    `model` (no cache: the model changes) and returns the new top `round(fraction * n)`; at
    other steps None. Methods: "random" (a fresh random subset, seed + step), "loss" (criterion
    "high" by default: online hard-example selection, Loshchilov and Hutter 2015; "reducible":
    loss minus `irreducible`, RHO-LOSS, Mindermann et al. 2022), "influence" (needs
    `target_tokens`), "dsir" (model-free: scores once, so rescoring changes nothing).
    `flops_spent` accumulates the scoring FLOPs to charge; `history` logs each selection.

    Train-loop use:
        sel = DynamicSelector("loss", 0.5, 200, tokens=data.train_tokens, seq_len=d.seq_len)
        for step in range(start, d.max_steps):
            keep = sel.maybe_rescore(step, model)
            if keep is not None:
                batches = TokenBatches(data.train_tokens, seq_len=..., micro_batch=...,
                                       keep_indices=keep, seed=d.seed, rank=..., world_size=...)
            x, y = batches.batch(step)
    Checkpoint `state_dict()` with the run and `load_state_dict` on resume (then call
    `maybe_rescore(start, model)` or use `keep` directly).
    """

    def __init__(self, method: str, fraction: float, rescore_every: int, *,
                 tokens: torch.Tensor | np.ndarray, seq_len: int,
                 windows: Sequence[int] | np.ndarray | None = None,
                 target_tokens: torch.Tensor | np.ndarray | None = None, seed: int = 0,
                 batch_size: int = 16, criterion: str = "high",
                 irreducible: np.ndarray | None = None, rank: int = DEFAULT_RANK,
                 grad_blocks: int = 1, initial_keep: np.ndarray | None = None,
                 progress: bool = False) -> None:
        if method not in METHODS:
            raise TrainplanError(f"unknown scoring method {method!r}; known: {list(METHODS)}")
        if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
            raise TrainplanError(f"fraction={fraction!r} is invalid; expected 0 < fraction <= 1")
        if isinstance(rescore_every, bool) or not isinstance(rescore_every, int) \
                or rescore_every < 1:
            raise TrainplanError(f"rescore_every={rescore_every!r} must be a whole number >= 1")
        if method == "loss" and criterion not in CRITERIA + ("reducible",):
            raise TrainplanError(f"unknown criterion {criterion!r}; known: "
                                 f"{list(CRITERIA + ('reducible',))}")
        if method in ("influence", "dsir") and target_tokens is None:
            raise TrainplanError(f"dynamic {method!r} needs target_tokens")
        self.tokens = as_numpy_tokens(tokens)
        n_windows = check_tokens(self.tokens, seq_len)
        self.windows = (np.arange(n_windows, dtype=np.int64) if windows is None
                        else np.asarray(windows, dtype=np.int64).ravel())
        if self.windows.size == 0 or self.windows.min() < 0 or self.windows.max() >= n_windows:
            raise TrainplanError(f"windows must be non-empty indices in [0, {n_windows})")
        if criterion == "reducible" and (irreducible is None
                                         or len(irreducible) != len(self.windows)):
            raise TrainplanError("criterion 'reducible' needs `irreducible`: one reference loss "
                                 f"per candidate window ({len(self.windows)})")
        self.method, self.fraction, self.rescore_every = method, float(fraction), rescore_every
        self.seq_len, self.seed, self.batch_size = seq_len, seed, batch_size
        self.criterion = criterion
        self.irreducible = None if irreducible is None else np.asarray(irreducible, np.float64)
        self.target = None if target_tokens is None else as_numpy_tokens(target_tokens)
        self.rank, self.grad_blocks, self.progress = rank, grad_blocks, progress
        self.initial_keep = None if initial_keep is None else np.sort(np.asarray(initial_keep,
                                                                                np.int64))
        self.keep: np.ndarray | None = None
        """The current kept window indices (None before step 0)."""
        self.flops_spent = 0.0
        """Scoring FLOPs spent so far, to charge to the budget."""
        self.history: list[dict] = []
        """One entry per selection: step, kept windows, how many changed, FLOPs."""

    @property
    def n_keep(self) -> int:
        return max(1, round(self.fraction * len(self.windows)))

    def _record(self, step: int, keep: np.ndarray, flops: float) -> np.ndarray:
        changed = (self.n_keep if self.keep is None
                   else int(self.n_keep - np.intersect1d(self.keep, keep).size))
        self.keep = keep
        self.flops_spent += flops
        self.history.append({"step": int(step), "n_kept": int(keep.size), "changed": changed,
                             "flops": float(flops)})
        return keep

    def _score(self, step: int, model: nn.Module) -> tuple[np.ndarray, float]:
        starts = self.windows * self.seq_len
        common: dict[str, Any] = dict(seq_len=self.seq_len, batch_size=self.batch_size, progress=self.progress)
        if self.method == "random":
            return scorers.score_random(self.tokens, starts, seed=self.seed + step)
        if self.method == "dsir":
            return score_dsir(self.tokens, starts, target_tokens=self.target,
                              buckets=DSIR_BUCKETS, **common)
        if self.method == "loss":
            raw, flops = scorers.score_loss(self.tokens, starts, model=model, **common)
            if self.criterion == "reducible":
                return raw - self.irreducible, flops
            return apply_criterion(raw, self.criterion), flops
        return scorers.score_influence(self.tokens, starts, model=model,
                                       target_tokens=self.target, rank=self.rank, seed=self.seed,
                                       grad_blocks=self.grad_blocks, **common)

    def maybe_rescore(self, step: int, model: nn.Module) -> np.ndarray | None:
        """The kept window indices (sorted) when this step selects, else None (keep using the
        previous ones). Step 0 (or the first call) gives the initial subset."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise TrainplanError(f"step={step!r} must be a whole number >= 0")
        first = self.keep is None
        if first and self.initial_keep is not None:
            return self._record(step, self.initial_keep, 0.0)
        if step == 0 or step % self.rescore_every != 0:
            if not first:
                return None
            scores, _ = scorers.score_random(self.tokens, self.windows, seed=self.seed)
            return self._record(step, select(scores, self.fraction, seed=self.seed,
                                             windows=self.windows), 0.0)
        scores, flops = self._score(int(step), model)
        return self._record(step, select(scores, self.fraction, seed=self.seed + int(step),
                                         windows=self.windows), flops)

    def state_dict(self) -> dict:
        """The selector's state for a checkpoint (kept windows, FLOPs spent, history)."""
        return {"keep": None if self.keep is None else self.keep.tolist(),
                "flops_spent": self.flops_spent, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.keep = None if state["keep"] is None else np.asarray(state["keep"], np.int64)
        self.flops_spent = float(state["flops_spent"])
        self.history = list(state["history"])


# ---- a plan's data subset in a run ------------------------------------------------------------

TARGET_WINDOWS = 64
"""Windows of the held-out target slice influence and DSIR select toward in a run (as
`benchmarks/data.py`)."""
SELECTION_FILE = "selection.json"
"""Dynamic selection's log in the run folder: every selection's step, FLOPs and kept windows,
read back on resume."""


def target_slice(heldout_tokens: torch.Tensor | np.ndarray, *, seq_len: int, skip_windows: int,
                 windows: int = TARGET_WINDOWS) -> torch.Tensor | np.ndarray | None:
    """The target set of influence/DSIR in a run: up to `windows` windows of `heldout_tokens`
    starting one window after the first `skip_windows` (the evaluation windows, which end at
    token skip_windows * seq_len), so no target token is an evaluation token. None when fewer
    than seq_len + 1 tokens are left there."""
    start = (skip_windows + 1) * seq_len
    part = heldout_tokens[start:start + windows * seq_len + 1]
    return part if len(part) >= seq_len + 1 else None


class PlannedBatches:
    """The training batches of a plan's data subset, for `trainplan.executor.train.run`.

    `batch(step)` as `TokenBatches.batch`; `update(step)` before each step (dynamic selection
    re-scores there, outside the measured step). Per the plan's decisions:
    - `data_fraction` 1: every window, whatever the method (nothing to select);
    - `random`, static: `TokenBatches(fraction=...)`, a seeded uniform subset (as before);
    - another method, static: `score_windows` over all training windows (cached on disk, so a
      resume or rerun gives the same scores), `select` the top `data_fraction` (exactly
      `max(1, round(f * n))` windows, ties by the seed), `TokenBatches(keep_indices=...)`;
    - `selection_every_steps` K > 0: `DynamicSelector` (one device only), its selections logged
      to `out/selection.json` and restored from there on resume.
    Influence and DSIR select toward `target_slice` of the held-out tokens after the `held`
    evaluation batches. `record.selection_flops` gets the scoring FLOPs (static plus every
    re-score so far; assigned, so a resumed record is not charged twice).

    Raises: TrainplanError on an unknown method, a bad `selection_every_steps`, dynamic
    selection on more than one device, influence/DSIR without a held-out target, or a resume
    of a dynamic run without its selection log.
    """

    def __init__(self, plan, data, *, model: nn.Module, rank: int, held: Sequence, out: Path,
                 start: int, record, progress: bool = False,
                 cache_dir: str | Path | None = None) -> None:
        d = plan.decisions
        method, f = d.data_method, float(d.data_fraction)
        every = getattr(d, "selection_every_steps", 0)
        if method not in METHODS:
            raise TrainplanError(f"plan's data_method={method!r} is not known; known: "
                                 f"{list(METHODS)}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise TrainplanError(f"plan's selection_every_steps={every!r} must be a whole number "
                                 ">= 0 (0: static selection)")
        self.model, self.record, self.path = model, record, Path(out) / SELECTION_FILE
        self._kw = dict(seq_len=d.seq_len, micro_batch=d.micro_batch, seed=d.seed, rank=rank,
                        world_size=d.dp_degree)
        self._tokens = data.train_tokens
        self.selector: DynamicSelector | None = None
        self.static_flops = 0.0
        self.batches: TokenBatches | None = None
        self._entries: list[dict] = []
        if f >= 1.0 or (method == "random" and every == 0):
            self.batches = TokenBatches(data.train_tokens, fraction=min(f, 1.0), **self._kw)
            if f >= 1.0 and (method != "random" or every):
                self._note(f"data selection: fraction 1, every window kept; {method} not scored")
            return
        target = None
        if method in ("influence", "dsir"):
            skip = sum(len(x) for x, _ in held)
            target = target_slice(data.heldout_tokens, seq_len=d.seq_len, skip_windows=skip)
            if target is None:
                raise TrainplanError(
                    f"data_method {method!r} needs a held-out target slice: the corpus's "
                    f"{len(data.heldout_tokens)} held-out tokens leave fewer than seq_len + 1 = "
                    f"{d.seq_len + 1} after the {skip} evaluation windows and a one-window gap; "
                    "use a larger corpus or data_method 'loss' or 'random'")
        show = progress and rank == 0
        if every == 0:
            s = score_windows(data.train_tokens, seq_len=d.seq_len, method=method,
                              target_tokens=target, seed=d.seed, vocab_size=data.vocab_size,
                              cache_dir=cache_dir, progress=show)
            keep = select(s.scores, f, seed=d.seed, windows=s.windows)
            self.batches = TokenBatches(data.train_tokens, keep_indices=keep, **self._kw)
            self.static_flops = s.flops
            self._note(f"data selection: {method} kept {len(keep)} of {len(s.windows)} windows "
                       f"(static; scores {'from the cache' if s.cached else 'computed'}, key "
                       f"{s.key[:12]}); {s.flops:.4g} scoring FLOPs charged")
            return
        if d.devices != 1:
            raise TrainplanError(f"dynamic data selection (selection_every_steps={every}) runs "
                                 f"on one device only; the plan uses {d.devices}: use static "
                                 "selection (selection_every_steps=0)")
        self.selector = DynamicSelector(method, f, every, tokens=data.train_tokens,
                                        seq_len=d.seq_len, target_tokens=target, seed=d.seed,
                                        progress=show)
        if start > 0:
            self._restore(self.selector, start)
        self._note(f"data selection: {method} dynamic, re-scored every {every} steps with the "
                   f"model being trained (log in {self.path.name})")

    def _note(self, text: str) -> None:
        if not any(n.startswith(text.split(" (")[0]) for n in self.record.notes):
            self.record.notes.append(text)
        self._charge()

    def _charge(self) -> None:
        self.record.selection_flops = self.static_flops + (
            self.selector.flops_spent if self.selector is not None else 0.0)

    def _restore(self, selector: DynamicSelector, start: int) -> None:
        """The selections made before step `start` (and at it, if logged), from the log, into
        `selector`."""
        try:
            log = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            raise TrainplanError(f"cannot resume dynamic data selection: {self.path} is missing "
                                 f"or unreadable ({e}); start the run again") from None
        self._entries = [e for e in log["entries"] if e["step"] <= start]
        if not self._entries:
            raise TrainplanError(f"cannot resume dynamic data selection: {self.path} has no "
                                 f"selection at or before step {start}")
        keep = np.asarray(self._entries[-1]["keep"], dtype=np.int64)
        selector.load_state_dict({
            "keep": keep.tolist(), "flops_spent": sum(e["flops"] for e in self._entries),
            "history": [{k: v for k, v in e.items() if k != "keep"} for e in self._entries]})
        self.batches = TokenBatches(self._tokens, keep_indices=keep, **self._kw)

    def update(self, step: int) -> None:
        """Before training step `step`: dynamic selection re-scores when due (and logs it)."""
        sel = self.selector
        if sel is None or (sel.history and sel.history[-1]["step"] >= step):
            return
        keep = sel.maybe_rescore(step, self.model)
        if keep is None:
            return
        self.batches = TokenBatches(self._tokens, keep_indices=keep, **self._kw)
        self._entries.append({**sel.history[-1], "keep": keep.tolist()})
        d = {"method": sel.method, "fraction": sel.fraction, "every": sel.rescore_every,
             "entries": self._entries}
        atomic_write(self.path, lambda fh: fh.write(json.dumps(d).encode()))
        self._charge()

    @property
    def kept_windows(self) -> np.ndarray:
        """The windows the current batches draw from (sorted)."""
        assert self.batches is not None, "no batches before the first selection"
        return self.batches.kept_windows

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step`'s micro-batch (input_ids, labels), each (micro_batch, seq_len) int64, as
        `TokenBatches.batch`; a dynamic selection not yet made is made first (`update`)."""
        if self.batches is None:
            self.update(step)
        assert self.batches is not None  # update made the first selection
        return self.batches.batch(step)
