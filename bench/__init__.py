"""Benchmarks, experiments and diagnostics of kda_edu; run the scripts as `python -m bench.<folder>.<name>`."""
