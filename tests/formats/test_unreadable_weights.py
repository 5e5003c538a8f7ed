"""A truncated ``model.safetensors`` and a missing ``transformers``: one ``error:`` line through ``cli.main``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the network; set before transformers is imported
transformers = pytest.importorskip("transformers")

from finetune_data import write_sst2  # noqa: E402

from bertforge.cli import main  # noqa: E402

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(59))]
SHAPE = dict(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=64, max_position_embeddings=64)


def save_tiny(family: str, path: Path) -> Path:
    """transformers' tiny masked LM of ``family`` as save_pretrained writes it, with a vocab."""
    if family == "bert":
        transformers.BertForMaskedLM(transformers.BertConfig(**SHAPE)).save_pretrained(path)
    else:
        config = transformers.ModernBertConfig(**SHAPE, pad_token_id=0, cls_token_id=2, sep_token_id=3,
                                               bos_token_id=2, eos_token_id=3)
        transformers.ModernBertForMaskedLM(config).save_pretrained(path)
    (path / "vocab.txt").write_text("".join(f"{token}\n" for token in VOCAB), encoding="utf-8")
    return path


def truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2])


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(family, "hf" or "ours") -> a model directory whose model.safetensors is cut to half: transformers'
    directory, and ours as `bertforge import hf` writes it (with its manifest)."""
    root = tmp_path_factory.mktemp("truncated")
    found = {}
    for family in ("bert", "modernbert"):
        hf = save_tiny(family, root / f"hf_{family}")
        assert main(["import", "hf", str(hf), str(root / f"ours_{family}")]) == 0
        found[family, "hf"], found[family, "ours"] = hf, root / f"ours_{family}"
    for path in found.values():
        truncate(path / "model.safetensors")
    return found


COMMANDS = {
    "import hf": lambda model, tmp: ["import", "hf", str(model), str(tmp / "out")],
    "finetune --init": lambda model, tmp: ["finetune", "glue", "--task", "SST-2", "--init", str(model),
                                           "--data", str(write_sst2(tmp / "sst2")), "--out", str(tmp / "run"),
                                           "--no-progress"],
    "squad ask --model": lambda model, tmp: ["squad", "ask", "--model", str(model), "--context", "w1 w2 w3",
                                             "--question", "w1"],
    "pretrain --init": lambda model, tmp: ["pretrain", "--init", str(model), "--run-dir", str(tmp / "runs"),
                                           "--steps", "1", "--no-progress"],
}


@pytest.mark.parametrize("kind, family, command", [
    (kind, family, command) for kind in ("hf", "ours") for family in ("bert", "modernbert") for command in COMMANDS
    if not (kind == "ours" and command == "import hf")])  # (import hf reads Hugging Face directories only)
def test_a_truncated_model_safetensors_is_one_line_naming_it(sources, kind, family, command, tmp_path, capsys):
    model = sources[family, kind]
    capsys.readouterr()
    assert main(COMMANDS[command](model, tmp_path)) == 2
    err = capsys.readouterr().err
    file = model / "model.safetensors"
    assert err.count("\n") == 1, err
    if kind == "hf" or command == "pretrain --init":  # (pretrain reads the header before its data)
        expected = f"error: {file}: not a readable safetensors file (truncated or edited?): "
    else:  # the manifest tells before safetensors does
        expected = f"error: {file}: {file.stat().st_size} bytes, but manifest.json says "
    assert err.startswith(expected), err
