"""GLM-4: quantkit knows only an engine rule for it; its blocks fold through the structural fallback."""

from __future__ import annotations

from .family import Family, register
from .generic import structural

# vLLM 0.32 `_FLOAT16_NOT_SUPPORTED_MODELS` (vllm/config/model.py): "Numerical instability"
GLM4 = register(Family(name="", model_types=("glm4",), mappings=structural, vllm_float16=False))
