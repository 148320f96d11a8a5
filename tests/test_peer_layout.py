"""quantkit's compressed-tensors artifacts have the layout llm-compressor 0.14 writes for the same preset: the same
tensor names, dtypes and shapes and the same quantization_config (tests/peer_layout.py says what may differ).

One case per fixture file (tests/fixtures/peer_layouts/<family>/<preset>[_gptq].json, recorded by
benchmarks/peer_layouts.py in llm-compressor's venv): quantkit quantizes the same tiny model (the fixture's
`shapes`, loaded in its `dtype`) with the stage STAGES names for the preset, RTN or GPTQ as the peer did, and the
layouts must agree up to the differences tests/peer_layout.py documents (bfloat16 models' scale dtypes).
A scheme added later needs one STAGES entry; NOT_ON_MAIN lists the entries whose scheme main lacks yet.
"""

import json
from pathlib import Path

import pytest

from conftest import run_cli
from peer_layout import compare, documented
from tiny_models import make_tiny_model

FIXTURES = Path(__file__).parent / "fixtures" / "peer_layouts"
# preset -> (weight-stage arguments, extra top-level recipe lines). The GPTQ case runs the same arguments as a gptq
# stage with act_order: true, as llm-compressor's GPTQModifier defaults to actorder static (= weight).
STAGES = {
    "W4A16": ("{bits: 4, group_size: 128, sym: true}", ""),
    "W4A16_ASYM": ("{bits: 4, group_size: 128, sym: false}", ""),
    "W8A16": ("{bits: 8, group_size: 128, sym: true}", ""),
    "W8A8": ("{bits: 8, group_size: -1, sym: true, activations: {bits: 8, type: int, dynamic: true, strategy: token}}",
             ""),
    "FP8_DYNAMIC": ("{bits: 8, group_size: -1, sym: true, type: float, activations: {type: float}}", ""),
    "FP8": ("{scheme: FP8}", ""),
    "FP8_BLOCK": ("{scheme: FP8_BLOCK}", ""),
    "NVFP4A16": ("{scheme: NVFP4A16}", ""),
    "MXFP4A16": ("{scheme: MXFP4A16}", ""),
    "NVFP4": ("{scheme: NVFP4}", ""),
    "MXFP4": ("{scheme: MXFP4}", ""),
    "W4AFP8": ("{scheme: W4AFP8}", ""),
    "MXFP8": ("{scheme: MXFP8}", ""),
    "MXFP8A16": ("{scheme: MXFP8A16}", ""),
    "W4A16_KV_FP8": ("{bits: 4, group_size: 128, sym: true}", "kv_cache: {bits: 8, type: float, strategy: tensor}\n"),
}
# The lead removes an entry when the scheme's branch is merged.
NOT_ON_MAIN: dict[str, str] = {}
# (preset, method) -> the one line quantkit refuses the recipe with, where it deliberately does not quantize as the
# peer does (exit 2, nothing written)
FP8_RTN_ONLY = "per-channel or per-tensor FP8 is rounded to nearest: use rtn with type: float"
REFUSED = {
    ("FP8_DYNAMIC", "gptq"): FP8_RTN_ONLY, ("FP8", "gptq"): FP8_RTN_ONLY,
    # the peer's GPTQ over FP8 blocks takes actorder static; quantkit solves blocks in column order only
    ("FP8_BLOCK", "gptq"): "FP8 block weights are solved in column order; act_order: false",
    # llm-compressor writes a partial block (one [1, 1] scale for k_proj's [64, 128]); quantkit refuses a block that
    # does not tile a Linear, in one line, rather than write a scale for a block that is not there
    ("FP8_BLOCK", "rtn"): "block: [128, 128] does not tile model.layers.0.self_attn.k_proj [64, 128]",
}

CASES = sorted(f.relative_to(FIXTURES).with_suffix("").as_posix() for f in FIXTURES.glob("*/*.json"))


def recipe(path: Path, model: Path, out: Path, stage: str, extra: str, dtype: str) -> Path:
    path.write_text(f"model: {model}\ndtype: {dtype}\ndevice: cpu\n"
                    "calibration: {dataset: wikitext2, num_samples: 8, seq_len: 64, seed: 0}\n"
                    f"stages:\n  - {stage}\n{extra}export: {{output: {out}, formats: [compressed-tensors]}}\n")
    return path


@pytest.fixture(scope="module")
def peer_model(tmp_path_factory):
    made = {}

    def get(family: str, shapes: dict) -> Path:
        if family not in made:
            made[family] = make_tiny_model(tmp_path_factory.mktemp("peer") / family, family, **shapes)
        return made[family]

    return get


@pytest.mark.parametrize("case", CASES)
def test_layout_is_the_peers(case, peer_model, tmp_path, monkeypatch, capsys):
    fixture = FIXTURES / f"{case}.json"
    peer = json.loads(fixture.read_text())
    preset, method = peer["preset"], peer["method"]
    if preset not in STAGES:
        pytest.skip(f"{preset}: no quantkit scheme for this preset")
    if preset in NOT_ON_MAIN:
        pytest.skip(f"{preset}: not implemented on main yet ({NOT_ON_MAIN[preset]})")
    if not peer["accepted"]:
        pytest.skip(f"llm-compressor refused {preset} {method}: {peer['error']}")
    args, extra = STAGES[preset]
    if method == "gptq":
        args = args[:-1] + ", act_order: true}"
    out = tmp_path / "out"
    model = peer_model(peer["family"], peer["shapes"])
    path = recipe(tmp_path / "r.yaml", model, out, f"{method}: {args}", extra, peer.get("dtype", "float32"))
    code = run_cli(monkeypatch, "quantize", path, "--quiet")
    if (preset, method) in REFUSED:
        assert code == 2 and REFUSED[preset, method] in capsys.readouterr().err and not out.exists()
        return
    assert code == 0
    assert compare(out / "compressed-tensors", fixture) == documented(fixture)
