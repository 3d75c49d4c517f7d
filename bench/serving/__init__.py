"""Serving benchmarks: workloads replayed through the serving engine, measured end to end."""
