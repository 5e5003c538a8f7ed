"""``bertforge import tf1|tf2|hf``: other formats' checkpoints to our model directory; parsers and
handlers. No torch at import: the handlers import the converters when they run.

(``bertforge export`` stays in cli.py: to choose a head it reads what every job saves with its
model, finetune.yaml and trainer.pt included, whose readers sit in folders above this one.)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bertforge.config import ConfigError

OVERWRITE_HELP = "replace OUT_DIR if it exists and is not empty (never a live run's)"
OUT_HELP = "output directory: new or empty, unless --overwrite"
PREFIX_HELP = "checkpoint prefix (PREFIX.index and PREFIX.data-* exist), or its directory"


def _import_prefix(args: argparse.Namespace) -> Path:
    """The TensorFlow checkpoint prefix an import names; an --overwrite that would delete it is refused."""
    from bertforge.runs import CheckpointError

    from . import tf1

    prefix = tf1.find_prefix(args.prefix)
    if prefix is None:
        raise CheckpointError(f"{args.prefix}: not a TensorFlow checkpoint ({args.prefix}.index is missing)")
    out = Path(args.out).resolve()
    if args.overwrite and (out == prefix.parent.resolve() or out in prefix.parent.resolve().parents):
        raise ConfigError(f"{args.out}: --overwrite would delete the checkpoint being imported ({prefix}); "
                          f"choose another output directory")
    return prefix


def cmd_import_tf1(args: argparse.Namespace, extra: list[str]) -> int:
    from .bert_tf1 import import_tf1

    prefix = _import_prefix(args)
    out, skipped = import_tf1(prefix, args.out, args.bert_config, args.vocab, overwrite=args.overwrite)
    print(f"imported {prefix} to {out}; skipped {len(skipped)} variables that are not model weights "
          f"(optimizer slots, global_step, …)")
    return 0


def cmd_import_tf2(args: argparse.Namespace, extra: list[str]) -> int:
    from .tf2 import import_tf2

    prefix = _import_prefix(args)
    out, skipped, fresh = import_tf2(prefix, args.out, args.bert_config, args.vocab, overwrite=args.overwrite)
    heads = sorted({name.rsplit(".", 1)[0] for name in fresh})
    print(f"imported {prefix} to {out}; skipped {len(skipped)} variables that are not model weights "
          f"(save_counter, …)" + (f"; not in the reference TF2 model, newly initialised: {', '.join(heads)}"
                                  if heads else ""))
    return 0


def cmd_import_hf(args: argparse.Namespace, extra: list[str]) -> int:
    from .hf import find_model, import_hf

    source = find_model(args.source)
    out = Path(args.out).resolve()
    if args.overwrite and (out == source.resolve() or out in source.resolve().parents):
        raise ConfigError(f"{args.out}: --overwrite would delete the model being imported ({source}); "
                          f"choose another output directory")
    print(f"imported {source} to {import_hf(source, args.out, overwrite=args.overwrite)}")
    return 0


def add_import_command(sub: Any) -> None:
    """``bertforge import tf1|tf2|hf``: registered by cli.py."""
    p = sub.add_parser("import", help="convert another format's checkpoint to our model directory")
    import_sub = p.add_subparsers(dest="format", required=True)
    p = import_sub.add_parser("tf1", help="a TensorFlow 1 checkpoint (google-research/bert, MLPerf)",
                              description="Write a TF1 checkpoint (e.g. ckpt/model.ckpt-28252) as a directory "
                                          "that load_model, --init, eval and export read. Optimizer slots and "
                                          "global_step are skipped.")
    p.add_argument("prefix", help=PREFIX_HELP)
    p.add_argument("out", type=Path, help=OUT_HELP)
    p.add_argument("--bert-config", help="bert_config.json (default: the one beside the checkpoint)")
    p.add_argument("--vocab", help="vocab.txt to copy (default: the one beside the checkpoint, if any)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(func=cmd_import_tf1)
    p = import_sub.add_parser("tf2", help="a TensorFlow 2 object-based checkpoint (Model Garden's BertEncoder or "
                                          "BertPretrainerV2; MLPerf's tf2_ckpt)",
                              description="Write a TF2 checkpoint (e.g. tf2_ckpt/model.ckpt-28252) as a directory "
                                          "that load_model, --init, eval and export read. The heads the reference "
                                          "TF2 model lacks (NSP; the masked-LM head of an encoder checkpoint) are "
                                          "newly initialised, and named.")
    p.add_argument("prefix", help=PREFIX_HELP)
    p.add_argument("out", type=Path, help=OUT_HELP)
    p.add_argument("--bert-config", help="bert_config.json (default: the one beside the checkpoint, or one "
                                         "directory up)")
    p.add_argument("--vocab", help="vocab.txt to copy (default: the one beside the checkpoint or one directory up, "
                                   "if any)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(func=cmd_import_tf2)
    p = import_sub.add_parser("hf", help="a Hugging Face BERT or ModernBERT directory, or a model id in the local "
                                         "Hugging Face cache",
                              description="Write a transformers model directory (config.json with model_type bert "
                                          "or modernbert, model.safetensors) as our model directory, with the head "
                                          "its architecture names and its vocab.txt or tokenizer.json.")
    p.add_argument("source", help="the directory, or a model id in the local Hugging Face cache")
    p.add_argument("out", type=Path, help=OUT_HELP)
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(func=cmd_import_hf)
