"""Carrying a published loss law to another tokenizer and corpus: per byte, not per token.

A law's loss is in nats per token of the tokenizer it was fitted with, and its D counts those
tokens. Two tokenizers of one text cut it into different numbers of tokens; what they share is
the text's bytes. The normalization used here: loss per UTF-8 byte and data in bytes are what
transfer (the convention of Gao et al. 2020, "The Pile" (arXiv:2101.00027), Sec. 4.2, which
reports bits per UTF-8 byte so that models with different tokenizers compare; Rae et al. 2021,
Gopher, reports bits per byte for the same reason). With b_s bytes per token of the law's data
and b_l of the local corpus, r = b_l / b_s:

    L_local(N, D_local) = r L_source(N, r D_local)     (nats per local token; r D_local source tokens
                                                        hold the same bytes as D_local local ones)

For the Chinchilla form E + A / N^alpha + B / D^beta this is again that form with
E' = r E, A' = r A, B' = r^(1 - beta) B (`carry_law`). What it does not carry: the corpus.
A law fitted on web text predicts web text; Shakespeare's entropy per byte is another E. So a
carried law is reported as published-and-carried, never as fitted locally, with its band.

Bytes per token of the published laws' data:
- Hoffmann et al. 2022 / Besiroglu et al. 2024 (MassiveText, the Gopher tokenizer): Rae et al.
  2021 (arXiv:2112.11446), Sec. 2 / App. A: MassiveText holds about 10.5 TB of text, and Gopher's
  300B training tokens are 12.8% of its tokens, so 2.34e12 tokens: 10.5e12 / 2.34e12 = 4.48
  bytes per token (over the whole collection; the sampled mixture may differ somewhat).
- Kaplan et al. 2020 (WebText2, GPT-2 BPE): `trainplan.costmodels.loss.batch.KAPLAN_BYTES_PER_TOKEN`.
"""

from __future__ import annotations

import dataclasses

from trainplan.costmodels.checks import check_positive

#: Rae et al. 2021, Sec. 2 and App. A: 10.5 TB of MassiveText over 300e9 / 0.128 tokens.
MASSIVETEXT_BYTES_PER_TOKEN = 10.5e12 / (300e9 / 0.128)


def byte_ratio(bytes_per_token: float, source_bytes_per_token: float) -> float:
    """r = b_local / b_source: local tokens hold r source tokens' bytes each.

    Raises: TrainplanError on a non-positive or non-finite input."""
    return (check_positive("bytes_per_token", bytes_per_token)
            / check_positive("source_bytes_per_token", source_bytes_per_token))


def carry_law(law, bytes_per_token: float):
    """`law` (a `trainplan.costmodels.loss.law.LossLaw` fitted on data of `law.bytes_per_token`) in nats
    per local token of a corpus with `bytes_per_token`: E' = r E, A' = r A, B' = r^(1 - beta) B,
    r = bytes_per_token / law.bytes_per_token (module docstring); its fitted token range
    becomes local tokens (divided by r). The law's batch constant and
    data-repetition constants carry unchanged (both are ratios or per-byte already; the critical
    batch is carried in `trainplan.costmodels.loss.batch.critical_batch_tokens`).

    Returns: a new LossLaw with `bytes_per_token` set to the local value (r = 1: the same law).
    Raises: TrainplanError on a non-positive `bytes_per_token`.
    """
    r = byte_ratio(bytes_per_token, law.bytes_per_token)
    tokens_range = None if law.tokens_range is None else (law.tokens_range[0] / r, law.tokens_range[1] / r)
    return dataclasses.replace(law, E=r * law.E, A=r * law.A, B=r ** (1.0 - law.beta) * law.B,
                               bytes_per_token=float(bytes_per_token), tokens_range=tokens_range,
                               source=f"{law.source}; carried per byte to {bytes_per_token:.3g} bytes/token "
                                      f"(x{r:.3g})")


def per_byte(loss_nats_per_token: float, bytes_per_token: float) -> float:
    """Loss in nats per byte: the per-token loss divided by the bytes a token holds.

    Raises: TrainplanError on a non-positive input."""
    return check_positive("loss_nats_per_token", loss_nats_per_token) / check_positive(
        "bytes_per_token", bytes_per_token)
