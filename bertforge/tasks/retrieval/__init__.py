"""Retrieval: embedding models from our encoders, trained and judged as retrieval papers do.

BEIR data and SQuAD as retrieval (beir.py), trec_eval's metrics (metrics.py), exact search and
the evaluation command (evaluate.py, cli.py); see docs/retrieval.md.
"""
