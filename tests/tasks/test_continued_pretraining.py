"""Continued pre-training of a published ModernBERT, end to end (docs/modernbert.md's toy recipe, run
as written): a ``transformers`` ModernBERT directory with a BPE ``tokenizer.json`` → ``data create``
with that tokenizer → ``pretrain --checkpoint.init`` (the published weights, its ids, ``wsd`` from
the stable rate) → ``export`` → GLUE / NER / SQuAD from the run with the same tokenizer.

The oracle for "the weights really came in" is ``transformers``' own loss of the published model
on the run's first batch. The docs' ``bertforge`` lines run through :func:`bertforge.cli.main`; its
other lines (a link) with bash; its python block in this process.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import DATA, REPO, shared_data

from bertforge.cli import main

pytestmark = pytest.mark.shared_data

SECTION = "## Continued pre-training of a published ModernBERT"


def toy_blocks() -> list[tuple[str, str]]:
    """(language, text) of the section's ``<!-- run: cpu -->`` blocks, in order."""
    page = (REPO / "docs" / "modernbert.md").read_text(encoding="utf-8")
    section = page[page.index(SECTION):]
    section = section[:section.index("\n## ", len(SECTION))]
    return re.findall(r"<!-- run: cpu -->\n```(\w+)\n(.*?)\n```", section, flags=re.S)


def run_block(language: str, text: str) -> None:
    if language == "python":
        exec(compile(text, "docs/modernbert.md", "exec"), {"__name__": "__doc_block__"})  # noqa: S102
        return
    for line in re.sub(r"\\\n\s*", "", text).splitlines():
        if line.startswith("bertforge "):
            assert main(shlex.split(os.path.expandvars(line))[1:]) == 0, line
        else:
            subprocess.run(["bash", "-c", line], check=True)


def first_batch_loss_of_transformers(published: Path, records: Path, seed: int, shuffle_buffer: int) -> float:
    """transformers' ModernBertForMaskedLM loss of the published weights on the run's first batch (read
    by the run's reader, as the run read it): labels at the masked positions, -100 elsewhere."""
    import torch
    import transformers

    from bertforge.data.loader import RecordStream

    stream = RecordStream([records], 8, seed, shuffle_buffer=shuffle_buffer)
    batch = stream.next()
    stream.close()
    ids = batch["input_ids"].long()
    labels = torch.full_like(ids, -100)
    for row in range(labels.shape[0]):
        real = batch["masked_lm_weights"][row] > 0
        labels[row, batch["masked_lm_positions"][row][real]] = batch["masked_lm_ids"][row][real].long()
    mask = batch.get("attention_mask", torch.ones_like(ids)).long()  # (none: no padding)
    model = transformers.ModernBertForMaskedLM.from_pretrained(published, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()


@pytest.mark.slow
def test_continued_pretraining_of_a_published_modernbert_runs_as_documented(tmp_path, monkeypatch, capsys):
    """The docs' toy blocks, as written, from an empty directory: the run's model is the published
    one (its config, its table larger than the tokenizer, the tokenizer's ids); its first step's
    loss equals transformers' loss of the published weights on the same batch (1e-5); wsd with
    warmup_steps 0 trains at the full rate from step 1 and decays over the last 4 of 8 steps as
    lr_at gives; the export loads in AutoTokenizer (the same ids), AutoModelForMaskedLM (the run's
    weights) and pipeline("fill-mask"); GLUE, NER and SQuAD fine-tune from the run with its tokenizer.json; and a
    tokenizer larger than the published table is refused in one line."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from bertforge.config import TrainConfig
    from bertforge.formats.weights import load_safetensors
    from bertforge.training.optim import lr_at

    shared_data("squad/train-v1.1-first44.json")  # (skips without the shared data)
    monkeypatch.setenv("BERTFORGE_TEST_DATA", str(DATA.resolve()))
    monkeypatch.chdir(tmp_path)
    blocks = toy_blocks()
    assert [language for language, _ in blocks] == ["bash", "python", "bash"]
    for language, text in blocks:
        run_block(language, text)

    tokenizer = Tokenizer.from_file("published/tokenizer.json")
    published = json.loads(Path("published/config.json").read_text())
    run_config = (tmp_path / "runs/cpt/config.yaml").read_text()
    assert published["vocab_size"] > tokenizer.get_vocab_size() and published["vocab_size"] % 64 == 0
    for field, value in (("family", "modernbert"), ("vocab_size", published["vocab_size"]), ("hidden_size", 64),
                         ("num_hidden_layers", 2), ("local_attention", 32), ("global_attn_every_n_layers", 2),
                         ("pad_token_id", tokenizer.token_to_id("[PAD]"))):
        assert re.search(rf"^  {field}: {value}$", run_config, flags=re.M), field
    assert f"vocab: {(tmp_path / 'published/tokenizer.json').resolve()}" in run_config

    metrics = [json.loads(line) for line in Path("runs/cpt/metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m and "lr" in m]
    seed = int(re.search(r"^  seed: (\d+)$", run_config.split("\ntrain:")[1], flags=re.M).group(1))
    buffer = int(re.search(r"^  shuffle_buffer: (\d+)$", run_config, flags=re.M).group(1))
    theirs = first_batch_loss_of_transformers(tmp_path / "published", tmp_path / "data/train.bfrec", seed, buffer)
    assert abs(steps[0]["loss"] - theirs) < 1e-5, (steps[0]["loss"], theirs)

    schedule = TrainConfig(lr=3e-4, schedule="wsd", warmup_steps=0, decay_steps=4, steps=8)
    assert [m["lr"] for m in steps] == pytest.approx([lr_at(k, schedule, 8) for k in range(8)], rel=1e-6)
    assert [m["lr"] / 3e-4 for m in steps] == pytest.approx([1, 1, 1, 1, 1, 1, 0.75, 0.5], rel=1e-6)

    text = "The cat sat on the mat, and [MASK] was glad."
    theirs_tokenizer = transformers.AutoTokenizer.from_pretrained("export")
    assert theirs_tokenizer(text)["input_ids"] == tokenizer.encode(text).ids
    exported = transformers.AutoModelForMaskedLM.from_pretrained("export").eval()
    ours = load_safetensors(tmp_path / "runs/cpt/checkpoints/step_00000008/model.safetensors")
    assert ours and all(torch.equal(exported.state_dict()[key], value) for key, value in ours.items())
    filled = transformers.pipeline("fill-mask", model="export")(text)  # the export's tokenizer files name [MASK]
    ids = tokenizer.encode(text).ids
    with torch.no_grad():
        logits = exported(input_ids=torch.tensor([ids])).logits[0, ids.index(tokenizer.token_to_id("[MASK]"))]
    assert [row["token"] for row in filled] == logits.topk(5).indices.tolist()

    same = Path("published/tokenizer.json").read_bytes()
    for run in ("ft/mrpc", "ft/ner", "ft/squad"):
        assert (tmp_path / run / "tokenizer.json").read_bytes() == same, run
    assert 0.0 <= json.loads(Path("ft/mrpc/scores.json").read_text())["accuracy"] <= 1.0
    assert 0.0 <= json.loads(Path("ft/ner/scores.json").read_text())["f1"] <= 1.0
    answers = json.loads(Path("ft/squad/predictions.json").read_text())
    contexts = {qa["id"]: p["context"] for p in json.loads(Path("dev-small.json").read_text())["data"][0]["paragraphs"]
                for qa in p["qas"]}
    assert set(answers) == set(contexts) and all(answer in contexts[q] for q, answer in answers.items())

    # A model whose table is smaller than the tokenizer: refused in one line before training.
    small = transformers.ModernBertConfig(**{**published, "vocab_size": 64})
    transformers.ModernBertForMaskedLM(small).save_pretrained("small")
    capsys.readouterr()
    assert main(["pretrain", "--checkpoint.init", "small", "--data.vocab", "published/tokenizer.json",
                 "--data.input", "data/train.bfrec", "--data.seq_len", "64", "--data.max_predictions", "10",
                 "--train.steps", "2", "--run-dir", "runs", "--name", "small", "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"has {tokenizer.get_vocab_size()} tokens, more than the 64 embeddings" in err
