"""What FlexAttention's block masks skip on packed Wikipedia rows (``execution.attention: flex``).

    python benchmarks/block_masks.py            # the shared Wikipedia sample at 128/20 and 512/76
    python benchmarks/block_masks.py --json

The text of the shared Wikipedia dump becomes records and packed records as
``benchmarks/packing.py`` makes them (``data create --mode fast``, dupe factor
5, seed 12345, uncased vocab; ``data pack --max-sequences-per-pack 3``). For
every packed row, :func:`bertforge.models.bert.document_block_mask` builds the mask
attention runs on, and this reports the share of (query block, key block)
pairs it skips, at FlexAttention's default block of 128 tokens and at 64; and,
for comparison, the share of the (T × T) attention scores that lie outside
every sequence's own square (the most any block size could skip). Nothing
here is timed: only a GPU can say what the skipped blocks save.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from data_prep import DUMP, wiki_sample_text  # noqa: E402
from packing import make_records  # noqa: E402

from bertforge.data.record_reader import open_records  # noqa: E402

ROWS_PER_MASK = 256  # rows per block mask made at once


def skipped(path: Path, block: int) -> dict[str, float]:
    """Shares of blocks and of scores that no query sees, over every row of the packed records."""
    blocks = seen_blocks = scores = seen_scores = 0
    with open_records(path, verify=False) as records:
        for start in range(0, len(records), ROWS_PER_MASK):
            ids = records.take(np.arange(start, min(start + ROWS_PER_MASK, len(records)))).to_torch()["sequence_ids"]
            ids = ids.long()
            rows, T = ids.shape

            def same_sequence(b, h, q, k, ids=ids):
                return ids[b, q] == ids[b, k]

            mask = create_block_mask(same_sequence, rows, None, T, T, device="cpu", BLOCK_SIZE=block)
            dense = mask.to_dense()
            blocks += dense.numel()
            seen_blocks += int(dense.sum())
            counts = torch.stack([torch.bincount(row, minlength=int(ids.max()) + 1) for row in ids])
            scores += rows * T * T
            seen_scores += int((counts.double() ** 2).sum())
    return {"blocks_skipped": round(1 - seen_blocks / blocks, 4),
            "scores_outside_sequences": round(1 - seen_scores / scores, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--max-chars", type=int, default=None, help="stop the text after the article that reaches this")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "wiki.txt"
        text.write_text(wiki_sample_text(DUMP, args.max_chars), encoding="utf-8")
        for seq_len, predictions in ((128, 20), (512, 76)):
            _, packed, stats = make_records(text, Path(tmp), seq_len, predictions, 3)
            result = {"seq_len": seq_len, "packed_rows": stats["packed_rows"],
                      "packing_factor": stats["packing_factor"]}
            for block in (128, 64):
                for key, value in skipped(packed, block).items():
                    result[key if key.startswith("scores") else f"{key}_at_{block}"] = value
            results.append(result)
            if not args.json:
                print(f"seq {seq_len}: {stats['packed_rows']} packed rows, packing factor {stats['packing_factor']}; "
                      f"blocks skipped: {result['blocks_skipped_at_128']:.1%} at 128, "
                      f"{result['blocks_skipped_at_64']:.1%} at 64; scores outside every sequence: "
                      f"{result['scores_outside_sequences']:.1%}")
    if args.json:
        print(json.dumps({"block_masks": results}))


if __name__ == "__main__":
    main()
