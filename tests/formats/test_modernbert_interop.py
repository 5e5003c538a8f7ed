"""ModernBERT weights both ways and its fine-tuning heads, with transformers as the oracle.

``bertforge export`` of a ModernBERT writes what ``ModernBertForMaskedLM.from_pretrained`` loads
with no missing or unexpected keys and equal logits; ``bertforge import hf``, ``--init`` and a
Hugging Face id in the local cache read a transformers ModernBERT directory (as transformers 5
writes it: ``layer_types``, ``rope_parameters``) with equal logits; the sequence (pooled by [CLS]
or the mean), token and span heads equal transformers' ModernBertFor{SequenceClassification,
TokenClassification,QuestionAnswering} and export to them; ``bertforge finetune glue`` fine-tunes
a ModernBERT and transformers loads the result. fp32, 1e-5.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import finetune_data
import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the network; set before transformers is imported
transformers = pytest.importorskip("transformers")

from test_modernbert import CFG, hf_config  # noqa: E402

from bertforge.cli import main  # noqa: E402
from bertforge.formats.hf import export_hf  # noqa: E402
from bertforge.formats.load import load_model, load_weights  # noqa: E402
from bertforge.formats.weights import ConversionError, write_model_dir  # noqa: E402
from bertforge.models.families import build_pretraining_model  # noqa: E402

HEADS = {  # our head: transformers' class, the output compared
    "pretraining": ("ModernBertForMaskedLM", lambda out: out.logits),
    "classification": ("ModernBertForSequenceClassification", lambda out: out.logits),
    "token_classification": ("ModernBertForTokenClassification", lambda out: out.logits),
    "qa": ("ModernBertForQuestionAnswering", lambda out: torch.stack([out.start_logits, out.end_logits])),
}


def perturbed(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """``model`` with every weight moved (unit norms and zero biases too), in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of 300, 170 and 40 tokens, right-padded: longer than the window of 128 (local layers matter)."""
    gen = torch.Generator().manual_seed(2)
    ids, mask = torch.zeros(3, 300, dtype=torch.long), torch.zeros(3, 300, dtype=torch.long)
    for row, n in enumerate((300, 170, 40)):
        ids[row, :n], mask[row, :n] = torch.randint(1, CFG.vocab_size, (n,), generator=gen), 1
    return ids, mask


def ours_out(model: torch.nn.Module, head: str, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids, None, mask)
    return out[0] if head == "pretraining" else torch.stack(out) if head == "qa" else out


def theirs_out(model: torch.nn.Module, head: str, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return HEADS[head][1](model(input_ids=ids, attention_mask=mask))


def gap(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor, head: str) -> float:
    """max |ours - theirs| over the real tokens (or rows, for a sequence classifier)."""
    if head != "classification":
        keep = mask.bool()
        ours, theirs = ours[..., keep, :] if head != "qa" else ours[:, keep], \
            theirs[..., keep, :] if head != "qa" else theirs[:, keep]
    return (ours - theirs).abs().max().item()


def from_pretrained(head: str, path: Path) -> torch.nn.Module:
    """transformers' model of ``head`` at ``path``, asserting that it loads every key and no other."""
    model, info = getattr(transformers, HEADS[head][0]).from_pretrained(
        path, output_loading_info=True, attn_implementation="eager")
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A ModernBERT of our own, perturbed, as our model directory (config.yaml, model.safetensors,
    vocab.txt)."""
    root = tmp_path_factory.mktemp("modernbert")
    vocab = root / "vocab.txt"
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab.write_text("".join(f"{token}\n" for token in specials + [f"[tok{i}]" for i in range(5, CFG.vocab_size)]),
                     encoding="utf-8")
    torch.manual_seed(0)
    model = perturbed(build_pretraining_model(CFG, "mlm"))
    write_model_dir(model, CFG, root / "ours", vocab)
    return root / "ours"


def test_export_loads_in_transformers_with_no_missing_keys_and_equal_logits(saved, tmp_path, capsys):
    assert main(["export", str(saved), str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("modernbert", ["ModernBertForMaskedLM"])
    assert (tmp_path / "hf" / "vocab.txt").read_text() == (saved / "vocab.txt").read_text()
    theirs = from_pretrained("pretraining", tmp_path / "hf")
    assert (theirs.config.sliding_window, theirs.config.layer_types) == (
        64, ["full_attention", "sliding_attention", "sliding_attention", "full_attention"])
    ids, mask = batch()
    ours = load_model(saved)
    difference = gap(ours_out(ours, "pretraining", ids, mask), theirs_out(theirs, "pretraining", ids, mask),
                     mask, "pretraining")
    print(f"export, masked LM logits: max |difference| {difference:.2e}")
    assert difference < 1e-5
    # TensorFlow's formats are BERT's: refused in one line.
    capsys.readouterr()
    assert main(["export", str(saved), str(tmp_path / "tf1"), "--format", "tf1"]) == 2
    assert capsys.readouterr().err == ("error: cannot export a model.family=modernbert model as a TF1 checkpoint "
                                       "(BERT's format; it goes to Hugging Face: --format hf)\n")


def test_attention_output_dropout_travels_beside_transformers_one_attention_dropout(tmp_path):
    """transformers has one attention_dropout: an export writes ours (the weights' dropout) there and the
    output-only dropout under its own key, which transformers keeps and an import reads back."""
    cfg = dataclasses.replace(CFG, attention_output_dropout_prob=0.1)
    write_model_dir(build_pretraining_model(cfg, "mlm"), cfg, tmp_path / "ours", None)
    assert main(["export", str(tmp_path / "ours"), str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["attention_dropout"], config["attention_output_dropout_prob"]) == (0.0, 0.1)
    assert from_pretrained("pretraining", tmp_path / "hf").config.attention_dropout == 0.0
    assert main(["import", "hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    assert load_model(tmp_path / "back").config.attention_output_dropout_prob == 0.1


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """transformers' ModernBertForMaskedLM, perturbed, as save_pretrained writes it (transformers 5:
    layer_types and rope_parameters, no global_attn_every_n_layers or *_rope_theta), with a vocab."""
    path = tmp_path_factory.mktemp("hf") / "modernbert"
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, global_rope_theta=80000.0, local_rope_theta=5000.0)
    perturbed(transformers.ModernBertForMaskedLM(hf_config(cfg, attn_implementation="eager"))).save_pretrained(path)
    (path / "vocab.txt").write_text("".join(f"[tok{i}]\n" for i in range(CFG.vocab_size)), encoding="utf-8")
    config = json.loads((path / "config.json").read_text())
    assert "layer_types" in config and "global_rope_theta" not in config  # the layout read here
    return path


def test_import_init_and_a_cached_id_read_a_transformers_directory_with_equal_logits(hf_dir, tmp_path, hf_cache):
    theirs = transformers.ModernBertForMaskedLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    ids, mask = batch()
    expected = theirs_out(theirs, "pretraining", ids, mask)
    assert main(["import", "hf", str(hf_dir), str(tmp_path / "ours")]) == 0
    imported = load_model(tmp_path / "ours")
    cfg = imported.config
    assert (cfg.family, cfg.global_rope_theta, cfg.local_rope_theta, cfg.global_attn_every_n_layers,
            cfg.local_attention, cfg.layer_norm_eps) == ("modernbert", 80000.0, 5000.0, 3, 128, 1e-5)
    assert (tmp_path / "ours" / "vocab.txt").is_file()
    initialised = build_pretraining_model(cfg, "mlm").eval()  # --checkpoint.init: weights into a built model
    assert load_weights(initialised, hf_dir) == []
    hf_cache(hf_dir, "bertforge/tiny-modernbert")
    for name, model in (("import", imported), ("init", initialised),
                        ("cached id", load_model("bertforge/tiny-modernbert"))):
        difference = gap(ours_out(model, "pretraining", ids, mask), expected, mask, "pretraining")
        print(f"{name}, masked LM logits: max |difference| {difference:.2e}")
        assert difference < 1e-5, name


@pytest.mark.parametrize(("key", "value"), [("attention_bias", True), ("mlp_bias", True), ("norm_bias", True),
                                            ("classifier_bias", True), ("decoder_bias", False)])
def test_a_bias_we_do_not_model_is_refused_in_one_line(hf_dir, tmp_path, key, value, capsys):
    copy = tmp_path / "hf"
    shutil.copytree(hf_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, key: value}))
    capsys.readouterr()
    assert main(["import", "hf", str(copy), str(tmp_path / "ours")]) == 2
    assert capsys.readouterr().err == (
        f"error: {copy / 'config.json'}: {key}={json.dumps(value)} is not supported (bertforge's ModernBERT has "
        f"{key}={json.dumps(not value)}, as the published models)\n")
    with pytest.raises(ConversionError, match="embedding_dropout=0.1 and mlp_dropout=0.0 differ"):
        (copy / "config.json").write_text(json.dumps({**config, "embedding_dropout": 0.1}))
        load_model(copy)


@pytest.mark.parametrize(("head", "pooling"), [("classification", "cls"), ("classification", "mean"),
                                               ("token_classification", "cls"), ("qa", "cls")])
def test_task_heads_equal_transformers_and_export_to_them(tmp_path, head, pooling):
    """transformers' head model, saved, loads as ours with equal logits; ours exported loads in
    transformers with every key and equal logits."""
    torch.manual_seed(0)
    theirs = perturbed(getattr(transformers, HEADS[head][0])(
        hf_config(CFG, classifier_pooling=pooling, num_labels=3 if head != "qa" else 2,
                  attn_implementation="eager")))
    theirs.save_pretrained(tmp_path / "theirs")
    ours = load_model(tmp_path / "theirs", head=head)
    assert type(ours).__name__ == HEADS[head][0] and ours.config.classifier_pooling == pooling
    ids, mask = batch()
    expected = theirs_out(theirs, head, ids, mask)
    difference = gap(ours_out(ours, head, ids, mask), expected, mask, head)
    export_hf(ours, tmp_path / "ours", without_tokenizer=True)
    back = from_pretrained(head, tmp_path / "ours")
    exported = gap(theirs_out(back, head, ids, mask), expected, mask, head)
    print(f"{head} ({pooling}): max |difference| {difference:.2e} loaded, {exported:.2e} exported")
    assert difference < 1e-5 and exported < 1e-5


def test_finetune_glue_trains_a_modernbert_that_transformers_loads(tmp_path):
    """``bertforge finetune glue`` from a transformers ModernBERT directory (--init): it trains a few
    steps, and transformers' ModernBertForSequenceClassification loads the run with equal logits."""
    init = tmp_path / "init"
    finetune_data.tiny_model(tmp_path / "bert")  # (for its vocab of the generated words)
    vocab = tmp_path / "bert-vocab.txt"
    size = len(vocab.read_text().splitlines())
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, vocab_size=size, max_position_embeddings=64, local_attention=16)
    transformers.ModernBertForMaskedLM(hf_config(cfg)).save_pretrained(init)
    shutil.copyfile(vocab, init / "vocab.txt")
    finetune_data.write_sst2(tmp_path / "sst-2", train=32, dev=16, test=4)
    out = tmp_path / "run"
    assert main(["finetune", "glue", "--task", "sst-2", "--data", str(tmp_path / "sst-2"), "--init", str(init),
                 "--out", str(out), "--no-progress", "--data.seq_len", "32", "--train.lr", "3e-3",
                 "--train.micro_batch_size", "8", "--train.global_batch_size", "8", "--train.epochs", "1",
                 "--log.every", "1", "--log.tensorboard", "false", "--execution.threads", "1",
                 "--checkpoint.keep", "0"]) == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in line and '"eval"' not in line]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    theirs = from_pretrained("classification", out)
    assert theirs.config.id2label == {0: "0", 1: "1"}
    ours = load_model(out, head="classification")
    ids, mask = batch()
    ids, mask = ids[:, :32] % size, mask[:, :32]
    difference = gap(ours_out(ours, "classification", ids, mask), theirs_out(theirs, "classification", ids, mask),
                     mask, "classification")
    print(f"finetune glue, then transformers: max |difference| {difference:.2e}")
    assert difference < 1e-5


@pytest.mark.parametrize("version", ["1.1", "2.0"])
def test_squad_trains_a_modernbert_that_transformers_loads(tmp_path, version, capsys):
    """``bertforge squad train`` (v1.1, and v2.0 with unanswerable questions) from a transformers
    ModernBERT: it trains and scores, and ModernBertForQuestionAnswering loads the run with equal
    start and end logits."""
    from test_squad_cli import VOCAB
    from test_squad_v2 import TRAIN_QAS

    init = tmp_path / "init"
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, vocab_size=len(VOCAB), max_position_embeddings=64, local_attention=16)
    transformers.ModernBertForMaskedLM(hf_config(cfg)).save_pretrained(init)
    (init / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    qas = [{"id": i, "question": q, "is_impossible": impossible,
            "answers": [] if impossible else [{"text": a, "answer_start": s}]}
           for i, q, a, s, impossible in TRAIN_QAS if version == "2.0" or not impossible]
    data = tmp_path / "squad.json"
    data.write_text(json.dumps({"version": f"v{version}", "data": [
        {"title": "t", "paragraphs": [{"context": "Paris is the capital of France .", "qas": qas}]}]}))
    run = tmp_path / "run"
    assert main(["squad", "train", "--init", str(init), "--train-file", str(data), "--predict-file", str(data),
                 "--out", str(run), "--version", version, "--data.seq_len", "32", "--squad.max_query_length", "8",
                 "--train.global_batch_size", "2", "--train.micro_batch_size", "2", "--train.epochs", "1",
                 "--no-progress", "--log.tensorboard", "false"]) == 0
    scores = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scores["total"] == 4 if version == "2.0" else set(scores) == {"exact_match", "f1"}
    theirs = from_pretrained("qa", run)
    ours = load_model(run, head="qa")
    ids, mask = batch()
    ids, mask = ids[:, :32] % len(VOCAB), mask[:, :32]
    difference = gap(ours_out(ours, "qa", ids, mask), theirs_out(theirs, "qa", ids, mask), mask, "qa")
    print(f"squad v{version}, then transformers: max |difference| {difference:.2e}")
    assert difference < 1e-5
