"""Compare an artifact's layout with the one llm-compressor writes for the same preset
(tests/fixtures/peer_layouts/<family>/<preset>[_gptq][_<dtype>].json, recorded by benchmarks/peer_layouts.py).

Layout = every safetensors tensor's name, dtype and shape, and the quantization_config keys a loader reads. What
quantkit may write differently is in the tables below (ALLOWED_TOP, ARG_FIELDS, DTYPES), each with its reason;
anything else that differs is reported.

| key | allowed difference | why |
| --- | --- | --- |
| args.observer, args.observer_kwargs | any | the observer's name (llm-compressor: memoryless_minmax, static_minmax; |
| | | quantkit: minmax); no loader reads it |
| sparsity_config, transform_config | absent vs {} | llm-compressor's ModelCompressor writes {} for "none"; |
| | | compressed-tensors reads absent the same |
| moe_sparsity_config | null vs absent | a field compressed-tensors 0.20 added (quantkit's); llm-compressor pins 0.19 |
| global_compression_ratio | any | a statistic, not layout |
| ignore | order | a set of module names to loaders |

Deliberate differences, asserted exactly (documented() lists them for a fixture; the test expects exactly those):

| model dtype | format | tensor | peer | quantkit | why |
| --- | --- | --- | --- | --- | --- |
| bfloat16 | pack-quantized, int-quantized | weight_scale | BF16 | F16 | quantkit's int scales are fp16-rounded (what |
| | | | | | GPTQ / Marlin kernels take); bf16 would round them again, off the grid the codes were chosen on |
| bfloat16 | float-quantized | weight_scale | BF16 | F32 | quantkit keeps FP8 scales in float32, the dtype |
| | | | | | torch._scaled_mm takes them in |

Quantization args are compared after compressed-tensors' own QuantizationArgs parses both sides, so a default it
fills in (zp_dtype, which 0.20 no longer writes when it is the default) or an alias (actorder static = weight)
is not a difference.
"""

from __future__ import annotations

import json
from pathlib import Path

ALLOWED_TOP = {"sparsity_config": ({}, None), "transform_config": ({}, None), "moe_sparsity_config": (None,),
               "global_compression_ratio": None}  # key -> the values that count as "nothing" (None: any value)
ARG_FIELDS = ("num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic", "actorder",
              "scale_dtype", "zp_dtype")  # observer / observer_kwargs left out: see the table above
SCHEME_PARTS = ("weights", "input_activations", "output_activations")
# (model dtype, quantization_config.format) -> {tensor suffix: the dtype quantkit writes}: the second table above
DTYPES = {("bfloat16", "pack-quantized"): {"weight_scale": "F16"},
          ("bfloat16", "int-quantized"): {"weight_scale": "F16"},
          ("bfloat16", "float-quantized"): {"weight_scale": "F32"}}


def safetensors_layout(folder: Path) -> dict[str, list]:
    """name -> [dtype, shape] from every safetensors header in folder (benchmarks/peer_layouts.py records the same)."""
    tensors = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        tensors |= {k: [v["dtype"], v["shape"]] for k, v in header.items() if k != "__metadata__"}
    return tensors


def _args(d: dict | None) -> dict | None:
    if d is None:
        return None
    from compressed_tensors.quantization import ActivationOrdering, QuantizationArgs

    # the parsed fields, defaults filled in (zp_dtype); enums are kept as their values, actorder's alias resolved
    a = {f: getattr(QuantizationArgs.model_validate(d), f) for f in ARG_FIELDS}
    a["actorder"] = ActivationOrdering.get_aliases().get(a["actorder"], a["actorder"])  # static = weight
    return {f: str(getattr(v, "value", v)) for f, v in a.items()}


def _diff_args(where: str, ours: dict | None, peer: dict | None) -> list[str]:
    a, b = _args(ours), _args(peer)
    if a is None or b is None:
        return [] if a is b else [f"{where}: {'absent' if a is None else 'present'} (peer: "
                                  f"{'absent' if b is None else 'present'})"]
    return [f"{where}.{k}: {a[k]} (peer: {b[k]})" for k in ARG_FIELDS if a[k] != b[k]]


def _groups(qcfg: dict) -> dict[tuple, dict]:
    # config groups are matched by their targets: the group names (group_0 ...) are arbitrary
    return {tuple(sorted(g.get("targets") or [])): g for g in (qcfg.get("config_groups") or {}).values()}


def compare_config(ours: dict, peer: dict) -> list[str]:
    out = []
    for key in sorted((set(ours) | set(peer)) - {"config_groups", "ignore", "kv_cache_scheme", "version"}):
        if key in ALLOWED_TOP:
            nothing = ALLOWED_TOP[key]
            if nothing is None or (ours.get(key) in nothing and peer.get(key) in nothing):
                continue
        if ours.get(key, "<absent>") != peer.get(key, "<absent>"):
            out.append(f"quantization_config.{key}: {ours.get(key, '<absent>')!r} "
                       f"(peer: {peer.get(key, '<absent>')!r})")
    mine, theirs = sorted(ours.get("ignore") or []), sorted(peer.get("ignore") or [])
    if mine != theirs:
        out.append(f"quantization_config.ignore: {mine} (peer: {theirs})")
    out += _diff_args("quantization_config.kv_cache_scheme", ours.get("kv_cache_scheme"), peer.get("kv_cache_scheme"))
    mine, theirs = _groups(ours), _groups(peer)
    if set(mine) != set(theirs):
        return out + [f"quantization_config.config_groups targets: {sorted(mine)} (peer: {sorted(theirs)})"]
    for targets, g in mine.items():
        where = f"quantization_config.config_groups[{','.join(targets)}]"
        if g.get("format") != theirs[targets].get("format"):
            out.append(f"{where}.format: {g.get('format')} (peer: {theirs[targets].get('format')})")
        for part in SCHEME_PARTS:
            out += _diff_args(f"{where}.{part}", g.get(part), theirs[targets].get(part))
    return out


def compare_tensors(ours: dict[str, list], peer: dict[str, list]) -> list[str]:
    out = [f"missing tensor {k} {peer[k]}" for k in sorted(set(peer) - set(ours))]
    out += [f"extra tensor {k} {ours[k]}" for k in sorted(set(ours) - set(peer))]
    return out + [f"tensor {k}: {ours[k]} (peer: {peer[k]})" for k in sorted(set(ours) & set(peer))
                  if ours[k] != peer[k]]


def compare(artifact_dir, fixture_path) -> list[str]:
    """Every layout difference between the artifact folder and the peer's recorded layout; [] when they agree."""
    peer = json.loads(Path(fixture_path).read_text())
    if not peer["accepted"]:
        raise ValueError(f"{fixture_path}: llm-compressor refused this preset ({peer['error']}): nothing to compare")
    qcfg = json.loads((Path(artifact_dir) / "config.json").read_text()).get("quantization_config") or {}
    return compare_config(qcfg, peer["quantization_config"]) + compare_tensors(
        safetensors_layout(Path(artifact_dir)), peer["tensors"])


def documented(fixture_path) -> list[str]:
    """The differences compare() reports for a quantkit artifact of this fixture's preset that DTYPES documents."""
    peer = json.loads(Path(fixture_path).read_text())
    ours = DTYPES.get((peer.get("dtype", "float32"), peer["quantization_config"].get("format")), {})
    return [f"tensor {k}: {[ours[suffix], shape]} (peer: {[dtype, shape]})"
            for k, (dtype, shape) in sorted(peer["tensors"].items())
            if (suffix := k.rpartition(".")[2]) in ours and ours[suffix] != dtype]
