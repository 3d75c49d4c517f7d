"""Running one sequence across several devices: context parallelism (`context_parallel`).

This layer sits beside the kernels: it uses the PyTorch references of `kda_edu.ops` and, where they run,
the Triton kernels of `kda_edu.kernels` (imported on use), and nothing above them.
"""
