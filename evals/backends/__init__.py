"""Eval backends: what a task needs from a model (generate, score), from the engine, transformers or an endpoint."""
