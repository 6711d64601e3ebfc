"""Evaluations (installed as qtoolkit.evals): tasks that compare a candidate with its baseline on the same items, item by item."""
