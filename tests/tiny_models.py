"""Tiny random causal LMs of every supported family (dense and mixture-of-experts) with a small BPE tokenizer
trained on the bundled WikiText-2 validation text, saved as ordinary HF folders for fast end-to-end tests."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

WIKI_VALID = Path(__file__).resolve().parents[1] / "evals" / "data" / "wikitext-2-raw" / "wiki.valid.raw"


@functools.lru_cache(maxsize=None)
def _trained_tokenizer(vocab_size: int) -> str:
    """A byte-level BPE trained on WikiText-2 lines, as JSON: trained once per session (seconds), copied per model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = WIKI_VALID.read_text(encoding="utf-8").splitlines()[:2000]
    tok.train_from_iterator(lines, trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained_tokenizer(vocab_size)),
                                   unk_token="<unk>", bos_token="<s>", eos_token="</s>")


MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
FAMILY_EXTRA = {  # per model_type, on top of the common tiny shape; MoE models get 8 experts, top-2
    "llama": {}, "mistral": {}, "qwen2": {},
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(MOE, num_experts=8, head_dim=16),
    "qwen2_moe": dict(MOE, num_experts=8, shared_expert_intermediate_size=64),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32),
    # MLA attention (low-rank q / kv with their norms), one dense layer first, shared experts
    "deepseek_v3": dict(MOE, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                        topk_group=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=16, head_dim=8),
    "gemma2": dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=16),
    "gemma3_text": dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=16),
    "phi3": dict(pad_token_id=0),
    "granite": dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.25,
                    logits_scaling=2.0),
    "olmo2": {},
}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3")


# The widths of the peer-layout fixtures (tests/fixtures/peer_layouts, benchmarks/peer_layouts.py): every Linear's
# in_features a multiple of 128, so each preset's group / block divides it (quantkit refuses a group that does not;
# llm-compressor writes one short group for a layer narrower than it), otherwise the tiny shape above.
PEER_SHAPES = {"llama": dict(hidden=128), "qwen3_moe": dict(hidden=128, head_dim=32, moe_intermediate_size=128)}


def tiny_config(arch: str, vocab_size: int, hidden: int = 64, layers: int = 2, **overrides):
    from transformers import AutoConfig

    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=512)
    if arch == "opt":
        return AutoConfig.for_model("opt", vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                                    num_attention_heads=4, ffn_dim=2 * hidden, word_embed_proj_dim=hidden,
                                    max_position_embeddings=512)
    extra = dict(intermediate_size=2 * hidden, num_key_value_heads=2, tie_word_embeddings=True)
    extra |= FAMILY_EXTRA[arch] | overrides
    config = AutoConfig.for_model(arch, **common, **extra)
    config._experts_implementation = "eager"  # the reference loop quantkit's per-expert Linears reproduce exactly
    return config


def make_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, **kw) -> Path:
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tok), **kw), dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


OUTLIERS = [3, 17, 40]  # hidden channels whose norm weights add_outliers scales: LLM-style activation outliers


def add_outliers(model, factor: float):
    """Scale OUTLIERS of every block-level norm (input, post-attention, Gemma's pre/post-feedforward ...) by factor
    (in place; Gemma's (1 + weight) norms through their offset); returns model."""
    from quantkit.model import decoder_blocks

    with torch.no_grad():
        for block in decoder_blocks(model)[1]:
            for name, norm in block.named_children():
                if "norm" not in name:
                    continue
                if type(norm).__name__.startswith("Gemma"):
                    norm.weight[OUTLIERS] = (1 + norm.weight[OUTLIERS]) * factor - 1
                else:
                    norm.weight[OUTLIERS] *= factor
    return model


def save_with_outliers(src: Path, dst: Path, factor: float) -> Path:
    """Copy the HF folder src to dst with add_outliers(factor) applied to its weights."""
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    add_outliers(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), factor).save_pretrained(dst)
    return dst


# Shapes vLLM's CPU kernels serve (hidden 256, head_dim 64, 2 layers), per family: vLLM's Gemma always ties its
# head, as the released models do; MoE ones with 8 experts, top-2, expert width 256.
SERVABLE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, intermediate_size=512, tie_word_embeddings=False)
SERVABLE_EXTRA = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": dict(head_dim=64), "granite": dict(residual_multiplier=0.5),
    "gemma2": dict(head_dim=64, query_pre_attn_scalar=64, tie_word_embeddings=True),
    "gemma3_text": dict(head_dim=64, query_pre_attn_scalar=64, tie_word_embeddings=True),
    "phi3": dict(pad_token_id=0), "olmo2": {},
    "qwen3_moe": dict(head_dim=64, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2),
    "mixtral": dict(intermediate_size=256, num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(intermediate_size=256, num_experts=8, num_experts_per_tok=2),
}


def make_servable_model(folder: Path, arch: str) -> Path:
    """A random model of `arch` in a shape vLLM serves, its weights x2 the init's: peaked next-token
    distributions, so greedy tokens are well separated and a wrong weight shows in the perplexity."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, vocab_size=len(tok), **(SERVABLE | SERVABLE_EXTRA[arch]))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(2.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
