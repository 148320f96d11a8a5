"""compressed-tensors' preset scheme names, as llm-compressor users write them (`rtn: {scheme: FP8_BLOCK}`), and
the weight-stage arguments each stands for (compressed-tensors 0.20.1 quantization/quant_scheme.py PRESET_SCHEMES).

A preset fills in the stage's arguments; keys written beside it override the preset's (`scheme: FP8_BLOCK,
block: [64, 64]` for a model whose widths 128 does not divide), so the recipe says what differs from the name. An
FP4 preset's fields are its format (NVFP4's group of 16 with e4m3 scales, MX's 32 with e8m0): they may not differ.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

_FP8 = {"bits": 8, "group_size": -1, "sym": True, "type": "float"}
_NV4 = {"type": "fp4", "bits": 4, "group_size": 16, "sym": True}
_MX4 = {"type": "fp4", "bits": 4, "group_size": 32, "sym": True}
_MX8 = {"type": "mxfp8", "bits": 8, "group_size": 32, "sym": True}

SUPPORTED: dict[str, dict[str, Any]] = {
    "W4A16": {"bits": 4, "group_size": 128, "sym": True},
    "W4A16_ASYM": {"bits": 4, "group_size": 128, "sym": False},
    "W8A16": {"bits": 8, "group_size": 128, "sym": True},
    # int8 weights per channel, int8 inputs per token at run time
    "W8A8": {"bits": 8, "group_size": -1, "sym": True, "activations": {"type": "int"}},
    # FP8 weights per channel, FP8 inputs per token at run time
    "FP8_DYNAMIC": _FP8 | {"activations": {"type": "float"}},
    # FP8 weights one scale per tensor, FP8 inputs one static scale per tensor calibrated from the data
    "FP8": _FP8 | {"per_tensor": True, "activations": {"type": "float", "dynamic": False, "strategy": "tensor"}},
    # FP8 weights one scale per [128, 128] block, FP8 inputs per group of 128 columns at run time (DeepSeek-V3's)
    "FP8_BLOCK": _FP8 | {"block": [128, 128], "activations": {"type": "float", "strategy": "group", "group_size": 128}},
    # int4 weights per group of 128 columns, FP8 inputs per token at run time
    "W4AFP8": {"bits": 4, "group_size": 128, "sym": True, "activations": {"type": "float"}},
    # e2m1 values, float8_e4m3 scales per 16 columns over a float32 global scale; weight-only
    "NVFP4A16": _NV4,
    # the same weights, inputs e2m1 per token and group of 16 columns at run time, their e4m3 scales over one static
    # global scale per Linear calibrated from the data
    "NVFP4": _NV4 | {"activations": {"type": "fp4", "bits": 4, "strategy": "group", "group_size": 16}},
    # e2m1 values, power-of-two (e8m0) scales per 32 columns; weight-only
    "MXFP4A16": _MX4,
    # the same weights, inputs quantized the same way per token and group of 32 columns at run time
    "MXFP4": _MX4 | {"activations": {"type": "fp4", "bits": 4, "strategy": "group", "group_size": 32}},
    # e4m3 values, power-of-two (e8m0) scales per 32 columns; weight-only
    "MXFP8A16": _MX8,
    # the same weights, inputs quantized the same way per token and group of 32 columns at run time
    "MXFP8": _MX8 | {"activations": {"type": "mxfp8", "strategy": "group", "group_size": 32}},
}
FIXED = {"NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8"}  # presets whose fields are the format itself


def expand(data: Any) -> Any:
    """A weight stage's arguments with its `scheme:` preset filled in under the keys written beside it (one level
    deeper for `activations`). An unknown name is left for the `scheme` field's check to refuse."""
    if not isinstance(data, dict) or not isinstance(data.get("scheme"), str):
        return data
    preset = SUPPORTED.get(data["scheme"].upper())
    if preset is None:
        return data
    name = data["scheme"].upper()
    if name in FIXED:
        acts = data.get("activations")
        # NVFP4's input global scale is calibrated: its observer may be chosen; nothing else of a fixed preset's inputs
        if "activations" in data and not (name == "NVFP4" and isinstance(acts, dict) and set(acts) <= {"observer"}):
            raise PydanticCustomError("preset", "activations: {name} {sets}; drop activations or the scheme (only "
                                      "NVFP4 takes activations: {example} beside it)",
                                      {"name": name, "sets": "sets its inputs" if "activations" in preset
                                       else "is weight-only", "example": "{observer: minmax | percentile}"})
        for key, value in preset.items():
            if key != "activations" and key in data and data[key] != value:
                raise PydanticCustomError("preset", "{key}: {name} sets {key}: {value}; drop {key} or the scheme",
                                          {"key": key, "name": name,
                                           "value": str(value).lower() if isinstance(value, bool) else value})
    out = {**preset, **data, "scheme": name}
    if isinstance(preset.get("activations"), dict) and isinstance(data.get("activations"), dict):
        out["activations"] = preset["activations"] | data["activations"]
    return out


def check_name(name: str | None) -> str | None:
    if name is not None and name.upper() not in SUPPORTED:
        raise PydanticCustomError("preset", "unknown preset {name} (known: {known})",
                                  {"name": repr(name), "known": ", ".join(SUPPORTED)})
    return None if name is None else name.upper()
