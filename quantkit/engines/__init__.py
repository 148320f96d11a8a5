"""Serving engines that quantkit's evidence can be measured in, besides its own runtime (vLLM)."""
