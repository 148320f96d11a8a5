"""Quantized execution: Linear layers that compute with the stored low-precision weights."""
