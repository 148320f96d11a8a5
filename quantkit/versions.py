"""Package versions recorded with every result (artifact manifests, eval / bench JSON, model cards)."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("quantkit", "torch", "transformers", "safetensors", "compressed-tensors", "lm-eval"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out
