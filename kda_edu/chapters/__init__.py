"""Each chapter's own experiments, measurements and figures, one module per topic, named chNN_*."""
