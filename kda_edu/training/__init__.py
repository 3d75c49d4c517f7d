"""Training: the synthetic tasks and the training loop."""
