"""Kernel benchmarks: timings of kda_edu's operators beside fla's, softmax attention and the references."""
