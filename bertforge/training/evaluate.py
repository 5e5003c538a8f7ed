"""Offline evaluation: masked-LM and NSP accuracy of checkpoints on an eval file.

    bertforge eval init/ --data.eval_input records/eval_10k.tfrecord
    bertforge eval runs/NAME/checkpoints/step_* --data.eval_input records/eval_10k.tfrecord --json

Each checkpoint (our run, step or model directory, a Hugging Face BERT
directory, or whatever else ``formats.load.load_model`` reads) is evaluated on
every record of the eval file, in order and without dropout, by the same
function as a training run's evaluations (``train.evaluate``): the masked-LM
accuracy is the mean over all real predictions of the file (padding
predictions, weight 0 in ``masked_lm_weights``, are left out), so a step
directory gives exactly the accuracy its run logged at that step, with the
same batch size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bertforge.data import DataError, PretrainingDataset
from bertforge.data.record_reader import open_records


def read_eval_set(path: str | Path) -> PretrainingDataset:
    """Every record of an eval file (TFRecord or native), checksums verified."""
    with open_records(path) as records:
        if not len(records):
            raise DataError(f"{path}: no records to evaluate on")
        return PretrainingDataset(records.take(np.arange(len(records))))


def check_fits(eval_set: PretrainingDataset, path: str | Path, model: Any, checkpoint: str | Path) -> None:
    """Refuse records the model cannot read: longer than its position table, or token ids
    outside its vocab (naming the eval file, the checkpoint and both numbers)."""
    arrays, cfg = eval_set.arrays, model.config
    seq_len = arrays.input_ids.shape[1]
    if seq_len > cfg.max_position_embeddings:
        raise DataError(f"{path}: sequences of {seq_len} tokens, but {checkpoint} has "
                        f"max_position_embeddings={cfg.max_position_embeddings}")
    largest = int(max(arrays.input_ids.max(), arrays.masked_lm_ids.max()))
    if largest >= cfg.vocab_size:
        raise DataError(f"{path}: token id {largest}, but {checkpoint} has a vocab of {cfg.vocab_size}: "
                        "evaluate on records made with the checkpoint's vocab")


def check_tokenizer_of(eval_input: str | Path, model: Any, checkpoint: str | Path, vocab: str | Path | None) -> None:
    """Refuse an eval file made with another tokenizer than the checkpoint's (a native header's or a
    TFRecord sidecar's, as pre-training refuses it): ``vocab`` (``data.vocab``) if given, which must
    be the checkpoint's own (``check_model_vocab``), else the vocab beside its weights. A checkpoint
    without one, given none, is checked by its ids alone (``check_fits``)."""
    from bertforge.data.loader import check_tokenizer
    from bertforge.data.vocab import check_model_vocab
    from bertforge.formats.load import vocab_beside

    own = vocab_beside(checkpoint)
    if vocab:
        check_model_vocab(vocab, model.config.vocab_size, own, checkpoint, "data.vocab")
        check_tokenizer([Path(eval_input)], vocab)
    elif own is not None:
        check_tokenizer([Path(eval_input)], own, f"the vocab of {checkpoint}")


def evaluate_checkpoints(checkpoints: Sequence[str | Path], eval_input: str | Path, batch_size: int,
                         device: str = "auto", precision: str = "fp32", *, vocab: str | Path | None = None,
                         max_batches: int = 0, progress: bool = True, every_s: float = 30.0
                         ) -> Iterator[dict[str, Any]]:
    """One result per checkpoint, in order: its path, then ``train.evaluate``'s numbers on the first
    ``max_batches`` batches (``train.eval_batches``; 0: all). Records of another tokenizer than the
    checkpoint's (or ``vocab``, ``data.vocab``) are refused (``check_tokenizer_of``). Each
    evaluation shows its progress (``progress``: ``log.progress``; ``every_s``: ``log.progress_every_s``)
    as a :class:`~bertforge.observe.log.Stage`."""
    import torch

    from bertforge.formats.load import load_model
    from bertforge.observe.log import Stage
    from bertforge.parallel.dist import resolve_device

    from .pretrain import evaluate

    where = resolve_device(device)
    eval_set = read_eval_set(eval_input)
    for checkpoint in checkpoints:
        model = load_model(checkpoint, head="pretraining")
        check_tokenizer_of(eval_input, model, checkpoint, vocab)
        check_fits(eval_set, eval_input, model, checkpoint)
        count = len(eval_set) if max_batches <= 0 else min(len(eval_set), max_batches * batch_size)
        with Stage(f"eval {checkpoint}", f"{count} sequences", enabled=progress, every_s=every_s):
            result = evaluate(model.to(where), eval_set, batch_size, where, precision, max_batches)
        del model
        if where.type == "cuda":
            torch.cuda.empty_cache()
        yield {"checkpoint": str(checkpoint), **result}


def format_result(result: dict[str, Any], as_json: bool) -> str:
    """One JSON object (``--json``), else one line for a person."""
    if as_json:
        return json.dumps(result)
    head = (f"{result['checkpoint']}: masked-LM accuracy {result['mlm_accuracy']:.5f} "
            f"({result['predictions']} predictions)")
    if "nsp_accuracy" not in result:  # a masked-LM-only model
        return f"{head}, loss {result['loss']:.4f}, {result['sequences']} sequences"
    return (f"{head}, NSP accuracy {result['nsp_accuracy']:.5f}, "
            f"loss {result['loss']:.4f} (masked-LM {result['mlm_loss']:.4f}, NSP {result['nsp_loss']:.4f}), "
            f"{result['sequences']} sequences")
