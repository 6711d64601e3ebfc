"""Diagnosis: where time goes on this machine, prefill and decode against their rooflines."""
