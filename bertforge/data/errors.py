"""The one error type of the data package, and its warnings."""

from __future__ import annotations

import logging
import math
from pathlib import Path

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A user-facing problem with input data (corpus, vocab); the message names the file."""


def warn_one_document(corpus: str, where: str = "") -> None:
    """Warn that next-sentence pairs will take their "random next" sentences from the one document
    there is: half the NSP examples are then not negatives from another document at all."""
    log.warning("%s: only one document%s, so the NSP negatives (\"random next\" sentences) "
                "will come from the same document", corpus, where)


def warn_prediction_cap(seq_len: int, max_predictions: int, masked_lm_prob: float, where: str) -> None:
    """Warn when ``max_predictions`` masks well under ``masked_lm_prob`` of a full row (over a quarter
    fewer predictions), e.g. 30% masking with the 15% recipe's cap: the ratio asked for is not the one trained."""
    wanted = seq_len * masked_lm_prob
    if max_predictions < 0.75 * wanted:
        log.warning("%s: masked_lm_prob=%g asks for %d predictions in a full row of %d tokens, but "
                    "max_predictions=%d caps them (%.1f%% masked): raise max_predictions to %d",
                    where, masked_lm_prob, round(wanted), seq_len, max_predictions,
                    100 * max_predictions / seq_len, math.ceil(wanted))


def warn_no_word_pieces(vocab: str | Path, pieces: str, where: str) -> None:
    """Warn that whole-word masking meets a vocab without pieces that continue a word (``pieces``:
    ``##`` pieces; for byte-level BPE, tokens without the space marker): every word is then one
    token, so masking whole words masks single tokens, as masking without it does."""
    log.warning("%s: %s has no %s (the continuations of a word), so every word is one token and "
                "whole-word masking masks single tokens, as masking without it does", where, vocab, pieces)
