"""Schemes a recipe names by preset (`rtn: {scheme: NVFP4A16}`), as compressed-tensors' presets of the same names
define them: the weight-stage arguments each one sets."""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # e2m1 values, float8_e4m3 scales per 16 columns over a float32 global scale; weight-only
    "NVFP4A16": {"type": "fp4", "bits": 4, "group_size": 16, "sym": True},
    # e2m1 values, power-of-two (e8m0) scales per 32 columns; weight-only
    "MXFP4A16": {"type": "fp4", "bits": 4, "group_size": 32, "sym": True},
}
