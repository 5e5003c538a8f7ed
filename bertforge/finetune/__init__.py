"""Fine-tuning beyond SQuAD: GLUE sentence(-pair) classification and regression, and token classification (NER)."""
