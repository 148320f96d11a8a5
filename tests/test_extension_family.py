"""A model family added from outside quantkit: a renamed tiny Llama (its own model_type, block and norm classes,
registered with transformers in this process) gets the structural fallback until a `Family` for it is registered
here; then AWQ folds through the registered family's pairs, and the artifact reloads and evaluates."""

from __future__ import annotations

import json
import math

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.models.llama import modeling_llama

from conftest import run_cli, write_recipe
from quantkit import runtime
from quantkit.families import Family, Pairs, family_of, register, supported
from quantkit.families import family as registry
from quantkit.families.llama import attention, mlp
from quantkit.families.mappings import find_mappings
from tiny_models import add_outliers, tiny_tokenizer


class KiwiConfig(LlamaConfig):
    model_type = "kiwi"


class KiwiRMSNorm(modeling_llama.LlamaRMSNorm):
    pass


class KiwiDecoderLayer(modeling_llama.LlamaDecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.input_layernorm = KiwiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KiwiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class KiwiModel(modeling_llama.LlamaModel):
    config_class = KiwiConfig

    def __init__(self, config):
        super().__init__(config)
        self.layers = nn.ModuleList(KiwiDecoderLayer(config, i) for i in range(config.num_hidden_layers))


class KiwiForCausalLM(modeling_llama.LlamaForCausalLM):
    config_class = KiwiConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = KiwiModel(config)
        self.post_init()


AutoConfig.register("kiwi", KiwiConfig, exist_ok=True)
AutoModelForCausalLM.register(KiwiConfig, KiwiForCausalLM, exist_ok=True)

FOLDED = {"input_layernorm", "self_attn.v_proj", "post_attention_layernorm", "mlp.up_proj"}  # no GQA: v -> o too
AWQ = "awq: {bits: 4, group_size: 32, zero_point: true}"
RTN = "rtn: {bits: 4, group_size: 32, sym: false}"  # the grid AWQ rounds on, unscaled


def kiwi_folder(folder):
    """A tiny Kiwi with LLM-style outlier channels in its norms (what AWQ's scales are for)."""
    tok = tiny_tokenizer()
    config = KiwiConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = add_outliers(KiwiForCausalLM(config).eval(), 6.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


calls: list[str] = []  # the blocks the registered family's mapping function was asked about


def kiwi(p: Pairs) -> None:
    """Llama's pairs, recorded."""
    calls.append(type(p.block).__name__)
    attention(p, "input_layernorm")
    mlp(p, "post_attention_layernorm")


def quantize(monkeypatch, tmp_path, folder, stage: str):
    out = tmp_path / stage.split(":")[0]
    recipe = write_recipe(tmp_path / f"{out.name}.yaml", folder, out, stage, ("compressed-tensors",), samples=16)
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 0
    return out / "compressed-tensors"


def kld(monkeypatch, tmp_path, artifact, base) -> float:
    out = tmp_path / f"{artifact.parent.name}.json"
    assert run_cli(monkeypatch, "eval", artifact, "--base", base, "--seq-len", 64, "--max-tokens", 512,
                   "--no-generation", "--cache-dir", tmp_path / "cache", "--quiet", "--json", out) == 0
    return json.loads(out.read_text())["kld"]["mean"]


def dequantized_logits(artifact, x: torch.Tensor) -> torch.Tensor:
    """The float Kiwi holding the artifact's tensors, its quantized weights dequantized here, not by the runtime."""
    cfg = json.loads((artifact / "config.json").read_text())
    qcfg = cfg.pop("quantization_config")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32).eval()
    state, qweights = runtime.quantized_state_dict(artifact, "compressed-tensors", qcfg, torch.float32)
    state |= {f"{k}.weight": q.dequantize(torch.float32) for k, q in qweights.items()}
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    with torch.no_grad():
        return model(x).logits


def test_a_family_registered_from_outside_quantizes_exports_reloads_and_evaluates(monkeypatch, tmp_path, capsys):
    folder = kiwi_folder(tmp_path / "kiwi")
    block = AutoModelForCausalLM.from_pretrained(folder).model.layers[0]

    # unregistered: the structural fallback, which does not vouch for KiwiRMSNorm
    assert family_of(block).name == ""
    mappings, notes = find_mappings(block)
    assert {m.prev_name for m in mappings} == {"self_attn.v_proj", "mlp.up_proj"}
    assert "KiwiDecoderLayer: not a known architecture; mappings were derived from module names" in notes
    assert any("KiwiRMSNorm is not known to compute" in n for n in notes)

    monkeypatch.setattr(registry, "_REGISTERED", list(registry._REGISTERED))  # registered for this test only
    kiwi_family = register(Family(name="Kiwi", model_types=("kiwi",), blocks=("KiwiDecoderLayer",),
                             norms=("KiwiRMSNorm",), mappings=kiwi))
    assert family_of(KiwiConfig()) is kiwi_family and family_of({"model_type": "kiwi"}) is kiwi_family
    assert supported().endswith("OPT, Kiwi; MoE: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3")
    mappings, notes = find_mappings(block)
    assert {m.prev_name for m in mappings} == FOLDED and notes == []
    assert not any(m.offset for m in mappings)

    capsys.readouterr()
    calls.clear()
    awq = quantize(monkeypatch, tmp_path, folder, AWQ)
    assert calls and set(calls) == {"KiwiDecoderLayer"}  # the CLI's AWQ asked the registered family
    assert "not a known architecture" not in capsys.readouterr().err

    x = torch.randint(3, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reloaded = runtime.load(str(awq), "float32").model(x).logits
    want = dequantized_logits(awq, x)
    torch.testing.assert_close(reloaded, want, rtol=0, atol=1e-5 * float(want.abs().max()))

    # folded scales that broke the float function would cost far more than RTN's rounding on the same grid
    awq_kld, rtn_kld = kld(monkeypatch, tmp_path, awq, folder), kld(monkeypatch, tmp_path,
                                                                    quantize(monkeypatch, tmp_path, folder, RTN), folder)
    assert math.isfinite(awq_kld) and 0 < awq_kld < rtn_kld, (awq_kld, rtn_kld)
