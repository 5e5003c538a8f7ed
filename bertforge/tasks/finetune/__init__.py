"""Fine-tuning beyond SQuAD: GLUE sentence(-pair) classification and regression, and token classification (NER).

:mod:`.run` holds what every fine-tuning job shares (SQuAD's too): config
sections, run directories and the training loop; :mod:`.glue` and :mod:`.ner`
read their tasks' files and score them; :mod:`.train` fine-tunes and
predicts; :mod:`.cli` is ``bertforge finetune``.
"""


class FinetuneError(ValueError):
    """A user-facing problem with fine-tuning input; the message names the file, line or field."""
