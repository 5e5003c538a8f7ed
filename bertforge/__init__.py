"""bertforge: BERT pre-training and fine-tuning in PyTorch."""
__version__ = "0.1.0"
