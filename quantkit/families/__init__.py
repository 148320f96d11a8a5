"""What quantkit knows about model families: one module per family, each registering a `Family` (family.py), and
the structural fallback (generic.py) for blocks no family claims. Code that needs a family fact asks the registry
(`family_of`, `supported`, `pooled`); nothing under algorithms/ names a model class.
"""

# imported in the order the supported-families message lists them (dense, then MoE)
from . import llama, gemma, phi3, granite, olmo, opt  # noqa: F401, I001 (they register themselves)
from . import qwen_moe, mixtral, deepseek, glm4, generic  # noqa: F401, I001
from .family import Family, Pairs, family_of, pooled, register, supported

__all__ = ["Family", "Pairs", "family_of", "pooled", "register", "supported"]
