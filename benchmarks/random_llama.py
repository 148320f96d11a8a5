"""A random-weight model with Llama-3-8B's shapes, written as an HF folder, for speed benchmarks that need no
download (decode speed does not depend on the weights' values).

    python benchmarks/random_llama.py OUT_DIR [--layers 32] [--device cuda] [--smoke]

--smoke shrinks every dimension (hidden 256, vocab 1024) to check the suite's plumbing on a CPU.

Weights are drawn N(0, 0.02) on the device in bfloat16 (norms 1); the tokenizer is a 3-token placeholder the
loaders need (the bench feeds random token ids)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def llama3_8b_config(layers: int, smoke: bool = False):
    from transformers import LlamaConfig

    dims = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=128256)
    if smoke:
        dims = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=1024)
    return LlamaConfig(**dims, num_hidden_layers=layers, max_position_embeddings=8192, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def placeholder_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    from transformers import LlamaForCausalLM
    from transformers.initialization import no_init_weights

    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(args.device), no_init_weights():
        model = LlamaForCausalLM(llama3_8b_config(args.layers, args.smoke)).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    out = Path(args.out)
    model.save_pretrained(out, max_shard_size="5GB")
    placeholder_tokenizer().save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"random {'smoke-test' if args.smoke else 'Llama-3-8B-shaped'} model ({n / 1e9:.2f} B parameters, {args.layers} layers) -> {out} "
          f"in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
