"""Model ids from the Hugging Face hub: downloaded into the local cache when the network is there
(a local stand-in for the hub, tests/hub_server.py), the cached snapshot offline, today's one-line
message when neither has the model."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO
from hub_server import serving_hub
from tiny_corpus import write_corpus

from bertforge.config import ModelConfig, load_config
from bertforge.formats.hf import export_hf, find_model
from bertforge.formats.load import load_model
from bertforge.models.families import MODELS

MODEL_ID = "org/tiny-bert"


def bertforge(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    full = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "bertforge", *args], env=full, cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def hub_env(endpoint: str, cache: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0", "no_proxy": "127.0.0.1",
            "HF_HUB_DISABLE_TELEMETRY": "1"}


@pytest.mark.slow
def test_init_downloads_a_model_id_from_the_hub_into_the_cache_and_trains_from_it(tmp_path, monkeypatch):
    write_corpus(tmp_path)  # records of a 21-token vocab
    torch.manual_seed(0)
    model = MODELS["bert"]["pretraining"](ModelConfig(vocab_size=21, hidden_size=32, num_hidden_layers=2,
                                                      num_attention_heads=2, intermediate_size=64))
    export_hf(model, tmp_path / "hf", tmp_path / "vocab.txt")
    files = {f.name: f.read_bytes() for f in (tmp_path / "hf").iterdir()}
    files["pytorch_model.bin"] = b"a pickle: never fetched"
    cache = tmp_path / "hf-cache"
    with serving_hub(MODEL_ID, files) as hub:
        done = bertforge(["pretrain", "--config", "pretrain_tiny", "--init", MODEL_ID,
                          "--data.input", str(tmp_path / "train.tfrecord"), "--data.vocab", str(tmp_path / "vocab.txt"),
                          "--data.seq_len", "32", "--data.max_predictions", "4",
                          "--model.hidden_size", "32", "--model.intermediate_size", "64",
                          "--train.steps", "1", "--train.lr", "1e-9", "--train.micro_batch_size", "4",
                          "--train.global_batch_size", "4", "--train.eval_every", "0", "--log.progress", "false",
                          "--execution.threads", "2", "--log.run_dir", str(tmp_path / "runs"),
                          "--log.name", "from-hub"],
                         hub_env(hub.endpoint, cache), tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        fetched = sorted(path.rsplit("/", 1)[1] for method, path in hub.requests
                         if method == "GET" and "/resolve/" in path)
    # what we read (the export's tokenizer_config.json too, not its special_tokens_map.json), never the pickle
    assert fetched == ["config.json", "model.safetensors", "tokenizer_config.json", "vocab.txt"]
    # huggingface_hub's cache layout: refs/main names the commit, the snapshot links the blobs
    repo = cache / "models--org--tiny-bert"
    assert (repo / "refs" / "main").read_text() == hub.commit
    snapshot = repo / "snapshots" / hub.commit
    unread = ("pytorch_model.bin", "special_tokens_map.json")
    served = {name: data for name, data in files.items() if name not in unread}
    assert {f.name: f.read_bytes() for f in snapshot.iterdir()} == served
    run_dir = tmp_path / "runs" / "from-hub"
    assert load_config(str(run_dir / "config.yaml")).checkpoint.init == str(snapshot)
    # one step at lr 1e-9 from the hub's weights leaves them (a fresh start would be far from them)
    trained = load_model(run_dir).state_dict()
    assert all(torch.allclose(trained[k], v, atol=1e-6) for k, v in model.state_dict().items())
    # offline now, the cached snapshot is found without the hub
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    assert find_model(MODEL_ID) == snapshot


def test_an_unreachable_hub_keeps_the_one_line_not_cached_message(tmp_path):
    with socket.socket() as closed:  # a port nothing listens on: the connection is refused
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    done = bertforge(["import", "hf", "org/absent", str(tmp_path / "out")], hub_env(endpoint, tmp_path / "cache"),
                     tmp_path)
    assert (done.returncode, done.stderr) == (2, (
        f"error: model not found: org/absent (no such path, and no model org/absent in the local Hugging Face "
        f"cache {tmp_path / 'cache'}: `hf download org/absent` puts it there)\n"))
    assert not (tmp_path / "out").exists()


def test_a_model_the_hub_does_not_have_is_one_line(tmp_path):
    with serving_hub(MODEL_ID, {}) as hub:
        done = bertforge(["import", "hf", "org/other", str(tmp_path / "out")],
                         hub_env(hub.endpoint, tmp_path / "cache"), tmp_path)
    assert (done.returncode, done.stderr) == (2, (
        f"error: model not found: org/other (no such path, no model org/other in the local Hugging Face cache "
        f"{tmp_path / 'cache'}, and none the Hugging Face hub {hub.endpoint} lets us read)\n"))
