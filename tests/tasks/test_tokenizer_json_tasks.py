"""Fine-tuning on a ``tokenizer.json`` (a ModernBERT's): GLUE, NER and SQuAD features against
``transformers``' own example preprocessing, then end-to-end runs of a ModernBERT whose only
tokenizer is a byte-level BPE ``tokenizer.json``.

The oracles are written here from reading transformers' example scripts
(``examples/pytorch/text-classification/run_glue.py``'s ``preprocess_function``,
``token-classification/run_ner.py``'s ``tokenize_and_align_labels``,
``question-answering/run_qa.py``'s ``prepare_train_features`` /
``prepare_validation_features`` and ``utils_qa.py``'s post-processing), run with
``PreTrainedTokenizerFast(tokenizer_file=...)``. Two tokenizer.json files: a
byte-level BPE made by ``bertforge data vocab --kind bpe`` (no prefix space: a
word inside text carries its space, "Ġword") and a WordPiece one that
``tokenizers``' ``BertWordPieceTokenizer`` builds from the shared
bert-base-uncased vocab.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_data

from bertforge.cli import main
from bertforge.config import ModelConfig
from bertforge.data.fast_tokenizer import FastTokenizer, task_tokenizer
from bertforge.formats.hf import export_hf
from bertforge.models.bert import BertForQuestionAnswering
from bertforge.tasks.finetune import glue

pytestmark = pytest.mark.shared_data


def hf_tokenizer(path: Path, prefix_space: bool = False):
    """transformers' fast tokenizer of a tokenizer.json, its special tokens named as the file's."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    names = dict(cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]", unk_token="[UNK]")
    if not prefix_space:
        return PreTrainedTokenizerFast(tokenizer_file=str(path), **names)
    # run_ner's add_prefix_space=True for a byte-level BPE (what RobertaTokenizerFast does with it)
    from tokenizers import pre_tokenizers
    backend = Tokenizer.from_file(str(path))
    if isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel):
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **names)


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory) -> Path:
    """A byte-level BPE made by `bertforge data vocab --kind bpe` from the shared sample text and
    MRPC's training sentences."""
    folder = tmp_path_factory.mktemp("bpe")
    text = shared_data("text/sample_text.txt").read_text(encoding="utf-8")
    pairs = glue.read_task(shared_data("glue/MRPC"), "mrpc", "train")
    (folder / "corpus.txt").write_text(text + "\n" + "\n".join(pairs.text_a + pairs.text_b) + "\n", encoding="utf-8")
    out = folder / "tokenizer.json"
    assert main(["data", "vocab", str(folder / "corpus.txt"), str(out), "--kind", "bpe", "--vocab-size", "4000"]) == 0
    return out


@pytest.fixture(scope="module")
def wordpiece_json(tmp_path_factory) -> Path:
    """bert-base-uncased's vocab as a tokenizer.json (tokenizers' BertWordPieceTokenizer)."""
    from tokenizers import BertWordPieceTokenizer

    out = tmp_path_factory.mktemp("wp") / "tokenizer.json"
    BertWordPieceTokenizer(str(shared_data("vocab/bert-base-uncased-vocab.txt")), lowercase=True).save(str(out))
    return out


@pytest.fixture(params=["bpe", "wordpiece"])
def tokenizer_json(request, bpe_json, wordpiece_json) -> Path:
    return bpe_json if request.param == "bpe" else wordpiece_json


# ------------------------------------------------------------------ GLUE


def run_glue_features(tokenizer, examples: glue.GlueExamples, max_length: int) -> dict[str, list[list[int]]]:
    """run_glue's preprocess_function: tokenizer(s1, s2, truncation=True, max_length=...), unpadded."""
    args = (examples.text_a,) if examples.text_b is None else (examples.text_a, examples.text_b)
    return dict(tokenizer(*args, truncation=True, max_length=max_length, return_token_type_ids=True))


def mrpc(split: str, first: int) -> glue.GlueExamples:
    """The first examples of a split of the shared MRPC."""
    x = glue.read_task(shared_data("glue/MRPC"), "mrpc", split)
    return glue.GlueExamples("mrpc", split, x.source, x.ids[:first], x.text_a[:first], (x.text_b or [])[:first],
                             (x.labels or [])[:first], x.lines[:first])


def test_glue_features_equal_run_glues(tokenizer_json):
    """MRPC's dev pairs and the first 400 training pairs (808), and their first sentences alone (as a single-text
    task): our ids, masks and type ids equal run_glue's, id for id, padded with [PAD]; at 24 tokens
    most are cut by tokenizers' longest-first rule; the count of cut ones is the number longer
    than seq_len untruncated."""
    tokenizer = task_tokenizer(tokenizer_json)
    assert isinstance(tokenizer, FastTokenizer)
    theirs = hf_tokenizer(tokenizer_json)
    for seq_len, split in ((128, "train"), (128, "dev"), (24, "train"), (24, "dev")):
        pairs = mrpc(split, 400 if split == "train" else 408)
        singles = glue.GlueExamples("sst-2", split, pairs.source, pairs.ids, pairs.text_a, None, None, pairs.lines)
        for examples in (pairs, singles):
            ours = glue.convert_examples(examples, tokenizer, seq_len, ["0", "1"] if examples.labels else None)
            expected = run_glue_features(theirs, examples, seq_len)
            lengths = ours.input_mask.sum(1)
            assert [row[:n].tolist() for row, n in zip(ours.input_ids, lengths)] == expected["input_ids"]
            assert [row[:n].tolist() for row, n in zip(ours.segment_ids, lengths)] == expected["token_type_ids"]
            assert (ours.input_ids[ours.input_mask == 0] == tokenizer.pad_id).all()
            whole = theirs(*([examples.text_a] if examples.text_b is None else [examples.text_a, examples.text_b]))
            assert ours.truncated == sum(len(ids) > seq_len for ids in whole["input_ids"])
            assert (ours.truncated > len(examples) / 2) == (seq_len == 24)


# ------------------------------------------------------------------ NER


def conll_from_mrpc(path: Path, sentences: int) -> Path:
    """A CoNLL-2003 file (``word POS chunk tag``, blank lines between sentences, -DOCSTART-) of
    MRPC's real sentences; capitalised words after the first are tagged as entities (B-ORG, then
    I-ORG while capitalised), numbers B-MISC."""
    lines = ["-DOCSTART- -X- -X- O", ""]
    for sentence in mrpc("dev", sentences).text_a:
        previous = "O"
        for k, word in enumerate(sentence.split()):
            tag = ("I-ORG" if previous != "O" and previous != "B-MISC" else "B-ORG") if k and word[0].isupper() \
                else "B-MISC" if word[0].isdigit() else "O"
            lines.append(f"{word} NN I-NP {tag}")
            previous = tag
        lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_ner_features(tokenizer, words: list[list[str]], tags: list[list[str]], label_to_id: dict[str, int],
                     max_length: int) -> tuple[list[list[int]], list[list[int]]]:
    """run_ner's tokenize_and_align_labels (label_all_tokens False): ids, and labels on each word's
    first token, -100 elsewhere."""
    tokenized = tokenizer(words, truncation=True, max_length=max_length, is_split_into_words=True)
    all_labels = []
    for i, sentence_tags in enumerate(tags):
        labels, previous = [], None
        for word in tokenized.word_ids(batch_index=i):
            labels.append(-100 if word is None or word == previous else label_to_id[sentence_tags[word]])
            previous = word
        all_labels.append(labels)
    return tokenized["input_ids"], all_labels


def test_ner_features_equal_run_ners(tokenizer_json, tmp_path):
    """A CoNLL file of 408 real sentences (9k words): ids and labels on each word's first token equal
    run_ner's tokenize_and_align_labels, with the add-prefix-space convention it uses for
    RoBERTa-like tokenizers on the byte-level BPE (every word is its "Ġword"), row for row; at a
    sequence of 32 the sentences that do not fit are windowed (every word labelled once) where
    run_ner truncates, and the rows of the others still equal its features."""
    from bertforge.tasks.finetune import ner

    examples = ner.read_conll(conll_from_mrpc(tmp_path / "train.txt", 408))
    labels = ner.label_list(examples)
    tokenizer = task_tokenizer(tokenizer_json)
    theirs = hf_tokenizer(tokenizer_json, prefix_space=True)
    for seq_len in (128, 32):
        ours = ner.convert_examples(examples, tokenizer, seq_len, labels)
        ids, expected = run_ner_features(theirs, examples.words, examples.tags, {t: i for i, t in enumerate(labels)},
                                         seq_len)
        single = [s for s in range(len(examples)) if (ours.sentence_index == s).sum() == 1]
        assert (len(single) == len(examples)) == (seq_len == 128) and len(single) > 80
        rows = {int(s): r for r, s in enumerate(ours.sentence_index)}
        for s in single:
            n = int(ours.input_mask[rows[s]].sum())
            assert ours.input_ids[rows[s], :n].tolist() == ids[s]
            assert ours.labels[rows[s], :n].tolist() == expected[s]
        assert (ours.input_ids[ours.input_mask == 0] == tokenizer.pad_id).all()
        first = (ours.labels != -100).sum()
        assert first == sum(len(w) for w in examples.words)
    if "bpe" in tokenizer_json.parent.name:
        # "Ġword" for every word: each is encoded as it is in running text
        running = tokenizer.tokenizer.encode(" " + " ".join(examples.words[0]), add_special_tokens=False).ids
        assert [i for w in ner.word_pieces(examples, tokenizer)[0][0] for i in w] == running


# ------------------------------------------------------------------ SQuAD


def run_qa_features(tokenizer, examples, max_length: int, stride: int, training: bool) -> list[dict]:
    """run_qa's prepare_train_features / prepare_validation_features (right padding side, no padding):
    per window its ids, and the start/end positions (training) or the offsets of context tokens only."""
    tokenized = tokenizer([x.question.lstrip() for x in examples], [x.context for x in examples],
                          truncation="only_second", max_length=max_length, stride=stride,
                          return_overflowing_tokens=True, return_offsets_mapping=True)
    windows = []
    for i, offsets in enumerate(tokenized["offset_mapping"]):
        ids = tokenized["input_ids"][i]
        sequence_ids = tokenized.sequence_ids(i)
        example = examples[tokenized["overflow_to_sample_mapping"][i]]
        window = {"ids": ids, "example": example.qas_id}
        if not training:
            window["offsets"] = [o if sequence_ids[k] == 1 else None for k, o in enumerate(offsets)]
            windows.append(window)
            continue
        cls_index = ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in ids else 0
        window["start"] = window["end"] = cls_index
        if not example.is_impossible:
            start_char = example.answer_start
            end_char = start_char + len(example.answer_text)
            first = 0
            while sequence_ids[first] != 1:
                first += 1
            last = len(ids) - 1
            while sequence_ids[last] != 1:
                last -= 1
            if offsets[first][0] <= start_char and offsets[last][1] >= end_char:
                while first < len(offsets) and offsets[first][0] <= start_char:
                    first += 1
                while offsets[last][1] >= end_char:
                    last -= 1
                window["start"], window["end"] = first - 1, last + 1
        windows.append(window)
    return windows


def ours_as_windows(features, examples, training: bool) -> list[dict]:
    windows = []
    for row in range(len(features)):
        n = int(features.input_mask[row].sum())
        window = {"ids": features.input_ids[row, :n].tolist(), "example": examples[features.example_index[row]].qas_id}
        if training:
            window["start"], window["end"] = int(features.start_positions[row]), int(features.end_positions[row])
        else:
            window["offsets"] = [tuple(o) if o[0] >= 0 else None for o in features.offsets[row, :n].tolist()]
        windows.append(window)
    return windows


def test_squad_features_equal_run_qas(tokenizer_json):
    """300 training questions (train-v1.1-first44) and 300 dev questions of SQuAD v1.1, windows of
    128 tokens overlapping by 32 (many windows per question): ids, start/end positions from the
    answers' characters and the context tokens' offsets equal run_qa's, window for window; every
    answer inside a window is the context's characters between its tokens' offsets."""
    from bertforge.tasks.squad.data import convert_examples_to_features, read_examples

    tokenizer = task_tokenizer(tokenizer_json)
    theirs = hf_tokenizer(tokenizer_json)
    for name, training in (("train-v1.1-first44.json", True), ("dev-v1.1.json", False)):
        examples = read_examples(shared_data(f"squad/{name}"), is_training=training)[0][:300]
        features = convert_examples_to_features(examples, tokenizer, 128, 32, is_training=training)
        expected = run_qa_features(theirs, examples, 128, 32, training)
        assert len(features) > 2 * len(examples)
        assert ours_as_windows(features, examples, training) == expected
        if training:
            inside = [r for r, w in enumerate(expected) if w["start"] != 0]
            assert len(inside) > 250
            for row in inside:
                example, window = examples[features.example_index[row]], expected[row]
                characters = features.offsets[row, window["start"], 0], features.offsets[row, window["end"], 1]
                span = example.context[characters[0]:characters[1]]
                assert example.answer_text in span and len(span) < len(example.answer_text) + 20


def test_a_question_leaving_no_more_than_the_stride_is_refused_in_one_line(wordpiece_json):
    """run_qa's tokenizer call with a question of 60 tokens, max_length 64 and stride 16: tokenizers
    panics (a Rust panic, not an Exception); ours refuses in one line naming the pair. A question as
    long whose pair fits whole needs no cut and is encoded as transformers encodes it."""
    from bertforge.data.errors import DataError

    tokenizer = task_tokenizer(wordpiece_json)
    assert isinstance(tokenizer, FastTokenizer)
    question, context = " ".join(["the"] * 60), " ".join(["cat"] * 100)
    with pytest.raises(DataError) as refused:
        tokenizer.encode(["a b", question], ["c d", context], max_length=64, strategy="only_second", stride=16)
    assert str(refused.value) == (f"{wordpiece_json}: pair 1: its first text is 60 tokens, which with 3 special "
                                  f"tokens leave 1 of max_length=64 to the second, not more than stride=16 (only the "
                                  f"second is cut): give a larger max_length or a smaller stride")
    (fits,) = tokenizer.encode([question], ["cat"], max_length=64, strategy="only_second", stride=16)
    assert fits.ids == hf_tokenizer(wordpiece_json)(question, "cat")["input_ids"]


def test_a_table_larger_than_the_tokenizer_json_fine_tunes_and_a_smaller_one_is_refused(wordpiece_json, tmp_path):
    """A ModernBERT's embedding table rounded up past its tokenizer (as the published 50,368 rows):
    fine-tuning loads it with the tokenizer.json; a table smaller than the tokenizer is refused."""
    import transformers

    from bertforge.tasks.finetune import FinetuneError
    from bertforge.tasks.finetune.run import load_checked

    tokens = 30522
    for rows in (tokens + 6, tokens - 22):
        config = transformers.ModernBertConfig(vocab_size=rows, hidden_size=32, intermediate_size=48,
                                               num_hidden_layers=1, num_attention_heads=2, pad_token_id=0)
        transformers.ModernBertForMaskedLM(config).save_pretrained(tmp_path / str(rows))
    model = load_checked(tmp_path / str(tokens + 6), wordpiece_json, "classification", 2)
    assert model.config.vocab_size == tokens + 6
    with pytest.raises(FinetuneError, match=f"has {tokens} tokens but the model at .* has vocab_size={tokens - 22}"):
        load_checked(tmp_path / str(tokens - 22), wordpiece_json, "classification", 2)


def utils_qa_predictions(examples, windows: list[dict], start_logits, end_logits, version_2: bool,
                         n_best: int = 20, max_answer_length: int = 30) -> tuple[dict, dict]:
    """utils_qa's postprocess_qa_predictions (null threshold 0): (answers, null score differences)."""
    answers, diffs = {}, {}
    for example in examples:
        rows = [r for r, w in enumerate(windows) if w["example"] == example.qas_id]
        prelim, null = [], None
        for r in rows:
            offsets = windows[r]["offsets"] + [None] * (len(start_logits[r]) - len(windows[r]["offsets"]))
            null_score = start_logits[r][0] + end_logits[r][0]
            if null is None or null["score"] > null_score:
                null = {"offsets": (0, 0), "score": null_score, "start": start_logits[r][0], "end": end_logits[r][0]}
            for s in np.argsort(start_logits[r])[-1:-n_best - 1:-1].tolist():
                for e in np.argsort(end_logits[r])[-1:-n_best - 1:-1].tolist():
                    if offsets[s] is None or offsets[e] is None or e < s or e - s + 1 > max_answer_length:
                        continue
                    prelim.append({"offsets": (offsets[s][0], offsets[e][1]), "start": start_logits[r][s],
                                   "end": end_logits[r][e], "score": start_logits[r][s] + end_logits[r][e]})
        if version_2:
            prelim.append(null)
        predictions = sorted(prelim, key=lambda p: p["score"], reverse=True)[:n_best]
        if version_2 and not any(p is null for p in predictions):
            predictions.append(null)
        for p in predictions:
            p["text"] = example.context[p["offsets"][0]:p["offsets"][1]]
        if not version_2:
            answers[example.qas_id] = predictions[0]["text"] if predictions else "empty"
            continue
        best = next((p for p in predictions if p["text"] != ""), {"text": "empty", "start": 0.0, "end": 0.0})
        diffs[example.qas_id] = null["score"] - best["start"] - best["end"]
        answers[example.qas_id] = "" if diffs[example.qas_id] > 0.0 else best["text"]
    return answers, diffs


def squad_v2_file(path: Path) -> Path:
    """Two real paragraphs of train-v1.1-first44 as SQuAD v2.0: every third question unanswerable."""
    import json

    data = json.loads(shared_data("squad/train-v1.1-first44.json").read_text(encoding="utf-8"))
    paragraphs = data["data"][0]["paragraphs"][:4]
    k = 0
    for paragraph in paragraphs:
        for qa in paragraph["qas"]:
            qa["is_impossible"] = k % 3 == 0
            if qa["is_impossible"]:
                qa["plausible_answers"], qa["answers"] = qa["answers"], []
            k += 1
    path.write_text(json.dumps({"version": "v2.0", "data": [{"title": "t", "paragraphs": paragraphs}]}),
                    encoding="utf-8")
    return path


def test_squad_answers_equal_utils_qas(tokenizer_json, tmp_path):
    """Post-processing through the offsets: with the same random logits, our answers (200 dev
    questions, v1.1) and answers and null odds (a hand-made v2.0 file of 4 real paragraphs, a third
    of its questions unanswerable) equal utils_qa's postprocess_qa_predictions; every answer is an
    exact substring of its context. The v2.0 training windows of unanswerable questions point at
    [CLS], as run_qa's."""
    from bertforge.tasks.squad.data import convert_examples_to_features, read_examples
    from bertforge.tasks.squad.postprocess import postprocess

    tokenizer = task_tokenizer(tokenizer_json)
    theirs = hf_tokenizer(tokenizer_json)
    v2 = squad_v2_file(tmp_path / "v2.json")
    train = read_examples(v2, is_training=True, version_2_with_negative=True)[0]
    features = convert_examples_to_features(train, tokenizer, 96, 32, is_training=True)
    assert ours_as_windows(features, train, True) == run_qa_features(theirs, train, 96, 32, True)
    impossible = [r for r in range(len(features)) if train[features.example_index[r]].is_impossible]
    assert impossible and (features.start_positions[impossible] == 0).all()
    rng = np.random.default_rng(0)
    for path, version_2 in ((shared_data("squad/dev-v1.1.json"), False), (v2, True)):
        examples = read_examples(path, version_2_with_negative=version_2)[0][:200]
        features = convert_examples_to_features(examples, tokenizer, 128, 32)
        start, end = rng.normal(size=(2, *features.input_ids.shape)).astype(np.float32)
        ours = postprocess(examples, features, start, end, version_2_with_negative=version_2)
        windows = run_qa_features(theirs, examples, 128, 32, False)
        answers, diffs = utils_qa_predictions(examples, windows, start.tolist(), end.tolist(), version_2)
        assert ours.predictions == answers
        assert all(a in x.context for x in examples for a in [answers[x.qas_id]] if a != "empty")
        if version_2:
            assert ours.null_odds == pytest.approx(diffs, abs=1e-5) and len(diffs) == len(examples)


# ------------------------------------------------------------------ end to end


RUN_FLAGS = ["--no-progress", "--data.seq_len", "64", "--train.micro_batch_size", "8", "--train.global_batch_size", "8",
             "--train.steps", "3", "--log.tensorboard", "false", "--execution.threads", "1", "--checkpoint.keep", "0"]


def small_mrpc(folder: Path) -> Path:
    """The shared MRPC's header and first rows: 32 training pairs, 24 dev pairs, 8 test pairs."""
    folder.mkdir()
    for split, rows in (("train", 32), ("dev", 24), ("test", 8)):
        lines = shared_data(f"glue/MRPC/{split}.tsv").read_text(encoding="utf-8-sig").splitlines()
        (folder / f"{split}.tsv").write_text("\n".join(lines[:rows + 1]) + "\n", encoding="utf-8")
    return folder


@pytest.mark.slow
def test_a_modernbert_with_only_a_tokenizer_json_fine_tunes(bpe_json, tmp_path, capsys):
    """A transformers ModernBERT directory whose only tokenizer is the BPE tokenizer.json: `finetune glue`
    (MRPC), `finetune ner` (a CoNLL file) and `squad train` (train-v1.1-first44) find it beside the
    model, train 3 steps and keep it in the run (no vocab.txt); `finetune predict` and `squad predict`
    read it from the run and give the run's own dev scores and answers, each an exact substring of
    its context."""
    import json
    import shutil

    import torch
    import transformers
    from test_modernbert import CFG, hf_config

    from bertforge.data.vocab import load_vocab

    init = tmp_path / "init"
    torch.manual_seed(0)
    size = load_vocab(bpe_json).size
    config = hf_config(CFG.__class__(**{**CFG.__dict__, "vocab_size": size, "max_position_embeddings": 128,
                                        "local_attention": 16}))
    transformers.ModernBertForMaskedLM(config).save_pretrained(init)
    shutil.copyfile(bpe_json, init / "tokenizer.json")

    glue_run = tmp_path / "mrpc-run"
    assert main(["finetune", "glue", "--task", "mrpc", "--data", str(small_mrpc(tmp_path / "mrpc")),
                 "--init", str(init), "--out", str(glue_run), *RUN_FLAGS]) == 0
    assert (glue_run / "tokenizer.json").read_bytes() == bpe_json.read_bytes()
    assert not (glue_run / "vocab.txt").exists()
    scores = json.loads((glue_run / "scores.json").read_text())
    capsys.readouterr()
    assert main(["finetune", "predict", "--model", str(glue_run), "--split", "dev"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["accuracy"] == scores["accuracy"]

    conll = tmp_path / "conll"
    conll.mkdir()
    conll_from_mrpc(conll / "train.txt", 40)
    shutil.copyfile(conll / "train.txt", conll / "dev.txt")
    ner_run = tmp_path / "ner-run"
    assert main(["finetune", "ner", "--data", str(conll), "--init", str(init), "--out", str(ner_run), *RUN_FLAGS]) == 0
    ner_scores = json.loads((ner_run / "scores.json").read_text())
    capsys.readouterr()
    assert main(["finetune", "predict", "--model", str(ner_run), "--split", "dev"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["f1"] == ner_scores["f1"]

    dev = squad_v2_file(tmp_path / "dev.json")  # (read as v1.1 for prediction: its answers are not needed)
    squad_run = tmp_path / "squad-run"
    train = shared_data("squad/train-v1.1-first44.json")
    assert main(["squad", "train", "--init", str(init), "--train-file", str(train), "--out", str(squad_run),
                 "--squad.max_questions", "24", "--squad.doc_stride", "16",
                 "--squad.max_query_length", "24", *RUN_FLAGS]) == 0
    assert not (squad_run / "vocab.txt").exists() and (squad_run / "tokenizer.json").is_file()
    assert main(["squad", "predict", "--model", str(squad_run), "--predict-file", str(dev),
                 "--out", str(tmp_path / "predictions.json")]) == 0
    answers = json.loads((tmp_path / "predictions.json").read_text())
    contexts = {qa["id"]: p["context"] for p in json.loads(dev.read_text())["data"][0]["paragraphs"] for qa in p["qas"]}
    assert set(answers) == set(contexts) and all(a in contexts[q] for q, a in answers.items())


def test_another_tokenizer_that_fits_the_rows_is_refused_by_its_fingerprint(tmp_path, capsys):
    """Issues 43.3 and 40.5: a tokenizer.json smaller than the model's table (here the model's own
    tokens less three, in another order: it "fits the rows") is not the model's vocab, which sits
    beside its weights: finetune glue, finetune ner and squad train refuse it in one line, by the
    fingerprints, as pre-training refuses records of another tokenizer. The model's own tokens as a
    tokenizer.json (the same fingerprint) are its vocab."""
    import finetune_data
    import test_squad_cli
    from tokenizers import BertWordPieceTokenizer

    from bertforge.data.vocab import load_vocab

    init = finetune_data.tiny_model(tmp_path / "init")
    qa = tmp_path / "qa"
    qa_model = export_hf(BertForQuestionAnswering(ModelConfig(
        vocab_size=len(test_squad_cli.VOCAB), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=64)), qa, without_tokenizer=True)
    (qa / "vocab.txt").write_text("\n".join(test_squad_cli.VOCAB) + "\n")
    (tmp_path / "dev.json").write_text(json.dumps(test_squad_cli.DEV))

    def tokenizer_json(tokens: list[str], name: str) -> Path:
        (tmp_path / f"{name}.txt").write_text("\n".join(tokens) + "\n")
        out = tmp_path / f"{name}.json"
        BertWordPieceTokenizer(str(tmp_path / f"{name}.txt"), lowercase=True).save(str(out))
        return out

    common = ["--out", str(tmp_path / "out"), "--no-progress", "--data.seq_len", "32", "--train.steps", "1",
              "--train.epochs", "0", "--train.micro_batch_size", "2", "--train.global_batch_size", "2",
              "--log.tensorboard", "false"]
    sst2 = finetune_data.write_sst2(tmp_path / "sst2", train=4, dev=2, test=2)
    jobs = {"glue": (init, ["finetune", "glue", "--task", "sst-2", "--data", str(sst2), "--init", str(init)]),
            "ner": (init, ["finetune", "ner", "--data", str(finetune_data.write_conll(tmp_path / "conll", 4, 2, 2)),
                           "--init", str(init)]),
            "squad": (qa_model, ["squad", "train", "--init", str(qa_model), "--train-file", str(tmp_path / "dev.json"),
                                 "--squad.max_query_length", "8", "--squad.doc_stride", "8"])}
    for job, (model, argv) in jobs.items():
        own = (model / "vocab.txt").read_text().split()
        other = tokenizer_json([*own[:5], *reversed(own[5:-3])], f"{job}-other")
        assert load_vocab(other).size == len(own) - 3
        capsys.readouterr()
        assert main([*argv, "--vocab", str(other), *common]) == 2, job
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and not (tmp_path / "out").exists()
        assert err.startswith(f"error: the model at {model}: made with the tokenizer vocab.txt (wordpiece, "
                              f"{len(own)} tokens, fingerprint {load_vocab(model / 'vocab.txt').fingerprint}), but "
                              f"the vocab {other} is {other.name} (wordpiece, {len(own) - 3} tokens, fingerprint "
                              f"{load_vocab(other).fingerprint}): use the tokenizer the model was trained with"), err
    same = tokenizer_json(own, "same")  # the model's own tokens, as a tokenizer.json: accepted
    assert main([*argv, "--vocab", str(same), *common]) == 0
