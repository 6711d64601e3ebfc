"""lm-evaluation-harness: our engine as an lm-eval model, our tasks, paired per-document metrics."""
