"""Bytes per token of a corpus: what a published loss law is carried to another tokenizer by.

`trainplan.costmodels.loss.transfer` compares losses per UTF-8 byte; this measures the local side, the
corpus's bytes per token under its tokenizer, by decoding its training tokens with that
tokenizer (HF `tokenizers`; byte-level BPE decodes to the original text, special tokens such as
`<|endoftext|>` left out).
"""

from __future__ import annotations

import numpy as np

DECODE_CHUNK_TOKENS = 1 << 20
"""Tokens decoded at a time."""
MAX_SAMPLED_TOKENS = 1 << 23
"""At most this many tokens are decoded (an evenly spaced sample of chunks beyond it)."""


def corpus_bytes_per_token(corpus) -> float | None:
    """UTF-8 bytes per training token of `corpus` (an `trainplan.executor.data.batches.TokenCorpus`),
    decoded with its tokenizer; None when it has no tokenizer file (a pre-tokenized corpus
    without `--tokenizer`) or decodes to nothing."""
    path = getattr(corpus, "tokenizer_path", "")
    if not path:
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    ids = np.asarray(corpus.train_tokens)
    starts = list(range(0, len(ids), DECODE_CHUNK_TOKENS))
    if len(ids) > MAX_SAMPLED_TOKENS:
        keep = MAX_SAMPLED_TOKENS // DECODE_CHUNK_TOKENS
        starts = [s for i, s in enumerate(starts) if i % max(1, len(starts) // keep) == 0][:keep]
    n_bytes = n_tokens = 0
    for s in starts:
        chunk = ids[s:s + DECODE_CHUNK_TOKENS].tolist()
        n_bytes += len(tok.decode(chunk, skip_special_tokens=True).encode("utf-8"))
        n_tokens += len(chunk)
    return n_bytes / n_tokens if n_bytes and n_tokens else None
