"""The one error type of the data package, and its one warning."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A user-facing problem with input data (corpus, vocab); the message names the file."""


def warn_one_document(corpus: str, where: str = "") -> None:
    """Warn that next-sentence pairs will take their "random next" sentences from the one document
    there is: half the NSP examples are then not negatives from another document at all."""
    log.warning("%s: only one document%s, so the NSP negatives (\"random next\" sentences) "
                "will come from the same document", corpus, where)
