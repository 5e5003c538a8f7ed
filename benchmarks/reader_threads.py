"""Batches per second of the record reader with 1, 2, 4 … reader threads (``data.reader_threads``).

    python benchmarks/reader_threads.py                        # 4 TFRecord shards of 4096 records, 1 2 4 threads
    python benchmarks/reader_threads.py --shards 8 --threads 1 2 4 8 16

Random records of BERT's shape (sequence 128, 20 predictions, the 30522-token
uncased vocab's special ids) are written as TFRecord shards into a temporary
directory; then a :class:`~bertforge.data.loader.Prefetcher` with each thread
count hands out ``--batches`` batches of 256, decoded from the TFRecords and
masked anew (``data.dynamic_masking``), as fast as the reader makes them: the
time is the reader's alone (no model step to hide it behind).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from bertforge.data.loader import MaskingSpec, Prefetcher, RecordStream
from bertforge.data.record_writer import write_records
from bertforge.data.rows import PretrainingArrays
from bertforge.data.vocab import Vocabulary

SEQ_LEN, PREDICTIONS, BATCH = 128, 20, 256


def random_records(count: int, seed: int) -> PretrainingArrays:
    """Full-length sequences of random word ids, [CLS] first and [SEP] last, 20 masked positions each."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, 30000, (count, SEQ_LEN)).astype(np.int32)
    ids[:, 0], ids[:, -1] = 101, 102
    positions = np.sort(rng.random((count, SEQ_LEN - 2)).argsort(axis=1)[:, :PREDICTIONS] + 1, axis=1)
    positions = positions.astype(np.int32)
    mask = np.ones((count, SEQ_LEN), np.int8)
    return PretrainingArrays(input_ids=ids, segment_ids=np.zeros_like(mask), input_mask=mask,
                             masked_lm_positions=positions, masked_lm_ids=np.take_along_axis(ids, positions, 1),
                             masked_lm_weights=np.ones((count, PREDICTIONS), np.float32),
                             next_sentence_labels=np.zeros(count, np.int64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--records", type=int, default=4096, help="records per shard")
    parser.add_argument("--batches", type=int, default=30, help="batches timed per thread count")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    rates: dict[str, float] = {}
    vocab = Vocabulary.wordpiece(["[PAD]", *(f"[unused{i}]" for i in range(99)), "[UNK]", "[CLS]", "[SEP]",
                                  "[MASK]", *(f"w{i}" for i in range(30418))])  # bert-base-uncased's ids
    with tempfile.TemporaryDirectory() as root:
        files = [write_records(Path(root) / f"shard{i}.tfrecord", random_records(args.records, i), fmt="tfrecord")
                 for i in range(args.shards)]
        for threads in args.threads:
            reader = Prefetcher(RecordStream(files, BATCH, seed=1, masking=MaskingSpec(vocab), verify=False),
                                depth=8, threads=threads)
            try:
                reader.next()  # the threads are up
                began = time.perf_counter()
                for _ in range(args.batches):
                    reader.next()
                elapsed = time.perf_counter() - began
            finally:
                reader.close()
            rates[f"threads_{threads}"] = round(args.batches / elapsed, 2)
            if not args.json:
                print(f"reader_threads {threads}: {args.batches / elapsed:.1f} batches/s "
                      f"({args.batches * BATCH / elapsed:.0f} sequences/s)", flush=True)
    if args.json:
        print(json.dumps({"batch": BATCH, "shards": args.shards, "batches_per_s": rates}))


if __name__ == "__main__":
    main()
