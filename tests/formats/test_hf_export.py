"""Exports that transformers uses as they are: ``AutoTokenizer`` and ``pipeline`` on every export.

Each of our heads, BERT (the shared ``vocab.txt``) and ModernBERT (a BPE ``tokenizer.json`` from
``bertforge data vocab --kind bpe``), is exported with ``export_hf``; transformers' ``AutoTokenizer``
must give the ids our own tokenizer gives, and ``pipeline("fill-mask" | "text-classification" |
"token-classification")`` the prediction our model's logits give on those ids (the top token; the
label, named from ``id2label``; the entity of every token). transformers 5.24 has no
question-answering pipeline (removed in 5.0): the QA exports are run through ``AutoTokenizer`` and
``AutoModelForQuestionAnswering``, whose best span must be ours. The CLI and the Python API find
the vocab beside the checkpoint, keep how the run lowercased, and refuse an export with no vocab.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import shared_data

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the network; set before transformers is imported
transformers = pytest.importorskip("transformers")

from bertforge.cli import main  # noqa: E402
from bertforge.config import MODEL_PRESETS, ModelConfig  # noqa: E402
from bertforge.data.bpe import read_tokenizer_json  # noqa: E402
from bertforge.data.tokenizer import load_tokenizer  # noqa: E402
from bertforge.formats.hf import export_hf  # noqa: E402
from bertforge.formats.load import load_model  # noqa: E402
from bertforge.formats.weights import ConversionError, write_model_dir  # noqa: E402
from bertforge.models.families import model_class  # noqa: E402

LABELS = ["O", "B-X", "I-X"]
TEXT = "The man went to the store in Paris today."
QUESTION, CONTEXT = "Where did the man go?", "The man went to the store in Paris today, and he bought bread."


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory) -> dict[str, Path]:
    """Each family's vocab: BERT's uncased vocab.txt, and a BPE tokenizer.json trained by ``data vocab``."""
    bpe = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    assert main(["data", "vocab", str(shared_data("text/sample_text.txt")), str(bpe), "--kind", "bpe",
                 "--vocab-size", "600"]) == 0
    return {"bert": shared_data("vocab/bert-base-uncased-vocab.txt"), "modernbert": bpe}


def tiny(family: str, vocab_size: int) -> ModelConfig:
    preset = "tiny" if family == "bert" else "modernbert-tiny"
    return ModelConfig(**{**MODEL_PRESETS[preset], "vocab_size": vocab_size, "max_position_embeddings": 128})


def random_model(family: str, head: str, vocab_size: int) -> torch.nn.Module:
    cfg = tiny(family, vocab_size)
    cls = model_class(cfg, head)  # type: ignore[arg-type]
    torch.manual_seed(3)
    return (cls(cfg, len(LABELS)) if "classification" in head else cls(cfg)).eval()


def our_ids(family: str, vocab: Path, first: str, second: str | None = None, lowercase: bool = True) -> list[int]:
    """The ids our own tokenizers give, with the [CLS] / [SEP] frame fine-tuning adds."""
    if family == "modernbert":  # its post-processor frames the text
        tokenizer, _ = read_tokenizer_json(vocab)
        tokenizer.encode_special_tokens = False  # a [MASK] written in the text is the mask token
        return tokenizer.encode(first, second).ids
    tokenizer = load_tokenizer(vocab, lowercase)
    cls, sep, mask = (tokenizer.token_to_id(token) for token in ("[CLS]", "[SEP]", "[MASK]"))

    def encode(text: str) -> list[int]:  # a [MASK] written in the text is the mask token (as fill-mask writes it)
        left, *right = text.split("[MASK]", 1)
        ids = tokenizer.encode(left, add_special_tokens=False).ids
        return ids + [mask, *encode(right[0])] if right else ids

    return [cls, *encode(first), sep] + ([*encode(second), sep] if second else [])


def our_logits(model: torch.nn.Module, head: str, ids: list[int], types: list[int] | None = None):
    with torch.no_grad():
        out = model(torch.tensor([ids]), torch.tensor([types or [0] * len(ids)]),
                    torch.ones(1, len(ids), dtype=torch.long))
    return out[0][0] if head == "pretraining" else (out[0][0], out[1][0]) if head == "qa" else out[0]


PIPELINES = {"pretraining": "fill-mask", "classification": "text-classification",
             "token_classification": "token-classification"}


@pytest.mark.parametrize("head", list(PIPELINES))
@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_pipelines_on_an_export_give_our_predictions(vocabs, tmp_path, family, head):
    vocab = vocabs[family]
    hf_vocab = len(load_tokenizer(vocab).get_vocab()) if family == "bert" else 600
    model = random_model(family, head, hf_vocab)
    out = export_hf(model, tmp_path / "hf", vocab_path=vocab, labels=LABELS if "classification" in head else None)
    pipe = transformers.pipeline(PIPELINES[head], model=str(out))
    assert pipe.tokenizer.model_max_length == 128
    text = TEXT.replace("store", pipe.tokenizer.mask_token) if head == "pretraining" else TEXT
    ids = our_ids(family, vocab, text)
    if family == "modernbert" and head == "token_classification":  # as our NER encodes words: "Ġword", the first too
        from bertforge.data.fast_tokenizer import FastTokenizer

        ids = FastTokenizer.load(vocab).words.encode(text).ids
        assert ids[1:] != our_ids(family, vocab, text)[1:]
    assert pipe.tokenizer(text)["input_ids"] == ids  # AutoTokenizer tokenizes as we do
    logits = our_logits(model, head, ids)
    if head == "pretraining":
        mask_at = ids.index(pipe.tokenizer.mask_token_id)
        top = pipe(text)[0]
        assert top["token"] == int(logits[mask_at].argmax())
        assert top["score"] == pytest.approx(float(logits[mask_at].softmax(-1).max()), abs=1e-5)
    elif head == "classification":
        [prediction] = pipe(TEXT)
        assert prediction["label"] == LABELS[int(logits.argmax())]
        assert prediction["score"] == pytest.approx(float(logits.softmax(-1).max()), abs=1e-5)
    else:  # every token of the text (not [CLS] / [SEP]) whose label is not "O", as the pipeline lists them
        ours = [(i, LABELS[int(row.argmax())]) for i, row in enumerate(logits) if 0 < i < len(ids) - 1]
        entities = pipe(TEXT)
        assert [(e["index"], e["entity"]) for e in entities] == [(i, label) for i, label in ours if label != "O"]
        assert len(entities) > 0


TYPED = [["EU", "rejects", "German", "call", "to", "boycott", "British", "lamb", "."],
         ["Peter", "Blackburn", "spoke", "in", "Brussels", "on", "Monday", "."],
         ["The", "man", "went", "to", "the", "store", "in", "Paris", "today", "."],
         ["Japan", "began", "the", "defence", "of", "their", "Asian", "Cup", "title", "."],
         ["Nadim", "Ladki"], ["AL-AIN", ",", "United", "Arab", "Emirates", "1996-12-06"]]


def test_a_ner_export_labels_sentences_as_typed_as_we_do(vocabs, tmp_path):
    """``pipeline("token-classification")`` on a sentence as a user types it (the words joined by
    spaces) gives every word (its first token's entity) the label our NER predicts for it: the export's
    byte-level BPE puts the space before the first word, as our word encoding does (issue 40.8: 27 %
    of first words differed)."""
    from bertforge.data.fast_tokenizer import task_tokenizer
    from bertforge.tasks.finetune import ner

    vocab = vocabs["modernbert"]
    model = random_model("modernbert", "token_classification", 600)
    out = export_hf(model, tmp_path / "hf", vocab_path=vocab, labels=LABELS)
    examples = ner.NerExamples("typed", TYPED, [], [1] * len(TYPED), labelled=False)
    features = ner.convert_examples(examples, task_tokenizer(vocab), 64, LABELS)
    with torch.no_grad():
        logits = model(*(torch.tensor(a, dtype=torch.long) for a in (features.input_ids, features.segment_ids,
                                                                    features.input_mask)))
    ours = ner.word_predictions(features, logits.numpy(), examples, LABELS)
    pipe = transformers.pipeline("token-classification", model=str(out), ignore_labels=[])
    theirs = []
    for words in TYPED:
        entities = pipe(" ".join(words))  # every token, in order, with its characters
        starts = [sum(len(w) + 1 for w in words[:j]) for j in range(len(words))]
        # a word's first token: the first to end past the space before it (a "Ġ" alone, or "Ġword")
        theirs.append([next(e["entity"] for e in entities if e["end"] >= max(start, 1)) for start in starts])
    assert theirs == ours
    assert len({tag for tags in ours for tag in tags}) == len(LABELS)  # the labels vary: the check can fail
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["add_prefix_space"] is True and pipe.tokenizer(" ".join(TYPED[0]))["input_ids"] == [
        int(i) for i in features.input_ids[0][:int(features.input_mask[0].sum())]]


def best_span(start: torch.Tensor, end: torch.Tensor, context: list[bool], longest: int = 15) -> tuple[int, int]:
    """The span of context tokens with the highest start + end logit, at most ``longest`` tokens."""
    best, span = -float("inf"), (0, 0)
    for i in (i for i, inside in enumerate(context) if inside):
        for j in range(i, min(i + longest, len(context))):
            if context[j] and float(start[i] + end[j]) > best:
                best, span = float(start[i] + end[j]), (i, j)
    return span


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_a_qa_export_answers_as_ours_through_auto_classes(vocabs, tmp_path, family):
    vocab = vocabs[family]
    model = random_model(family, "qa", len(load_tokenizer(vocab).get_vocab()) if family == "bert" else 600)
    out = export_hf(model, tmp_path / "hf", vocab_path=vocab)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    theirs_model = transformers.AutoModelForQuestionAnswering.from_pretrained(out).eval()
    encoded = tokenizer(QUESTION, CONTEXT, return_offsets_mapping=True, return_tensors="pt")
    ids = encoded["input_ids"][0].tolist()
    assert ids == our_ids(family, vocab, QUESTION, CONTEXT)
    context = [s == 1 for s in encoded.sequence_ids(0)]
    types = encoded["token_type_ids"][0].tolist() if "token_type_ids" in encoded else None
    start, end = our_logits(model, "qa", ids, types)
    with torch.no_grad():
        theirs = theirs_model(**{k: v for k, v in encoded.items() if k != "offset_mapping"})
    ours_span = best_span(start, end, context)
    assert best_span(theirs.start_logits[0], theirs.end_logits[0], context) == ours_span
    offsets = encoded["offset_mapping"][0]
    answer = CONTEXT[int(offsets[ours_span[0]][0]):int(offsets[ours_span[1]][1])]
    assert answer and answer in CONTEXT


def test_cli_export_finds_the_vocab_and_keeps_the_runs_case(vocabs, tmp_path, capsys):
    """A cased model goes through ``import hf`` and ``bertforge export``: its vocab and
    do_lower_case false come along, so AutoTokenizer keeps the case as the run did."""
    vocab = vocabs["bert"]
    model = random_model("bert", "pretraining", len(load_tokenizer(vocab).get_vocab()))
    export_hf(model, tmp_path / "cased-hf", vocab_path=vocab, lowercase=False)
    assert main(["import", "hf", str(tmp_path / "cased-hf"), str(tmp_path / "ours")]) == 0
    assert main(["export", str(tmp_path / "ours"), str(tmp_path / "out")]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["do_lower_case"] is False
    assert tokenizer(TEXT)["input_ids"] == our_ids("bert", vocab, TEXT, lowercase=False)
    assert tokenizer(TEXT)["input_ids"] != our_ids("bert", vocab, TEXT, lowercase=True)
    assert json.loads((tmp_path / "out" / "special_tokens_map.json").read_text()) == {
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]"}


@pytest.mark.slow  # about 12 s on 2 cores
def test_python_api_finds_the_vocab_beside_the_checkpoint_or_refuses_in_one_line(vocabs, tmp_path, capsys):
    vocab = vocabs["modernbert"]
    model = random_model("modernbert", "pretraining", 600)
    write_model_dir(model, model.config, tmp_path / "ours", vocab)
    export_hf(load_model(tmp_path / "ours"), tmp_path / "out")  # no vocab_path: the one beside config.yaml
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (len(tokenizer), tokenizer.mask_token, tokenizer.pad_token_id) == (600, "[MASK]", 0)
    not_loaded = r"no vocab to export with the model \(the model was not loaded from a checkpoint\)"
    with pytest.raises(ConversionError, match=not_loaded) as refused:
        export_hf(model, tmp_path / "bare")  # built here: no checkpoint, no vocab
    assert "\n" not in str(refused.value) and not (tmp_path / "bare").exists()
    write_model_dir(model, model.config, tmp_path / "no-vocab", None)
    assert main(["export", str(tmp_path / "no-vocab"), str(tmp_path / "cli")]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not (tmp_path / "cli").exists()
    assert main(["export", str(tmp_path / "no-vocab"), str(tmp_path / "cli"), "--vocab", str(vocab)]) == 0
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "cli").mask_token_id == 4


def test_cli_export_refuses_a_vocab_of_another_size_in_one_line(vocabs, tmp_path, capsys):
    """``--vocab`` of another model (here 30522 tokens for a model of 600) would export a tokenizer
    whose ids miss the embeddings: refused before anything is written (issue 33's bad-input review)."""
    model = random_model("bert", "pretraining", 600)
    write_model_dir(model, model.config, tmp_path / "ours", None)
    vocab = vocabs["bert"]
    assert main(["export", str(tmp_path / "ours"), str(tmp_path / "out"), "--vocab", str(vocab)]) == 2
    assert capsys.readouterr().err == (f"error: --vocab {vocab} has 30522 tokens but the model at {tmp_path / 'ours'} "
                                       f"has vocab_size=600: not its vocab\n")
    assert not (tmp_path / "out").exists()


def test_cli_export_takes_the_runs_own_tokenizer_json_and_refuses_another_that_fits(vocabs, tmp_path, capsys):
    """Issue 40.9: a table rounded up past its tokenizer.json (3 rows more), exported with --vocab its own
    tokenizer.json, as fine-tuning accepts it (one rule: data.vocab.check_model_vocab); another tokenizer,
    smaller than the table, is refused by its fingerprint (issue 43.3), nothing written."""
    from bertforge.data.vocab import load_vocab

    own = vocabs["modernbert"]
    rows = load_vocab(own).size + 3
    model = random_model("modernbert", "pretraining", rows)
    write_model_dir(model, model.config, tmp_path / "ours", own)
    assert main(["export", str(tmp_path / "ours"), str(tmp_path / "out"), "--vocab",
                 str(tmp_path / "ours" / "tokenizer.json")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == rows
    other = tmp_path / "other.json"
    assert main(["data", "vocab", str(shared_data("text/sample_text.txt")), str(other), "--kind", "bpe",
                 "--vocab-size", "500"]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ours"), str(tmp_path / "out2"), "--vocab", str(other)]) == 2
    theirs, given = load_vocab(own), load_vocab(other)
    assert capsys.readouterr().err == (
        f"error: the model at {tmp_path / 'ours'}: made with the tokenizer tokenizer.json (bpe, {theirs.size} tokens, "
        f"fingerprint {theirs.fingerprint}), but --vocab {other} is other.json (bpe, {given.size} tokens, fingerprint "
        f"{given.fingerprint}): use the tokenizer the model was trained with\n")
    assert not (tmp_path / "out2").exists()
