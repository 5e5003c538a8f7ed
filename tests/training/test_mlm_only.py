"""Masked LM alone (train.objective mlm): full-sentence rows, the configurable masking ratio,
BertForMaskedLM against transformers', and a run that learns, resumes and exports."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the network; set before transformers is imported
transformers = pytest.importorskip("transformers")

from test_convert import SMALL, batch, hf_config, randomize_  # noqa: E402
from tiny_corpus import WORDS  # noqa: E402

from bertforge.cli import main  # noqa: E402
from bertforge.config import ModelConfig, load_config  # noqa: E402
from bertforge.data.create import create, generate  # noqa: E402
from bertforge.data.errors import warn_prediction_cap  # noqa: E402
from bertforge.data.instances import create_arrays_mlm, pack_full_sentences  # noqa: E402
from bertforge.data.record_reader import read_records  # noqa: E402
from bertforge.data.vocab import Vocabulary  # noqa: E402
from bertforge.formats.hf import export_hf, load_hf  # noqa: E402
from bertforge.formats.load import load_model, load_weights  # noqa: E402
from bertforge.models.bert import BertForMaskedLM, BertForPreTraining, pretraining_loss  # noqa: E402
from bertforge.training.pretrain import pretrain  # noqa: E402

VOCAB = Vocabulary.wordpiece(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(505))])
SPECIALS = VOCAB.specials  # [CLS] 2, [SEP] 3, [MASK] 4


def flat_corpus(seed: int, documents: int = 30) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random documents of 1..6 sentences of 1..25 tokens (ids 10..509), one of 75, in the flat form."""
    rng = np.random.default_rng(seed)
    sentences_per_doc = rng.integers(1, 7, documents)
    lengths = rng.integers(1, 26, sentences_per_doc.sum())
    lengths[5] = 75  # longer than a row of 32: cut into pieces
    tokens = rng.integers(10, 510, lengths.sum()).astype(np.int32)
    return tokens, np.cumsum([0, *lengths]), np.cumsum([0, *sentences_per_doc])


def test_rows_are_the_corpus_in_order_whole_sentences_and_a_sep_between_documents():
    tokens, sentence_offsets, document_offsets = flat_corpus(0)
    rows = pack_full_sentences(tokens, sentence_offsets, document_offsets, 32, 5, SPECIALS)
    length = rows.input_mask.sum(1)
    assert (length <= 32).all() and (rows.input_ids[:, 0] == SPECIALS.cls).all()
    assert (rows.input_ids[np.arange(len(rows)), length - 1] == SPECIALS.sep).all()
    assert not rows.segment_ids.any() and not rows.next_sentence_labels.any()
    assert not rows.masked_lm_weights.any() and (rows.input_ids[rows.input_mask == 0] == 0).all()
    # Inside the rows: the corpus, token for token, with a [SEP] exactly where a document ends mid-row.
    inner = [rows.input_ids[r, 1:length[r] - 1] for r in range(len(rows))]
    stream = np.concatenate(inner)
    assert np.array_equal(stream[stream != SPECIALS.sep], tokens)
    doc_of_token = np.repeat(np.arange(len(document_offsets) - 1), np.diff(sentence_offsets[document_offsets]))
    position = 0
    for row in inner:
        real = row[row != SPECIALS.sep]
        docs = doc_of_token[position:position + len(real)]
        assert (row == SPECIALS.sep).sum() == len(np.unique(docs)) - 1  # one per document boundary in the row
        position += len(real)
    # Rows end at sentence ends (the 75-token sentence aside, cut into 30 + 30 + 15).
    ends = set(sentence_offsets.tolist())
    cut = {int(sentence_offsets[5]) + 30, int(sentence_offsets[5]) + 60}
    row_ends = np.cumsum([len(row[row != SPECIALS.sep]) for row in inner])
    assert set(row_ends.tolist()) <= ends | cut and cut <= set(row_ends.tolist())
    # Greedy: the next sentence (with its [SEP] when it starts a document) did not fit.
    for r in range(len(inner) - 1):
        end = int(row_ends[r])
        if end in cut or end + 30 in cut:
            continue
        s = int(np.searchsorted(sentence_offsets, end))
        joiner = int(s in set(document_offsets.tolist()))
        assert len(inner[r]) + joiner + min(30, int(sentence_offsets[s + 1] - end)) > 30


@pytest.mark.parametrize("ratio, max_predictions", [(0.15, 20), (0.3, 40)])
def test_masking_ratio_copies_and_80_10_10(ratio, max_predictions):
    tokens, sentence_offsets, document_offsets = flat_corpus(1, documents=400)
    rows = pack_full_sentences(tokens, sentence_offsets, document_offsets, 128, max_predictions, SPECIALS)
    arrays = create_arrays_mlm(tokens, sentence_offsets, document_offsets, seq_len=128,
                               max_predictions=max_predictions, masked_lm_prob=ratio, dupe_factor=3,
                               vocab=VOCAB, rng=np.random.default_rng(7))
    assert len(arrays) == 3 * len(rows)
    count = arrays.masked_lm_weights.sum(1)
    length = arrays.input_mask.sum(1)
    assert np.array_equal(count, np.minimum(max_predictions, np.maximum(1, np.round(length * ratio))))
    assert abs(count.sum() / length.sum() - ratio) < 0.01
    # Unmasked, each row is one of the packed rows, each exactly three times.
    restored = arrays.input_ids.copy()
    for r in range(len(arrays)):
        k = int(count[r])
        restored[r, arrays.masked_lm_positions[r, :k]] = arrays.masked_lm_ids[r, :k]
        assert arrays.input_ids[r, arrays.masked_lm_positions[r, :k]].tolist() != [SPECIALS.cls] * k
    key = {row.tobytes(): i for i, row in enumerate(rows.input_ids)}
    seen = np.bincount([key[row.tobytes()] for row in restored], minlength=len(rows))
    assert (seen == 3).all()
    positions = arrays.masked_lm_positions[arrays.masked_lm_weights > 0]
    originals = np.take_along_axis(restored, arrays.masked_lm_positions, 1)[arrays.masked_lm_weights > 0]
    assert not np.isin(originals, [SPECIALS.cls, SPECIALS.sep]).any() and (positions > 0).all()
    shown = np.take_along_axis(arrays.input_ids, arrays.masked_lm_positions, 1)[arrays.masked_lm_weights > 0]
    n = len(shown)
    assert abs((shown == SPECIALS.mask).sum() / n - 0.8) < 0.02
    kept = (shown == originals).sum() / n  # 10% kept, plus the random ids that drew the original
    assert abs(kept - 0.1) < 0.015


def test_prediction_cap_is_named(caplog):
    with caplog.at_level(logging.WARNING):
        warn_prediction_cap(128, 20, 0.3, "data create")
        warn_prediction_cap(512, 76, 0.15, "data create")  # MLPerf's cap: 76 of 76.8, no warning
    assert [r.getMessage() for r in caplog.records] == [
        "data create: masked_lm_prob=0.3 asks for 38 predictions in a full row of 128 tokens, but "
        "max_predictions=20 caps them (15.6% masked): raise max_predictions to 39"]


def write_text(root: Path) -> Path:
    """Documents that each repeat one word (tiny_corpus's), and its vocab."""
    rng = np.random.default_rng(0)
    docs = ["\n".join(" ".join([WORDS[w]] * int(rng.integers(3, 7))) for _ in range(int(rng.integers(4, 9))))
            for w in rng.integers(0, len(WORDS), 80)]
    (root / "train.txt").write_text("\n\n".join(docs[:64]) + "\n")
    (root / "eval.txt").write_text("\n\n".join(docs[64:]) + "\n")
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return root


def test_data_create_mlm_only(tmp_path, capsys):
    root = write_text(tmp_path)
    out = root / "mlm.tfrecord"
    args = ["data", "create", "--input", str(root / "train.txt"), "--vocab", str(root / "vocab.txt"),
            "--output", str(out), "--seq-len", "32", "--max-predictions", "10", "--masked-lm-prob", "0.3",
            "--dupe-factor", "2", "--mlm-only"]
    assert main(args) == 2  # reference mode has no reference for this
    assert capsys.readouterr().err == ("error: mlm_only: google-research/bert's script makes sentence pairs "
                                       "only, so there is no reference to match: use mode fast\n")
    assert not out.exists()
    assert main([*args, "--mode", "fast"]) == 0
    records = read_records(out)
    expected = next(generate([root / "train.txt"], root / "vocab.txt", seq_len=32, max_predictions=10,
                             masked_lm_prob=0.3, dupe_factor=2, mlm_only=True))
    for field in ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
                  "masked_lm_weights", "next_sentence_labels"):
        assert np.array_equal(getattr(records, field), getattr(expected, field)), field
    assert records.masked_lm_weights.sum(1).tolist() == [min(10, round(0.3 * n)) for n in records.input_mask.sum(1)]
    assert not records.segment_ids.any() and not records.next_sentence_labels.any()
    # Unmasked: every word of the corpus twice, [CLS] … [SEP] rows with a [SEP] between documents.
    ids = records.input_ids.copy()
    real = records.masked_lm_weights > 0
    ids[np.nonzero(real)[0], records.masked_lm_positions[real]] = records.masked_lm_ids[real]
    docs = [[[WORDS.index(w) + 5 for w in line.split()] for line in doc.splitlines()]
            for doc in (root / "train.txt").read_text().strip().split("\n\n")]
    sentences = [s for doc in docs for s in doc]
    rows = pack_full_sentences(np.array([t for s in sentences for t in s], np.int32),
                               np.cumsum([0, *map(len, sentences)]), np.cumsum([0, *map(len, docs)]),
                               32, 10, SPECIALS)
    assert sorted(map(bytes, ids)) == sorted(2 * list(map(bytes, rows.input_ids)))


def test_masked_lm_equals_transformers_and_exports_as_bert_for_masked_lm(tmp_path):
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(hf_config()).eval()
    randomize_(hf, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")  # head "pretraining": no NSP head in the source, so a masked LM
    assert type(ours) is BertForMaskedLM and ours.bert.pooler is None and ours.cls.seq_relationship is None
    ids, types, mask = batch()
    positions = torch.tensor([[1, 4, 7], [2, 3, 9], [5, 6, 0]])
    labels_at = ids.gather(1, positions)
    labels = torch.full_like(ids, -100).scatter(1, positions, labels_at)
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels)
        full, none = ours(ids, types, mask)
        gathered, _ = ours(ids, types, mask, positions)
        out = pretraining_loss(gathered, None, {"masked_lm_ids": labels_at, "next_sentence_labels": torch.zeros(3),
                                                "masked_lm_weights": torch.ones(3, 3)})
    assert none is None
    torch.testing.assert_close(full, ref.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(out["loss"], ref.loss, atol=1e-5, rtol=0)
    assert out["nsp_loss"] == 0 and out["nsp_count"] == 3 and out["loss"] == out["mlm_loss"]
    export_hf(ours, tmp_path / "back", without_tokenizer=True)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"]
    back, info = transformers.BertForMaskedLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info.values())  # no missing, unexpected or mismatched weight
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(input_ids=ids, token_type_ids=types, attention_mask=mask).logits,
                                   ref.logits, atol=1e-5, rtol=0)


def test_masked_lm_starts_from_a_bert_with_nsp_and_has_fewer_parameters(tmp_path):
    cfg = ModelConfig(**SMALL)
    full, masked = BertForPreTraining(cfg), BertForMaskedLM(cfg)
    extra = {k for k in full.state_dict()} - {k for k in masked.state_dict()}
    assert extra == {"bert.pooler.dense.weight", "bert.pooler.dense.bias",
                     "cls.seq_relationship.weight", "cls.seq_relationship.bias"}
    # --init from a BERT with the NSP head: its encoder and masked-LM head, the rest left behind.
    randomize_(full, seed=5)
    export_hf(full, tmp_path / "bert", without_tokenizer=True)
    assert load_weights(masked, tmp_path / "bert") == []
    theirs = full.state_dict()
    assert all(torch.equal(value, theirs[name]) for name, value in masked.state_dict().items())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = write_text(tmp_path_factory.mktemp("mlm"))
    for name, dupes in (("train", 4), ("eval", 1)):
        create([root / f"{name}.txt"], root / "vocab.txt", root / f"{name}.tfrecord", seq_len=32,
               max_predictions=10, masked_lm_prob=0.3, dupe_factor=dupes, mode="fast", mlm_only=True)
    pairs = {
        "train.objective": "mlm", "data.input": str(root / "train.tfrecord"),
        "data.eval_input": str(root / "eval.tfrecord"), "data.vocab": str(root / "vocab.txt"),
        "data.masked_lm_prob": 0.3, "data.dynamic_masking": True, "data.seq_len": 32, "data.max_predictions": 10,
        "model.hidden_size": 64, "model.intermediate_size": 256, "model.max_position_embeddings": 64,
        "train.global_batch_size": 16, "train.micro_batch_size": 16, "train.steps": 120, "train.lr": 0.01,
        "train.optimizer": "adamw", "train.warmup_steps": 10, "train.eval_every": 60, "checkpoint.every": 60,
        "execution.threads": 1, "log.progress": False, "log.tensorboard": False,
        "log.run_dir": str(root / "runs"), "log.name": "run",
    }
    summary = pretrain(load_config("pretrain_tiny", list(pairs.items())))
    return root, pairs, summary


def test_mlm_only_run_learns_without_nsp(run):
    root, _, summary = run
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("split") != "eval" and "loss" in r]
    evals = [r for r in rows if r.get("split") == "eval"]
    assert train and all(r["loss"] == r["mlm_loss"] and "nsp_loss" not in r for r in train)
    assert [r["step"] for r in evals] == [0, 60, 120] and all("nsp_accuracy" not in r for r in evals)
    assert evals[0]["mlm_accuracy"] < 0.2 and evals[-1]["mlm_accuracy"] > 0.6
    model = load_model(run_dir)
    assert type(model) is BertForMaskedLM
    assert not any(k.startswith(("cls.seq_relationship", "bert.pooler")) for k in model.state_dict())


def test_mlm_only_run_resumes_exactly(run, tmp_path):
    root, pairs, summary = run
    run_dir = Path(summary["run_dir"])
    shutil.copytree(run_dir, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_00000120")
    resumed = pretrain(load_config("pretrain_tiny",
                                   list({**pairs, "checkpoint.resume": str(tmp_path / "run")}.items())))
    assert resumed["run_dir"] == str(tmp_path / "run")
    rows = [(tmp_path / "run" if i else run_dir) / "metrics.jsonl" for i in range(2)]
    losses = [[json.loads(line).get("loss") for line in p.read_text().splitlines()] for p in rows]
    assert losses[0] == losses[1]
    a = load_model(run_dir).state_dict()
    b = load_model(tmp_path / "run").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_command_on_a_masked_lm(run, capsys):
    root, _, summary = run
    assert main(["eval", summary["run_dir"], "--data.eval_input", str(root / "eval.tfrecord"),
                 "--execution.threads", "1"]) == 0
    line = capsys.readouterr().out.strip()
    assert "masked-LM accuracy" in line and "NSP" not in line


def test_training_steps_equal_transformers_trainer(tmp_path):
    """Our engine (AdamW, weight decay off biases and LayerNorms, clipping at 1, the poly schedule) and
    transformers' Trainer (as run_mlm.py trains, with our schedule as its LambdaLR) take four steps of
    the same masked batches from the same weights, without dropout: the same losses and weights.
    (benchmarks/mlm_vs_transformers.py compares whole curves, with each side's own masking and dropout.)"""
    pytest.importorskip("accelerate")
    from torch.utils.data import SequentialSampler

    from bertforge.config import TrainConfig
    from bertforge.training.engine import Engine
    from bertforge.training.optim import build_optimizer, build_scheduler, lr_at
    from bertforge.training.pretrain import training_loss

    cfg = ModelConfig(**{**SMALL, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
    torch.manual_seed(0)
    ours = BertForMaskedLM(cfg)
    export_hf(ours, tmp_path / "init", without_tokenizer=True)
    steps, rows, length, predictions = 4, 3, 24, 4
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(5, cfg.vocab_size, (steps * rows, length), generator=gen)
    ids[:, 0], ids[:, -1] = 2, 3
    positions = torch.stack([torch.randperm(length - 2, generator=gen)[:predictions] + 1
                             for _ in range(len(ids))]).sort(1).values
    shown = ids.scatter(1, positions, 4)
    labels = torch.full_like(ids, -100).scatter(1, positions, ids.gather(1, positions))
    train = TrainConfig(optimizer="adamw", lr=1e-3, weight_decay=0.01, eps=1e-6, grad_clip=1.0, schedule="poly",
                        warmup_steps=2, steps=steps)

    optimizer = build_optimizer(ours, train)
    engine = Engine(ours.train(), optimizer, build_scheduler(optimizer, train, steps), training_loss, "fp32", 1.0)
    our_losses = []
    for step in range(steps):
        part = slice(step * rows, (step + 1) * rows)
        batch = {"input_ids": shown[part], "token_type_ids": torch.zeros_like(shown[part]),
                 "masked_lm_positions": positions[part], "masked_lm_ids": ids[part].gather(1, positions[part]),
                 "masked_lm_weights": torch.ones(rows, predictions), "next_sentence_labels": torch.zeros(rows)}
        our_losses.append(engine.step([batch], 1, step)["loss"].item())

    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(self.train_dataset)

        def create_scheduler(self, num_training_steps, optimizer=None):
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer if optimizer is not None else self.optimizer, lambda k: lr_at(k, train, steps) / train.lr)
            return self.lr_scheduler

    their_losses: dict[int, float] = {}

    class Record(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                their_losses[state.global_step] = logs["loss"]

    hf = transformers.BertForMaskedLM.from_pretrained(tmp_path / "init")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=steps, per_device_train_batch_size=rows, learning_rate=train.lr,
        weight_decay=0.01, adam_epsilon=1e-6, max_grad_norm=1.0, optim="adamw_torch", logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    examples = [{"input_ids": shown[i], "labels": labels[i]} for i in range(len(ids))]
    InOrder(model=hf, args=args, train_dataset=examples, callbacks=[Record()]).train()
    assert list(their_losses) == [1, 2, 3, 4]
    np.testing.assert_allclose(our_losses, list(their_losses.values()), rtol=1e-4)  # transformers logs 4 digits
    theirs = hf.state_dict()
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(value, theirs[name], atol=1e-7, rtol=0, msg=name)  # measured: 7.5e-9
