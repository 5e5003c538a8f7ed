"""BPE ids of the shared Wikipedia text: FastBPE against tokenizers' own encode_batch, in one run.

    python benchmarks/bpe_tokenize.py                  # a BPE of 32,768 tokens trained on the text itself
    python benchmarks/bpe_tokenize.py --tokenizer tokenizer.json --repeat 5

The text is benchmarks/data_prep.py's crude extraction of the shared dump (2.5
MB, one sentence per line). Without ``--tokenizer`` a byte-level BPE is
trained on it first with ``bertforge data vocab --kind bpe``'s trainer
(ModernBERT's pipeline). Measured, each the best of ``--repeat`` runs in this
process:

* FastBPE cold: a new encoder, its cache empty, over every line;
* FastBPE warm: the same encoder again (what a long corpus sees);
* tokenizers: ``encode_batch_fast`` of every line (special tokens in the text as
  text, as ours), with its thread pool and with TOKENIZERS_PARALLELISM=false in
  a subprocess (one thread, as each ``data create`` worker runs);
* ``data create --mode fast`` (one process, native records, nothing else
  changed) from the BPE and from the uncased BERT vocab.txt: instances/s, on
  the text and on the text 4 times (where most words are met again).

Both encoders' ids are checked equal first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_prep import DUMP, VOCAB, wiki_sample_text  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from bertforge.data.bpe import train_bpe  # noqa: E402
from bertforge.data.create import create  # noqa: E402
from bertforge.data.text import read_documents  # noqa: E402
from bertforge.data.vocab import load_vocab  # noqa: E402


def best(run, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def tokenizers_rate(tokenizer_path: Path, text: Path, repeat: int) -> float:
    """tokens/s of tokenizers alone, measured in this process (its thread pool as configured)."""
    lines = [line for d in read_documents([text]) for line in d]
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.encode_special_tokens = True
    count = sum(len(e.ids) for e in tokenizer.encode_batch_fast(lines, add_special_tokens=False))
    return count / best(lambda: tokenizer.encode_batch_fast(lines, add_special_tokens=False), repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json (default: train one on the text)")
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--single-thread", nargs=2, help=argparse.SUPPRESS)  # (tokenizer, text): the subprocess
    args = parser.parse_args()
    if args.single_thread:
        print(tokenizers_rate(Path(args.single_thread[0]), Path(args.single_thread[1]), args.repeat))
        return
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "wiki.txt"
        text.write_text(wiki_sample_text(DUMP), encoding="utf-8")
        documents = list(read_documents([text]))
        tokenizer = args.tokenizer or train_bpe(documents, args.vocab_size, Path(tmp) / "tokenizer.json")
        vocab = load_vocab(tokenizer)
        lines = [line for d in documents for line in d]
        ids, _ = vocab.encoder().encode_lines(lines)
        theirs = Tokenizer.from_file(str(tokenizer))
        theirs.encode_special_tokens = True
        expected = [i for e in theirs.encode_batch_fast(lines, add_special_tokens=False) for i in e.ids]
        if ids.tolist() != expected:
            raise SystemExit("FastBPE's ids differ from tokenizers'")
        warm = vocab.encoder()
        warm.encode_lines(lines)
        result = {
            "tokens": len(ids), "vocab_size": vocab.size,
            "fastbpe_cold_tokens_per_s": len(ids) / best(lambda: vocab.encoder().encode_lines(lines), args.repeat),
            "fastbpe_warm_tokens_per_s": len(ids) / best(lambda: warm.encode_lines(lines), args.repeat),
            "tokenizers_tokens_per_s": tokenizers_rate(tokenizer, text, args.repeat),
            "tokenizers_one_thread_tokens_per_s": float(subprocess.run(
                [sys.executable, __file__, "--single-thread", str(tokenizer), str(text), "--repeat", str(args.repeat)],
                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, capture_output=True, text=True,
                check=True).stdout),
        }
        four = Path(tmp) / "wiki4.txt"  # the text 4 times: most words are met again, as in a long corpus
        four.write_text("\n\n".join([text.read_text(encoding="utf-8").strip()] * 4) + "\n", encoding="utf-8")
        for name, path in (("bpe", tokenizer), ("wordpiece", VOCAB)):
            for corpus, label in ((text, ""), (four, "_4x")):
                runs = [create([corpus], path, Path(tmp) / f"{name}{label}{k}.bfrec", fmt="native", mode="fast")
                        for k in range(args.repeat)]
                result[f"create_{name}{label}_instances_per_s"] = max(r.instances / r.seconds for r in runs)
        print(json.dumps({k: round(v) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
