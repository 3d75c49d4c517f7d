"""Running one sequence across several devices: context parallelism for KDA (`context_parallel`) and for
MLA (`context_parallel_mla`).

This layer sits beside the kernels: it uses the PyTorch references of `kda_edu.ops` and, where they run,
the Triton kernels of `kda_edu.kernels` (imported on use), and nothing above them.
"""
