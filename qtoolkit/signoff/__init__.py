"""Sign-off: step outputs (quantize, eval, bench, diagnose) -> gates -> one verdict -> the report."""
