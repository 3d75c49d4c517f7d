"""Whole models built from the layers, their checkpoints and their cost accounting."""
