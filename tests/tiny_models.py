"""Tiny random causal LMs (Llama, Mistral, Qwen2, Qwen3, OPT) with a small BPE tokenizer trained on the
bundled WikiText-2 validation text, saved as ordinary HF folders for fast end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import torch

WIKI_VALID = Path(__file__).resolve().parents[1] / "evals" / "data" / "wikitext-2-raw" / "wiki.valid.raw"


def tiny_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = WIKI_VALID.read_text(encoding="utf-8").splitlines()[:2000]
    tok.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_config(arch: str, vocab_size: int, hidden: int = 64, layers: int = 2):
    from transformers import AutoConfig

    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=512)
    if arch == "opt":
        return AutoConfig.for_model("opt", vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                                    num_attention_heads=4, ffn_dim=2 * hidden, word_embed_proj_dim=hidden,
                                    max_position_embeddings=512)
    extra = dict(intermediate_size=2 * hidden, num_key_value_heads=2, tie_word_embeddings=True)
    if arch == "qwen3":
        extra["head_dim"] = hidden // 4
    return AutoConfig.for_model(arch, **common, **extra)


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
    """Scale OUTLIERS of every block's input and post-attention norm by factor (in place); returns model."""
    from quantkit.model import decoder_blocks

    with torch.no_grad():
        for block in decoder_blocks(model)[1]:
            for norm in (block.input_layernorm, block.post_attention_layernorm):
                norm.weight[OUTLIERS] *= factor
    return model


def save_with_outliers(src: Path, dst: Path, factor: float) -> Path:
    """Copy the HF folder src to dst with add_outliers(factor) applied to its weights."""
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    add_outliers(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), factor).save_pretrained(dst)
    return dst
