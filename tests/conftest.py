"""Shared test fixtures: one hermetic trainplan cache per test session, tiny Llama configs.

The `cpu` hardware profile is measured once per session (quick mode, about a second) and saved
into a session temporary cache, so `load("cpu")`, `solve(..., "cpu", ...)` and the corpus
cache never touch the user's cache and never re-measure. `TRAINPLAN_CACHE_DIR` stays set
for the whole session, so subprocesses (`python -m trainplan`, torchrun workers) use the same
cache. The cache file is keyed by host, torch version and the thread count runs use
(`trainplan.hardware_profiles.cpu`, `trainplan.hardware_profiles.threads`): the session sets OMP_NUM_THREADS=1, as
a user would, so the profile is measured at one thread and every run (in this process, a
subprocess or a torchrun worker) trains at one thread, as the benchmarks do: the suite shares
two cores with other work, where multi-threaded steps stall.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from trainplan.hardware_profiles import HardwareProfile

TINY_LLAMA = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
"""A Llama small enough to train a step in milliseconds: 157,952 parameters."""


@pytest.fixture(scope="session", autouse=True)
def trainplan_cache(tmp_path_factory) -> Iterator[Path]:
    """Session cache root with the quick-measured cpu profile saved in it."""
    from trainplan.hardware_profiles import cpu

    root = tmp_path_factory.mktemp("trainplan_cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRAINPLAN_CACHE_DIR", str(root))
    mp.setenv("OMP_NUM_THREADS", "1")
    cpu.save_profile(cpu.measure_cpu(quick=True))
    yield root
    mp.undo()


@pytest.fixture(scope="session")
def cpu_profile(trainplan_cache) -> HardwareProfile:
    """The session's cpu profile (what `load("cpu")` returns in this session)."""
    from trainplan.hardware_profiles import load

    return load("cpu")


@pytest.fixture(scope="session")
def tiny_llama() -> Callable:
    """`tiny_llama(device="cpu", seed=0, **config_overrides)`: a `LlamaForCausalLM` built from
    `TINY_LLAMA` (fp32, SDPA attention, no KV cache)."""
    import torch
    import transformers

    def build(device: str = "cpu", seed: int = 0, **overrides):
        cfg = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides}, use_cache=False)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg)
        return model

    return build


@pytest.fixture(scope="session")
def torch_threads() -> Callable:
    """`with torch_threads(n): ...`: torch's intra-op threads set to `n` inside the block, restored
    after (`trainplan.hardware_profiles.threads.torch_threads`). For real training steps in tests: the suite
    shares two cores with other work, and small multi-threaded GEMMs under contention run up to
    50x slower (spinning OpenMP workers); bytes and FLOPs do not depend on the thread count.
    (`trainplan.executor.train.run` sets its own threads: OMP_NUM_THREADS, 1 in this session, or its
    `threads` argument.)"""
    from trainplan.hardware_profiles.threads import torch_threads as threads

    return threads


@pytest.fixture(scope="session")
def measured_peak() -> Callable:
    """`measured_peak(model, opt, b, s, autocast_dtype=None, activation_bits=32)`: MemTracker's
    peak by category (`trainplan.executor.measure.measure_memory`) over one real training step of
    `model` on random tokens (b sequences of s), after two warm-up steps, as the executor
    measures; the forward under autocast and saved-activation compression when given."""
    import torch

    from trainplan.executor.measure import measure_memory
    from trainplan.modeling.activation_compression import compress_saved_activations
    from trainplan.modeling.loss import lm_loss

    def measure(model, opt, b: int, s: int, autocast_dtype=None, activation_bits: int = 32) -> dict:
        gen = torch.Generator().manual_seed(0)
        amp = torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None)

        def step():
            x = torch.randint(0, model.config.vocab_size, (b, s), generator=gen)
            with amp, compress_saved_activations(activation_bits):
                loss = lm_loss(model(input_ids=x).logits, torch.roll(x, -1, dims=1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        step()
        return measure_memory(step, model, opt)

    return measure


@pytest.fixture(scope="module")
def one_thread(cpu_profile) -> Iterator[None]:
    """One torch thread for a whole module (the cpu profile is loaded before)."""
    from trainplan.hardware_profiles.threads import torch_threads

    with torch_threads(1):
        yield
