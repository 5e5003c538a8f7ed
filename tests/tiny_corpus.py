"""A corpus and records that a tiny BERT learns in seconds on a CPU (test_mlperf, test_eval_cmd)."""

from __future__ import annotations

import random
from pathlib import Path

from bertforge.data.create import create

WORDS = [f"w{i}" for i in range(16)]


def write_corpus(root: Path, seq_len: int = 32, max_predictions: int = 4) -> None:
    """``root/{train,eval}.{txt,tfrecord}`` and ``root/vocab.txt``. Each document repeats one
    word, so a masked token is the word of the sentences around it; train and eval documents
    are different draws of the same generator; the vocab is the special tokens and 16 words."""
    rng = random.Random(0)

    def documents(count: int) -> str:
        docs = []
        for _ in range(count):
            word = rng.choice(WORDS)
            docs.append("\n".join(" ".join([word] * rng.randint(3, 6)) for _ in range(rng.randint(8, 16))))
        return "\n\n".join(docs) + "\n"

    (root / "train.txt").write_text(documents(60))
    (root / "eval.txt").write_text(documents(12))
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    for name, dupes in (("train", 3), ("eval", 1)):
        create([root / f"{name}.txt"], root / "vocab.txt", root / f"{name}.tfrecord", seq_len=seq_len,
               max_predictions=max_predictions, dupe_factor=dupes, seed=12345)
