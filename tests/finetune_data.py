"""Generated fine-tuning tasks in their official file formats, that a small BERT learns in seconds.

Each writer makes a task directory as GLUE's archives or CoNLL-2003 lay it
out, from plain English words (all in the BERT vocab, so a real pretrained
model can be fine-tuned on them too) chosen by a seeded generator:

* SST-2: a sentence is positive (1) when its adjective is a positive one (optionally, dev and
  test adjectives that training never shows: only pre-training can place them);
* STS-B: two sentences, scored 0-5 by how many of their 5 words they share (the shared
  ones are adjectives, the others not);
* MNLI: the hypothesis is the premise (entailment), its negation (contradiction) or
  another sentence (neutral); dev and test come matched and mismatched;
* NER: people (B-PER I-PER), cities (B-LOC) and companies (B-ORG) among other words.

:func:`tiny_model` writes a small random BERT with a vocab of exactly these words.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from bertforge.config import ModelConfig
from bertforge.formats.hf import export_hf
from bertforge.models.bert import BertForPreTraining

POSITIVE = ["good", "great", "fine", "nice", "happy"]
NEGATIVE = ["bad", "awful", "poor", "sad", "boring"]
# Adjectives only the dev and test sets of write_sst2(unseen=True) use: a model that learned from
# POSITIVE and NEGATIVE alone can place them only by what pre-training taught it.
UNSEEN_POSITIVE = ["excellent", "wonderful", "superb", "brilliant", "lovely"]
UNSEEN_NEGATIVE = ["terrible", "horrible", "dreadful", "dull", "miserable"]
FILLER = ["the", "movie", "was", "a", "film", "it", "is", "very", "quite", "story", "and", "plot", "really"]
FIRST = ["alice", "bob", "carol", "david"]
LAST = ["smith", "jones", "brown"]
CITIES = ["paris", "rome", "oslo", "lima"]
COMPANIES = ["google", "apple", "nokia"]
NLI = ["not", "someone", "somewhere", "sleeps", "runs", "eats"]
WORDS = sorted(set(POSITIVE + NEGATIVE + UNSEEN_POSITIVE + UNSEEN_NEGATIVE + FILLER + FIRST + LAST + CITIES
                   + COMPANIES + NLI + ["in", "for", "works", "lives", "met"]))
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _tsv(path: Path, header: list[str] | None, rows: list[list[str]]) -> None:
    lines = (["\t".join(header)] if header else []) + ["\t".join(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _review(rng: random.Random, unseen: bool = False) -> tuple[str, str]:
    label = rng.randrange(2)
    words = rng.sample(FILLER, 5)
    adjectives = (UNSEEN_POSITIVE if label else UNSEEN_NEGATIVE) if unseen else (POSITIVE if label else NEGATIVE)
    words.insert(rng.randrange(6), rng.choice(adjectives))
    return " ".join(words), str(label)


def write_sst2(root: Path, train: int = 128, dev: int = 64, test: int = 20, seed: int = 0,
               unseen: bool = False) -> Path:
    """GLUE's SST-2/: train.tsv and dev.tsv (header ``sentence label``), test.tsv (``index sentence``).
    With ``unseen`` the dev and test sentences carry adjectives that training never shows."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for name, count in (("train", train), ("dev", dev)):
        _tsv(root / f"{name}.tsv", ["sentence", "label"],
             [list(_review(rng, unseen and name == "dev")) for _ in range(count)])
    _tsv(root / "test.tsv", ["index", "sentence"], [[str(i), _review(rng, unseen)[0]] for i in range(test)])
    return root


def write_stsb(root: Path, train: int = 128, dev: int = 64, test: int = 20, seed: int = 0) -> Path:
    """GLUE's STS-B/: 10 columns (``… sentence1 sentence2 score``); the test set has no score."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    header = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2"]

    def pair(i: int) -> list[str]:
        # The shared words are adjectives, so a small model can score a pair by counting them.
        shared = rng.randint(0, 5)
        adjectives = rng.sample(POSITIVE + NEGATIVE, shared)
        a = adjectives + rng.sample(FILLER, 5 - shared)
        b = adjectives + rng.sample([w for w in FILLER if w not in a], 5 - shared)
        rng.shuffle(a)
        rng.shuffle(b)
        return [str(i), "main-captions", "MSRvid", "2012test", f"{i:04d}", "none", "none", " ".join(a), " ".join(b),
                f"{float(shared):.3f}"]

    for name, count in (("train", train), ("dev", dev)):
        _tsv(root / f"{name}.tsv", header + ["score"], [pair(i) for i in range(count)])
    _tsv(root / "test.tsv", header, [pair(i)[:-1] for i in range(test)])
    return root


def write_mnli(root: Path, train: int = 192, dev: int = 48, test: int = 12, seed: int = 0) -> Path:
    """GLUE's MNLI/: train.tsv (12 columns, ``… sentence1 sentence2 label1 gold_label``),
    dev_matched/dev_mismatched.tsv (16: five annotator labels, then gold_label), test_matched/
    test_mismatched.tsv (10, no labels)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    parses = ["sentence1_binary_parse", "sentence2_binary_parse", "sentence1_parse", "sentence2_parse"]
    head = ["index", "promptID", "pairID", "genre", *parses, "sentence1", "sentence2"]

    def example(i: int) -> tuple[list[str], str]:
        who, does = rng.choice(FIRST), rng.choice(["sleeps", "runs", "eats"])
        premise = f"{who} {does}"
        label = rng.choice(["entailment", "contradiction", "neutral"])
        hypothesis = {"entailment": f"someone {does}", "contradiction": f"{who} not {does}",
                      "neutral": f"{rng.choice(LAST)} {rng.choice(['sleeps', 'runs', 'eats'])} somewhere"}[label]
        parse = "( x )"
        ids = [str(i), str(1000 + i), f"{1000 + i}e", "fiction"]
        return [*ids, parse, parse, parse, parse, premise, hypothesis], label

    rows = []
    for i in range(train):
        columns, label = example(i)
        rows.append([*columns, label, label])
    _tsv(root / "train.tsv", [*head, "label1", "gold_label"], rows)
    for split in ("dev_matched", "dev_mismatched"):
        rows = []
        for i in range(dev):
            columns, label = example(i)
            rows.append([*columns, *[label] * 5, label])
        _tsv(root / f"{split}.tsv", [*head, "label1", "label2", "label3", "label4", "label5", "gold_label"], rows)
    for split in ("test_matched", "test_mismatched"):
        _tsv(root / f"{split}.tsv", head, [example(i)[0] for i in range(test)])
    return root


def _sentence(rng: random.Random) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    for _ in range(rng.randint(2, 4)):
        kind = rng.randrange(4)
        if kind == 0:
            tokens += [(rng.choice(FIRST), "B-PER"), (rng.choice(LAST), "I-PER")]
        elif kind == 1:
            tokens += [(rng.choice(["lives", "works"]), "O"), ("in", "O"), (rng.choice(CITIES), "B-LOC")]
        elif kind == 2:
            tokens += [(rng.choice(["works", "met"]), "O"), ("for", "O"), (rng.choice(COMPANIES), "B-ORG")]
        else:
            tokens += [(w, "O") for w in rng.sample(FILLER, 2)]
    return tokens


def write_conll(root: Path, train: int = 128, dev: int = 48, test: int = 16, seed: int = 0) -> Path:
    """CoNLL-2003 files train.txt, dev.txt and test.txt: ``word POS chunk tag`` lines, blank lines
    between sentences, a ``-DOCSTART-`` line opening each document of 8 sentences."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for name, count in (("train", train), ("dev", dev), ("test", test)):
        lines = []
        for i in range(count):
            if i % 8 == 0:
                lines += ["-DOCSTART- -X- -X- O", ""]
            lines += [f"{word} NN I-NP {tag}" for word, tag in _sentence(rng)] + [""]
        (root / f"{name}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def tiny_model(root: Path, seed: int = 0) -> Path:
    """A random 2-layer BERT (hidden 32) as a Hugging Face directory, with a vocab of :data:`WORDS`."""
    root.mkdir(parents=True, exist_ok=True)
    vocab = root.parent / f"{root.name}-vocab.txt"
    vocab.write_text("\n".join(SPECIAL + WORDS) + "\n", encoding="utf-8")
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    export_hf(BertForPreTraining(cfg), root, vocab_path=vocab, overwrite=True)
    return root
