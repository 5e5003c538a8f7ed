"""``bertforge data inspect``: what a record file holds, whether it is valid, and a few records as text."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from .errors import DataError
from .packing import PackingStats, unpack_rows
from .record_reader import NativeFile, RecordFile, open_records
from .record_schema import CHUNK_ROWS, detect_format
from .rows import PackedArrays
from .vocab import Vocabulary, load_vocab


def _token(vocab: Vocabulary | None, token_id: int) -> str:
    return str(token_id) if vocab is None else vocab.token(token_id)


def describe(path: str | Path, num: int = 3, vocab_path: str | Path | None = None) -> str:
    """What ``bertforge data inspect`` prints: count, validation, and ``num`` records as text.

    Without a vocab the tokens are shown as ids; a vocab other than the one a
    native file's header names is refused. In each record the masked
    positions are listed as ``position shown→target``; a packed record is shown
    as its sequences. The last line gives the packing factor (real sequences
    per row) and the padding fraction of the whole file.
    """
    return inspect_records(path, num, vocab_path)[0]


def inspect_records(path: str | Path, num: int = 3,
                    vocab_path: str | Path | None = None) -> tuple[str, bool]:
    """(:func:`describe`'s text, whether validation passed).

    A file that cannot be opened at all (not a record file, a damaged native
    header, a TFRecord whose framing is lost) is a DataError; a file that opens
    but has bad records or data (checksums, values, token ids beyond the vocab)
    fails validation: the text says which, and the records that can be read are shown.
    """
    vocab = load_vocab(vocab_path) if vocab_path else None
    vocab_size = vocab.size if vocab else None
    failure = None
    records: RecordFile
    if detect_format(path) == "native":  # open on the header alone, then validate
        records = native_file = NativeFile(Path(path), verify=False)
        problem = native_file.problem(verify=True, vocab_size=vocab_size)
        if problem:
            failure = f"validation: FAILED: {path}: {problem}"
    else:
        records = open_records(path, verify=True, max_bad=sys.maxsize, vocab_size=vocab_size)
        if records.skipped:
            failure = (f"validation: FAILED for {records.skipped} record(s), which a reader skips "
                       f"only with max_bad >= {records.skipped}; first: {records.errors[0]}")
    with records:
        if vocab is not None:
            vocab.check_made(records.header_tokenizer, path, "--vocab")
        slots = records.max_sequences_per_pack
        packed = f", packed: up to {slots} sequences per record" if slots else ""
        lines = [(f"{path}: {records.format}, {len(records)} records, seq_len {records.seq_len}, "
                  f"max_predictions {records.max_predictions}{packed}")]
        made_with = records.header_tokenizer
        if made_with:
            lines.append(f"tokenizer: {made_with['name']} ({made_with['kind']}, {made_with['vocab_size']} tokens, "
                         f"fingerprint {made_with['fingerprint']})")
        checked = ("both checksums and every feature of every record" if records.format == "tfrecord"
                   else "header and data checksums")
        if vocab_size:
            checked += f", token ids below vocab_size {vocab_size}"
        lines.append(failure or f"validation: OK ({checked})")
        for index in range(min(num, len(records))):
            try:
                row = records.take([index])
            except DataError as err:  # a damaged native row: say so, show no more
                lines.append(f"record {index}: {err}")
                break
            sequences = unpack_rows(row) if isinstance(row, PackedArrays) else row
            for k in range(len(sequences)):
                a = sequences.take([k])
                length = int(a.input_mask[0].sum())
                ids = a.input_ids[0, :length].tolist()
                segment_b = int(np.argmax(a.segment_ids[0, :length])) if a.segment_ids[0].any() else length
                label = int(a.next_sentence_labels[0])
                real = a.masked_lm_weights[0] > 0
                which = f", sequence {k + 1} of {len(sequences)}" if slots else ""
                lines.append(f"record {index} (byte offset {records.offset(index)}{which}): next_sentence_label "
                             f"{label} ({'B is a random span' if label else 'B follows A'}), {length} tokens, "
                             f"{int(real.sum())} masked")
                lines.append("  A: " + " ".join(_token(vocab, t) for t in ids[:segment_b]))
                lines.append("  B: " + " ".join(_token(vocab, t) for t in ids[segment_b:]))
                targets = [f"{p} {_token(vocab, ids[p] if p < length else 0)}→{_token(vocab, t)}"
                           for p, t in zip(a.masked_lm_positions[0][real].tolist(),
                                           a.masked_lm_ids[0][real].tolist())]
                lines.append("  masked: " + ", ".join(targets))
        lines.append(_packing_line(records))
    return "\n".join(lines), failure is None


def _packing_line(records: RecordFile) -> str:
    """The packing factor and padding fraction of every record that can be read."""
    stats = PackingStats()
    try:
        for start in range(0, len(records), CHUNK_ROWS):
            stats.add(records.take(np.arange(start, min(start + CHUNK_ROWS, len(records)))))
    except DataError:  # damaged rows (already reported above)
        return "packing: not counted (the file has damaged records)"
    return f"packing: {stats.summary()}"


