"""quantkit: quantize a causal LM layer by layer, export it in the formats engines load, measure the cost."""

__version__ = "0.1.0"
