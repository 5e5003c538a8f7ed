"""``bertforge data pick-eval``: MLPerf BERT's evaluation set.

MLPerf (mlcommons/training, ``language_model/tensorflow/bert``) makes its eval
set in two steps; both are here:

1. ``create_pretraining_data.py`` on the held-out articles (``eval.txt``) with
   ``--max_seq_length=512 --max_predictions_per_seq=76 --masked_lm_prob=0.15
   --dupe_factor=10 --random_seed=12345``: :func:`make_eval` runs
   :func:`.create.create` in reference mode with those settings, so everyone's
   eval records are the same.
2. ``cleanup_scripts/pick_eval_samples.py --num_examples_to_pick=10000``:
   :func:`pick_eval`. It reads all N records in order and keeps, for
   i = 0 … num-1, record ``int(i * (N / num))`` (a float ratio, truncated),
   unchanged: an evenly spaced subset in input order, with no randomness. When
   N < num, records repeat (the ratio is below 1), exactly as MLPerf's script
   does. Its input is one TFRecord; several inputs here are read as their
   concatenation, in the order given, and either record format is accepted.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError
from .record_reader import open_records
from .record_schema import FORMATS
from .record_writer import RecordWriter
from .text import expand_inputs

MLPERF_EVAL = {"seq_len": 512, "max_predictions": 76, "masked_lm_prob": 0.15,
               "short_seq_prob": 0.1, "dupe_factor": 10, "seed": 12345}
_BATCH = 4096  # records gathered and written at a time


@dataclass
class PickStats:
    output: Path
    picked: int
    available: int
    seconds: float

    def summary(self) -> str:
        return (f"picked {self.picked} of {self.available} records in {self.seconds:.2f}s "
                f"→ {self.output}")


def pick_indices(available: int, num: int) -> np.ndarray:
    """MLPerf's choice: ``int(i * (available / num))`` for i in range(num), in float64 as there."""
    ratio = available / num
    return (np.arange(num, dtype=np.float64) * ratio).astype(np.int64)


def pick_eval(inputs: Sequence[str | Path], output: str | Path, num: int = 10_000, *,
              fmt: str = "tfrecord", tokenizer: dict | None = None) -> PickStats:
    """Write the ``num`` records MLPerf's pick_eval_samples.py keeps (see the module docstring).

    A native output's header names ``tokenizer`` (default: the one the first input's names)."""
    start = time.perf_counter()
    if num < 1:
        raise DataError(f"num={num} must be at least 1")
    if fmt not in FORMATS:
        raise DataError(f"format={fmt!r} must be one of {', '.join(FORMATS)}")
    files = [open_records(path) for path in expand_inputs(inputs, patterns=())]
    try:
        first = files[0]
        for other in files[1:]:
            if (other.seq_len, other.max_predictions) != (first.seq_len, first.max_predictions):
                raise DataError(f"{other.path}: seq_len {other.seq_len}, max_predictions "
                                f"{other.max_predictions}; {first.path} has {first.seq_len}, "
                                f"{first.max_predictions}")
        sizes = np.array([len(f) for f in files], np.int64)
        available = int(sizes.sum())
        if available == 0:
            raise DataError(f"{', '.join(str(f.path) for f in files)}: no records to pick from")
        picked = pick_indices(available, num)
        ends = np.cumsum(sizes)
        with RecordWriter(output, fmt, first.seq_len, first.max_predictions,
                          tokenizer=tokenizer or first.header_tokenizer) as writer:
            for begin in range(0, num, _BATCH):
                rows = picked[begin:begin + _BATCH]
                which = np.searchsorted(ends, rows, side="right")  # the file of each row
                # Consecutive rows mostly share a file: take each run of one file at once.
                breaks = np.flatnonzero(np.diff(which)) + 1
                for run in np.split(np.arange(len(rows)), breaks):
                    k = int(which[run[0]])
                    writer.write(files[k].take(rows[run] - (ends[k] - sizes[k])))
    finally:
        for f in files:
            f.close()
    return PickStats(Path(output), num, available, time.perf_counter() - start)


def make_eval(texts: Sequence[str | Path], vocab: str | Path, output: str | Path,
              num: int = 10_000, *, fmt: str = "tfrecord", lowercase: bool = True,
              **overrides) -> PickStats:
    """MLPerf's two steps from held-out text: reference-mode records with MLPerf's eval
    settings (``MLPERF_EVAL``, changed by ``overrides``), then :func:`pick_eval`."""
    from .create import create
    from .vocab import load_vocab

    settings = {**MLPERF_EVAL, **overrides}
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{output.name}.intermediate-",
                                     dir=output.parent) as tmp:
        intermediate = Path(tmp) / "eval_intermediate.tfrecord"
        create(texts, vocab, intermediate, mode="reference", fmt="tfrecord",
               lowercase=lowercase, **settings)
        return pick_eval([intermediate], output, num, fmt=fmt, tokenizer=load_vocab(vocab).identity())


# ---------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``bertforge data pick-eval``."""
    parser.add_argument("inputs", nargs="+", metavar="IN",
                        help="record files (or, with --vocab, held-out text files)")
    parser.add_argument("output", metavar="OUT", help="the eval record file to write")
    parser.add_argument("--num", type=int, default=10_000, help="records to pick (MLPerf: 10000)")
    parser.add_argument("--format", dest="fmt", choices=FORMATS, default="tfrecord")
    parser.add_argument("--vocab", help="IN is text: first make MLPerf's eval records from it "
                                        "(seq 512, 76 predictions, dupe factor 10, seed 12345)")
    parser.add_argument("--seed", type=int, default=MLPERF_EVAL["seed"], help="with --vocab")
    parser.add_argument("--cased", action="store_true", help="with --vocab: do not lower-case")


def run(args: argparse.Namespace) -> int:
    if args.vocab:
        stats = make_eval(args.inputs, args.vocab, args.output, args.num, fmt=args.fmt,
                          lowercase=not args.cased, seed=args.seed)
    else:
        stats = pick_eval(args.inputs, args.output, args.num, fmt=args.fmt)
    print(stats.summary())
    return 0

