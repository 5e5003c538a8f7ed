"""``bertforge squad train | predict | evaluate | ask``.

    bertforge squad train --init MODEL --train-file train-v1.1.json [--predict-file dev-v1.1.json]
        [--config squad_base] [--out DIR [--overwrite]] [--vocab vocab.txt] [--train.lr 3e-5 --squad.doc_stride 128 …]
        [--version 2]
    bertforge squad predict --model DIR --predict-file dev-v1.1.json --out predictions.json
        [--nbest-out nbest_predictions.json] [--version 2 [--null-threshold T] [--null-odds-out null_odds.json]]
    bertforge squad evaluate dev-v1.1.json predictions.json
        [--version 2 [--na-prob-file null_odds.json] [--null-threshold 1.0]]
    bertforge squad ask --model DIR --context "…" --question "…" [--questions-file q.txt] [--compare-hf]

Every handler takes ``(args, extra)`` and returns an exit status; it raises the
mistakes a user can make (a missing file, a malformed SQuAD file, a bad config
key), and ``bertforge.cli.main`` turns them into one ``error: …`` line and exit
status 2, as for every other command.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import typing
from pathlib import Path
from typing import Any

from bertforge.config import Precision, positive_int

OVERRIDES_HELP = ("Config fields are set with dotted flags, e.g. --train.lr 5e-5 "
                  "--train.micro_batch_size 8 --execution.precision bf16 --squad.doc_stride 128.")


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from bertforge.config import ConfigError, parse_overrides

    from .train import finetune, load_squad_config

    overrides = parse_overrides(extra)
    if args.no_progress:
        overrides.append(("log.progress", "false"))
    if args.profile:
        overrides.append(("log.profile", args.profile))
    if args.resume:
        overrides.append(("checkpoint.resume", args.resume))
    if args.resume_with_changes:
        overrides.append(("checkpoint.resume_with_changes", "true"))
    if args.version is not None:  # only when given: a resumed run keeps its saved version otherwise
        overrides.append(("squad.version_2_with_negative", str(_is_v2(args)).lower()))
    if args.overwrite and args.resume:
        raise ConfigError("--overwrite starts a new run; it cannot be used with --resume")
    if args.overwrite and not args.out:
        raise ConfigError("--overwrite needs --out DIR, the directory to replace")
    cfg, squad = load_squad_config(args.config, overrides, resume=args.resume, out_dir=args.out)
    if args.overwrite:
        from bertforge.tasks.finetune.run import check_overwrite

        check_overwrite(args.out, {"--init": args.init, "--train-file": args.train_file,
                                   "--predict-file": args.predict_file, "--vocab": args.vocab})
    from bertforge.tasks.finetune.run import saved_line

    summary = finetune(cfg, squad, args.init, args.train_file, args.out, args.predict_file, args.vocab,
                       overwrite=args.overwrite)
    if summary["rank"] != 0:  # under torchrun, rank 0 speaks for the run
        return 0
    losses = summary["losses"]
    trained = f"; loss {losses[0]:.4f} → {losses[-1]:.4f}" if losses else ""
    print(f"{summary['steps']} steps on {summary['questions']} questions in {summary['minutes']:.1f} min"
          f"{trained}")
    print(saved_line(summary))
    if "scores" in summary:
        print(f"predictions: {summary['predictions']}")
        print(json.dumps(summary["scores"]))  # v1.1: exact_match and f1; v2.0: the official v2.0 keys
    return 0


def resolved_config(name: str, overrides: list[tuple[str, str]]) -> str:
    """``bertforge config --config squad_base``: the Config and its ``squad:`` section as
    ``squad train`` resolves them, as YAML that ``--config`` reads back."""
    import dataclasses

    import yaml

    from .train import load_squad_config

    cfg, squad = load_squad_config(name, overrides)
    return cfg.to_yaml() + yaml.safe_dump({"squad": dataclasses.asdict(squad)}, sort_keys=False)


def _predict_settings(args: argparse.Namespace, extra: list[str]) -> tuple[Any, ...]:
    """(model, tokenizer, seq_len, SquadConfig, lowercase, LogConfig) for a fine-tuned model directory;
    of the log section only what shows progress is read (log.progress, log.progress_every_s)."""
    from bertforge.config import ConfigError, LogConfig, parse_overrides
    from bertforge.data.fast_tokenizer import task_tokenizer
    from bertforge.tasks.finetune.run import find_vocab, set_section

    from .data import MAX_SEQ_LENGTH
    from .train import (
        load_qa_model,
        saved_settings,
        validate_squad,
    )

    vocab = find_vocab(args.model, args.vocab)
    model = load_qa_model(args.model, vocab)
    lowercase, squad, seq_len = saved_settings(args.model)
    seq_len = seq_len or MAX_SEQ_LENGTH
    log = LogConfig()
    for key, value in parse_overrides(extra):
        if key == "data.seq_len":
            seq_len = int(value)
        elif key.startswith("squad."):
            set_section(squad, "squad", key[len("squad."):], value)
        elif key in ("log.progress", "log.progress_every_s"):
            set_section(log, "log", key[len("log."):], value)
        else:
            raise ConfigError(f"{key}: only data.seq_len, squad.*, log.progress and log.progress_every_s can be "
                              "set here")
    if not log.progress_every_s > 0:
        raise ConfigError(f"log.progress_every_s={log.progress_every_s} must be positive")
    if getattr(args, "batch_size", None):
        squad.predict_batch_size = args.batch_size
    if getattr(args, "version", None) is not None:  # else the model's saved setting
        squad.version_2_with_negative = _is_v2(args)
    if getattr(args, "null_threshold", None) is not None:
        squad.null_score_diff_threshold = args.null_threshold
    validate_squad(squad, seq_len)
    return model, task_tokenizer(vocab, lowercase), seq_len, squad, lowercase, log


def cmd_predict(args: argparse.Namespace, extra: list[str]) -> int:
    from bertforge.observe.log import Stage

    from .data import SquadError, read_examples
    from .postprocess import write_predictions
    from .train import predict

    # Only the files named are written: --out, --nbest-out when given, and with SQuAD v2.0
    # the null odds (--null-odds-out, else null_odds.json beside --out, as run_squad writes them).
    out = Path(args.out)
    nbest_file = Path(args.nbest_out) if args.nbest_out else None
    if nbest_file is not None and nbest_file.resolve() == out.resolve():
        raise SquadError(f"--out and --nbest-out are the same file: {out}")
    model, tokenizer, seq_len, squad, lowercase, log = _predict_settings(args, extra)
    null_file = None
    if squad.version_2_with_negative:
        null_file = Path(args.null_odds_out) if args.null_odds_out else out.parent / "null_odds.json"
        if null_file.resolve() in {out.resolve(), *([nbest_file.resolve()] if nbest_file else [])}:
            raise SquadError(f"the null odds would overwrite another output: {null_file} (--null-odds-out)")
    elif args.null_odds_out:
        raise SquadError("--null-odds-out needs SQuAD v2.0 (--version 2)")
    examples, _ = read_examples(args.predict_file, version_2_with_negative=squad.version_2_with_negative)
    if not examples:
        raise SquadError(f"{args.predict_file}: no questions to predict")
    with Stage("squad predict", f"{len(examples)} questions", enabled=log.progress, every_s=log.progress_every_s):
        result = predict(model, examples, tokenizer, seq_len, squad, lowercase, precision=args.precision)
    write_predictions(result.predictions, out, result.nbest if nbest_file else None, nbest_file,
                      result.null_odds, null_file)
    print(f"{len(result.predictions)} predictions: {out}" + (f" (n-best: {nbest_file})" if nbest_file else "")
          + (f" (null odds: {null_file})" if null_file else ""))
    return 0


def cmd_evaluate(args: argparse.Namespace, extra: list[str]) -> int:
    from .data import SquadError, load_json
    from .metric import check_predictions, evaluate, evaluate_v2

    predictions = check_predictions(load_json(args.predictions), str(args.predictions))
    if not _is_v2(args):
        if getattr(args, "na_prob_file", None) or getattr(args, "null_threshold", None) is not None:
            raise SquadError("--na-prob-file and --null-threshold need SQuAD v2.0 (--version 2)")
        print(json.dumps(evaluate(args.dataset, predictions, predictions_source=str(args.predictions))))
        return 0
    # The official evaluate-v2.0.py: --na-prob-file, and its --na-prob-thresh (default 1.0).
    na_probs = load_json(args.na_prob_file) if args.na_prob_file else None
    threshold = 1.0 if args.null_threshold is None else args.null_threshold
    print(json.dumps(evaluate_v2(args.dataset, predictions, na_probs, threshold,
                                 predictions_source=str(args.predictions),
                                 na_probs_source=str(args.na_prob_file))))
    return 0


def _questions(args: argparse.Namespace) -> list[str]:
    from .data import SquadError

    questions = [args.question] if args.question else []
    if args.questions_file:
        path = Path(args.questions_file)
        if not path.is_file():
            raise SquadError(f"file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise SquadError(f"{path}: not UTF-8 text (byte offset {err.start})") from None
        questions += [line.strip() for line in text.splitlines() if line.strip()]
    if not questions:
        raise SquadError("ask needs --question or --questions-file")
    return questions


def require_transformers(what: str) -> None:
    """One line naming the extra to install when ``what`` needs transformers and it is missing
    (an ordinary install leaves it out); checked before the model loads."""
    try:
        import transformers  # noqa: F401 - only to know it is there
    except ModuleNotFoundError as err:
        if err.name != "transformers":  # installed, but one of its own imports is missing: its message says which
            raise
        from .data import SquadError
        raise SquadError(f'{what} needs transformers, which is not installed: pip install "bertforge[hf]"') from None


def hf_logits(model: Any, model_path: str | Path, features: Any) -> tuple[Any, Any]:
    """Start/end logits of ``transformers.BertForQuestionAnswering`` on the same weights.

    A Hugging Face directory that already has a QA head is loaded as it is;
    anything else (our checkpoint, or an encoder whose QA head we initialised)
    is exported from ``model`` to a temporary directory first.
    """
    import torch
    import transformers
    from safetensors import safe_open

    from bertforge.formats.hf import export_hf

    path = Path(model_path)
    direct = False
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            direct = "qa_outputs.weight" in set(f.keys())
    with tempfile.TemporaryDirectory() as tmp:
        source = path if direct else export_hf(model, Path(tmp) / "hf", without_tokenizer=True)
        transformers.logging.set_verbosity_error()
        hf = transformers.BertForQuestionAnswering.from_pretrained(str(source)).eval()
    with torch.inference_mode():
        out = hf(input_ids=torch.from_numpy(features.input_ids).long(),
                 token_type_ids=torch.from_numpy(features.segment_ids).long(),
                 attention_mask=torch.from_numpy(features.input_mask).long())
    return out.start_logits.float().numpy(), out.end_logits.float().numpy()


def cmd_ask(args: argparse.Namespace, extra: list[str]) -> int:
    import numpy as np

    from .data import convert_examples_to_features, example_from_text
    from .postprocess import postprocess
    from .train import predict_logits

    if args.compare_hf:
        require_transformers("--compare-hf")
    model, tokenizer, seq_len, squad, lowercase, _ = _predict_settings(args, extra)
    if args.context is None:
        from .data import SquadError
        raise SquadError("ask needs --context")
    questions = _questions(args)
    examples = [example_from_text(q, args.context, f"q{i}") for i, q in enumerate(questions)]
    features = convert_examples_to_features(examples, tokenizer, seq_len, squad.doc_stride,
                                            squad.max_query_length)
    start, end = predict_logits(model, features, squad.predict_batch_size,
                                trim_padding=squad.trim_padding)
    predictions, nbest = postprocess(examples, features, start, end, squad.n_best_size,
                                     squad.max_answer_length, do_lower_case=lowercase,
                                     version_2_with_negative=squad.version_2_with_negative,
                                     null_score_diff_threshold=squad.null_score_diff_threshold)
    for example in examples:
        best = nbest[example.qas_id][0]
        print(f"question: {example.question}")
        answer = predictions[example.qas_id] or "(no answer)"  # "": SQuAD v2.0's no answer
        print(f"answer:   {answer}  (score {best['start_logit'] + best['end_logit']:.4f}, "
              f"probability {best['probability']:.4f})")
    if args.compare_hf:
        hf_start, hf_end = hf_logits(model, args.model, features)
        real = features.input_mask.astype(bool)  # padding logits are not computed when trimming
        diff = max(float(np.abs(hf_start - start)[real].max()), float(np.abs(hf_end - end)[real].max()))
        print(f"max |logit difference| at real positions vs transformers.BertForQuestionAnswering: "
              f"{diff:.3e}")
    return 0


def add_squad_commands(sub: Any) -> None:
    """Add ``squad`` with its subcommands to an argparse subparsers object."""
    squad = sub.add_parser("squad", help="SQuAD v1.1 and v2.0 fine-tuning, prediction and evaluation")
    commands = squad.add_subparsers(dest="squad_command", required=True)

    p = commands.add_parser("train", help="fine-tune a checkpoint or Hugging Face BERT on SQuAD",
                            epilog=OVERRIDES_HELP)
    p.add_argument("--init", help="our checkpoint or a Hugging Face BERT directory (not with --resume)")
    p.add_argument("--train-file", help="SQuAD v1.1 training JSON (default with --resume: the run's)")
    p.add_argument("--predict-file", help="SQuAD v1.1 JSON to predict and score at the end "
                                          "(and every --train.eval_every steps)")
    p.add_argument("--config", default=None, help="squad_base (default), squad_large or a YAML path "
                                                   "(default with --resume: the run's)")
    p.add_argument("--out", help="run directory, new or empty: checkpoints, metrics and the fine-tuned "
                                 "model (default: runs/squad-TIMESTAMP)")
    p.add_argument("--resume", help="a run or step directory of squad train to continue exactly")
    p.add_argument("--resume-with-changes", action="store_true",
                   help="resume although the config or the training file differ from the checkpoint's (each "
                        "change is logged)")
    p.add_argument("--overwrite", action="store_true",
                   help="--out may be a non-empty directory: the old run's files are removed first, "
                        "under its lock (a live run's directory is refused)")
    p.add_argument("--vocab", "--tokenizer", dest="vocab",
                       help="vocab.txt or tokenizer.json (default: the one beside --init)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--profile", metavar="START:END", help="torch.profiler over steps START..END-1 (from 0), "
                   "into OUT/profile/ (log.profile)")
    _add_version(p, "--squad.version_2_with_negative true: unanswerable questions (default 1.1; with "
                    "--resume: the run's)")
    p.set_defaults(func=cmd_train, takes_overrides=True)

    for name, helptext in (("predict", "write predictions.json (and the n-best lists with --nbest-out)"),
                           ("ask", "answer questions about a context")):
        p = commands.add_parser(name, help=helptext,
                                epilog="--data.seq_len N and --squad.* override the saved settings.")
        p.add_argument("--model", required=True, help="a fine-tuned model directory")
        p.add_argument("--vocab", "--tokenizer", dest="vocab",
                       help="vocab.txt or tokenizer.json (default: the one beside --model)")
        p.add_argument("--batch-size", type=positive_int, default=None)
        if name == "predict":
            p.add_argument("--predict-file", required=True)
            p.add_argument("--out", required=True, help="predictions.json to write")
            p.add_argument("--nbest-out", help="also write the n-best lists to this file "
                                               "(nbest_predictions.json); nothing else is written")
            _add_version(p, "SQuAD v2.0: also predict no answer, and write the null odds "
                            "(default: the model's saved setting)")
            p.add_argument("--null-threshold", type=float, default=None,
                           help="v2.0: no answer when null score − best span score > this "
                                "(squad.null_score_diff_threshold; default: the saved one, else 0.0)")
            p.add_argument("--null-odds-out", help="v2.0: where to write the null odds "
                                                   "(default: null_odds.json beside --out)")
            # Prediction runs on the CPU, where fp16 autocast is not supported.
            p.add_argument("--precision", default="fp32",
                           choices=[x for x in typing.get_args(Precision) if x != "fp16"])
            p.set_defaults(func=cmd_predict, takes_overrides=True)
        else:
            p.add_argument("--context")
            p.add_argument("--question")
            p.add_argument("--questions-file", help="a text file, one question a line")
            p.add_argument("--compare-hf", action="store_true",
                           help="also run transformers.BertForQuestionAnswering; print the largest logit difference")
            p.set_defaults(func=cmd_ask, takes_overrides=True)

    p = commands.add_parser("evaluate", help="the official v1.1 EM/F1 (or v2.0 scores) of a predictions file")
    p.add_argument("dataset", help="SQuAD v1.1 (or v2.0) JSON with the answers")
    p.add_argument("predictions", help="predictions.json")
    _add_version(p, "the official v2.0 scores: exact, f1, HasAns_*, NoAns_* (and best_* with --na-prob-file)")
    p.add_argument("--na-prob-file", help="v2.0: null_odds.json of the prediction (the official script's "
                                          "--na-prob-file)")
    p.add_argument("--null-threshold", "--na-prob-thresh", type=float, default=None,
                   help="v2.0: a question whose null odds are above this counts as unanswered "
                        "(the official --na-prob-thresh, default 1.0)")
    p.set_defaults(func=cmd_evaluate)


def _add_version(p: argparse.ArgumentParser, helptext: str) -> None:
    p.add_argument("--version", choices=["1.1", "2", "2.0"], default=None, help=f"SQuAD version; 2: {helptext}")


def _is_v2(args: argparse.Namespace) -> bool:
    return getattr(args, "version", None) in ("2", "2.0")
