"""SQuAD v1.1 and v2.0: examples, features, post-processing and the official metrics.

Every step reproduces google-research/bert's ``run_squad.py`` (v2.0: with
``version_2_with_negative``) and the official ``evaluate-v1.1.py`` and
``evaluate-v2.0.py`` exactly (tested against them), so that a score
difference can only come from the model::

    from bertforge.data.tokenizer import load_tokenizer
    from bertforge import squad

    examples, skipped = squad.read_examples("dev-v1.1.json")
    features = squad.convert_examples_to_features(examples, load_tokenizer("vocab.txt"))
    # start_logits, end_logits: (len(features), 384) from BertForQuestionAnswering
    predictions, nbest = squad.postprocess(examples, features, start_logits, end_logits)
    squad.evaluate(squad.load_json("dev-v1.1.json"), predictions)  # {"exact_match": …, "f1": …}

    # SQuAD v2.0: read and post-process with version_2_with_negative=True; the result
    # also carries .null_odds, the official v2.0 script's --na-prob-file
    result = squad.postprocess(examples, features, start_logits, end_logits, version_2_with_negative=True)
    squad.evaluate_v2("dev-v2.0.json", result.predictions, result.null_odds)  # {"exact": …, "f1": …, …}
"""

from .data import (
    DOC_STRIDE,
    MAX_QUERY_LENGTH,
    MAX_SEQ_LENGTH,
    SkippedAnswer,
    SquadError,
    SquadExample,
    SquadFeatures,
    convert_examples_to_features,
    example_from_text,
    load_json,
    parse_examples,
    read_examples,
)
from .metric import evaluate, evaluate_v2, exact_match_score, f1_score, format_scores, normalize_answer
from .postprocess import (
    MAX_ANSWER_LENGTH,
    N_BEST_SIZE,
    SquadPredictions,
    get_final_text,
    postprocess,
    write_predictions,
)

__all__ = [
    "DOC_STRIDE", "MAX_ANSWER_LENGTH", "MAX_QUERY_LENGTH", "MAX_SEQ_LENGTH", "N_BEST_SIZE",
    "SkippedAnswer", "SquadError", "SquadExample", "SquadFeatures", "SquadPredictions",
    "convert_examples_to_features", "evaluate", "evaluate_v2", "exact_match_score", "example_from_text",
    "f1_score", "format_scores", "get_final_text", "load_json",
    "normalize_answer", "parse_examples", "postprocess", "read_examples", "write_predictions",
    # fine-tuning and inference (bertforge.tasks.squad.train, imported on first use: it needs torch)
    "SquadConfig", "finetune", "load_squad_config", "predict", "predict_logits", "qa_loss",
]

_TRAIN_NAMES = ("SquadConfig", "finetune", "load_squad_config", "predict", "predict_logits", "qa_loss")


def __getattr__(name: str):
    if name in _TRAIN_NAMES:
        from . import train
        return getattr(train, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
