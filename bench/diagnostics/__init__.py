"""Diagnostics: one-off measurements that explain a timing or a training run."""
