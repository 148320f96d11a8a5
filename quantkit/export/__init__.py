"""Packed checkpoint formats (GPTQ, compressed-tensors) and the artifact folder writer."""
