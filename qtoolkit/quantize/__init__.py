"""Quantization: a recipe in, a compressed-tensors checkpoint and its report out."""
