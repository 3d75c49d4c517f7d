"""Experiments behind the chapters' findings: training runs, ablations, probes and replays."""
