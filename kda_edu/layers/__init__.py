"""Layers (`torch.nn.Module`s) built on the operators and kernels: KDA, MLA, FFN, mixers."""
