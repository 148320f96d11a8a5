"""vLLM as the engine that measures an artifact: quantkit drives it in a worker process (workers/vllm_serve.py)
under the interpreter of vLLM's own environment, which pins its own transformers and compressed-tensors.

The interpreter comes from --vllm-python or $QUANTKIT_VLLM_PYTHON (`make vllm-env` builds one). The worker runs vLLM
in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) in a session of its own, so closing it leaves nothing behind; a model
vLLM refuses, a worker that dies, or one that gives no reply within $QUANTKIT_VLLM_TIMEOUT seconds (default 3600: a
big model's load, or a long bench, takes minutes), ends with one line naming the reason.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import tempfile
from pathlib import Path

import torch

from ..errors import QuantkitError
from ..export import formats
from ..families import family_of
from ..untrusted import check_config, check_model

# run as a script under vLLM's interpreter, from a folder with no module named like a package it imports
WORKER = Path(__file__).parent / "workers" / "vllm_serve.py"
TIMEOUT_S = 3600
HOW = "pass --vllm-python or set QUANTKIT_VLLM_PYTHON to a venv's python with vLLM (make vllm-env builds one)"


def interpreter(option: str | None, what: str = "--engine vllm") -> str:
    """vLLM's python: --vllm-python, else $QUANTKIT_VLLM_PYTHON; what: the option or field that asked for vLLM."""
    python = option or os.environ.get("QUANTKIT_VLLM_PYTHON")
    if not python:
        raise QuantkitError(f"{what}: no vLLM environment; {HOW}")
    if not os.access(python, os.X_OK):
        source = "--vllm-python" if option else "QUANTKIT_VLLM_PYTHON"
        raise QuantkitError(f"{source}: {python} is not an executable interpreter; {HOW}")
    return python


def served_config(path: str, what: str) -> dict:
    """The config.json of a folder vLLM can serve (an artifact or an HF checkpoint; not a GGUF file, not a hub id)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise QuantkitError(f"{what}: vLLM serves a folder with a config.json (a quantkit artifact or an HF "
                            f"checkpoint); {path} is not one")
    check_model(path, None)  # its config.json, index and safetensors headers, before vLLM reads any of them
    return check_config(cfg)


def int8_activations(config: dict) -> bool:
    """Whether config.json's quantized Linears take int8 inputs (W8A8 int8)."""
    groups = (config.get("quantization_config") or {}).get("config_groups", {})
    acts = [g.get("input_activations") for g in groups.values() if isinstance(g, dict)]
    return any(a and a.get("type") == "int" for a in acts)


def serving_dtype(config: dict) -> str:
    """The dtype vLLM's CPU kernels serve a model's config.json in: W4A16 in float16 (vLLM refuses float32 for
    it, and bfloat16 drifts); W8A8 int8 in bfloat16, as its int8 GEMM has no float16 path; float16 elsewhere,
    except the families vLLM refuses float16 for."""
    return "bfloat16" if int8_activations(config) or not family_of(config).vllm_float16 else "float16"


# vLLM's x86 CPU wheel has three kernel libraries; only the AVX-512 ones hold cpu_gemm_wna16 (platforms/cpu.py)
NO_WNA16 = ("vLLM's CPU build has no kernel for weight-only integer formats (gptq, awq, compressed-tensors W4A16) "
            "on this CPU: cpu_gemm_wna16 is only in its AVX-512 extensions, and this CPU has AVX2")

# vLLM 0.32's CPU weight-only kernels (CPUWNA16, zentorch) take uint4 / uint4b8 only: an 8-bit weight-only Linear
# fails its kernel choice ("Failed to find a kernel that can implement the WNA16 linear layer ... uint8b128"), measured
# on this AVX2 EPYC for W8A16 and for a mixed W4 / W8 compressed-tensors artifact; the code refuses it (and 2 / 3
# bits, which its CUDA build runs on the humming kernel) on any CPU
ONLY_4BIT = ("vLLM's CPU build has no kernel for weight-only integer weights other than 4-bit (W8A16, W3A16, W2A16, "
             "or such groups of a mixed-precision artifact): its CPU weight-only kernels take 4-bit weights only")

# An FP8 KV cache (compressed-tensors kv_cache_scheme) is served with kv_cache_dtype fp8, which the x86 CPU build
# runs only with AVX-512; on AVX2 vLLM would keep a 16-bit cache (or stop), and measure something else than the artifact
NO_FP8_KV = ("the artifact has an FP8 KV cache (kv_cache_scheme), and vLLM's CPU build runs an fp8 KV cache only "
             "with AVX-512; this CPU has AVX2")
# vLLM's CPU platform has no FP4 linear method (its NVFP4 / MXFP4 schemes are CUDA kernels: Marlin, CUTLASS)
NO_FP4 = ("vLLM's CPU build has no kernel for FP4 weights (NVFP4, NVFP4A16, MXFP4, MXFP4A16): its FP4 schemes run "
          "on CUDA GPUs only; quantkit's runtime runs them (dequantized)")

# vLLM's W4AFP8 scheme (CompressedTensorsW4A8Fp8) is taken on SM90 GPUs only; measured on this AVX2 CPU (vLLM 0.32):
# "NotImplementedError: No compressed-tensors compatible scheme was found" for the int-quantized int4 + FP8 layer
NO_W4AFP8 = ("vLLM's CPU build finds no scheme for W4AFP8 (int4 weights, FP8 inputs): its W4A8-FP8 GEMM is a "
             "Hopper GPU kernel; quantkit's runtime runs it (emulated)")

# vLLM's MXFP8 linear kernels are registered for CUDA and ROCm only (kernels/linear _POSSIBLE_MXFP8_KERNELS)
NO_MXFP8 = ("vLLM's CPU build has no kernel for MXFP8 weights (MXFP8A16, MXFP8): its MXFP8 GEMMs are GPU kernels; "
            "quantkit's runtime runs them (emulated)")

# measured: a 64-long dot product of 127s gives 8160 instead of 1 032 256 on an AVX2 EPYC (workers/vllm_serve.py)
INT8_INEXACT = ("vLLM's int8 GEMM on this CPU (oneDNN without VNNI) sums pairs of int8 products in int16, which "
                "saturates: these W8A8 measurements are this machine's, worse than on a server with VNNI or a GPU")


# vLLM's CPU MoE kernel for int4 experts (CPUExpertsInt4, fused_moe/experts/cpu_moe.py) computes with int8
# activations whatever VLLM_CPU_INT4_W4A8 says; measured on tiny Qwen3-MoE / Mixtral W4A16 (float16) against
# quantkit's runtime on the same artifact: KLD 1.4e-5 .. 1.6e-4, greedy tokens 70-78 %, where dense W4A16 agrees to
# KLD < 1e-6 and 92 %
MOE_W4A8 = ("vLLM's CPU MoE kernel for int4 experts (CPUExpertsInt4) quantizes the experts' inputs to int8 per token "
            "(INT4_W4A8): these measurements are of W4A8 experts, not of the artifact's W4A16 alone")
# On an AMX CPU, vLLM runs a dense W4A16 Linear in bfloat16 as W4A8 unless VLLM_CPU_INT4_W4A8=0 (mixed_precision/
# cpu.py): SmolLM2 GPTQ W4 g64 in bfloat16 gave ppl +3.7 %, KLD 0.028 against quantkit's runtime on the same
# artifact, and ppl -0.1 %, KLD 1.0e-3 with it off. The worker turns it off, so vLLM measures the artifact as written.
W4A8_ENV = "VLLM_CPU_INT4_W4A8"
W4A8 = ("VLLM_CPU_INT4_W4A8 is set: vLLM runs this W4A16 artifact in bfloat16 on AMX as W4A8, activations "
        "quantized to int8 per token; these measurements are of that, not of the artifact as written")


# vLLM's CPU build runs FP8 W8A8 per channel with dynamic per-token inputs only: its block-scaled FP8 GEMM
# (FP8_BLOCK) has no CPU kernel but the AMX one, and its static per-tensor FP8 input quant op is a stub on CPU
NO_FP8_BLOCK = ("vLLM's CPU build has no kernel for FP8 block weights (FP8_BLOCK) on this CPU: its block-scaled FP8 "
                "GEMM needs AMX, and this CPU has none")
NO_FP8_STATIC = ("vLLM's CPU build cannot run static FP8 input scales (the FP8 preset): its per-tensor static FP8 "
                 "quant op is not implemented on CPU")


def fp8_layout(config: dict) -> str | None:
    """'block' or 'static' where config.json's quantized Linears are FP8 with block weights or static input scales
    (the layouts vLLM's CPU build lacks kernels for), else None."""
    groups = (config.get("quantization_config") or {}).get("config_groups", {})
    for g in (g for g in groups.values() if isinstance(g, dict)):
        w, a = g.get("weights") or {}, g.get("input_activations") or {}
        if w.get("type") == "float" and w.get("strategy") == "block":
            return "block"
        if a.get("type") == "float" and a.get("dynamic") is False:
            return "static"
    return None


def fp8_kv_cache(config: dict) -> bool:
    """Whether config.json's checkpoint carries an FP8 KV cache's k / v scales (served with kv_cache_dtype fp8)."""
    kv = (config.get("quantization_config") or {}).get("kv_cache_scheme")
    return isinstance(kv, dict) and kv.get("type") == "float" and kv.get("num_bits") == 8


def moe(config: dict) -> bool:
    """Whether config.json describes a mixture-of-experts model (Qwen2/3-MoE, OLMoE, Mixtral, DeepSeek)."""
    return any((config.get(k) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def fp4_weights(config: dict) -> bool:
    """Whether config.json's quantized Linears hold FP4 (e2m1) weights."""
    groups = (config.get("quantization_config") or {}).get("config_groups", {})
    return any(isinstance(g, dict) and (g.get("weights") or {}).get("type") == "float"
               and (g.get("weights") or {}).get("num_bits") == 4 for g in groups.values())


def w4afp8(config: dict) -> bool:
    """Whether config.json's quantized Linears hold int4 weights with FP8 inputs (W4AFP8)."""
    groups = (config.get("quantization_config") or {}).get("config_groups", {})
    return any(isinstance(g, dict) and (g.get("weights") or {}).get("type") == "int"
               and (g.get("weights") or {}).get("num_bits") == 4
               and (g.get("input_activations") or {}).get("type") == "float" for g in groups.values())


def mxfp8_weights(config: dict) -> bool:
    """Whether config.json's quantized Linears hold MXFP8 weights (e4m3, e8m0 scales per 32 columns)."""
    groups = (config.get("quantization_config") or {}).get("config_groups", {})
    return any(isinstance(g, dict) and (g.get("weights") or {}).get("type") == "float"
               and (g.get("weights") or {}).get("num_bits") == 8 and (g.get("weights") or {}).get("group_size") == 32
               and "uint8" in str((g.get("weights") or {}).get("scale_dtype")) for g in groups.values())


def weight_only_int(config: dict) -> bool:
    """Whether vLLM's CPU build runs config.json's quantized Linears with cpu_gemm_wna16: gptq, awq, and
    compressed-tensors groups of integer weights whose inputs stay unquantized."""
    qc = config.get("quantization_config") or {}
    fmt = formats.find(qc.get("quant_method"))
    return fmt is not None and fmt.weight_only_int(qc)


def weight_only_bits(config: dict) -> set[int]:
    """The widths of config.json's weight-only integer weights: each compressed-tensors group's, or gptq / awq's (and
    gptq's `dynamic` rules')."""
    qc = config.get("quantization_config") or {}
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    if groups:
        return {int((g.get("weights") or {}).get("num_bits") or 0) for g in groups
                if (g.get("weights") or {}).get("type") == "int" and not g.get("input_activations")}
    if not weight_only_int(config):
        return set()
    dynamic = qc.get("dynamic") if isinstance(qc.get("dynamic"), dict) else {}
    return {int(qc.get("bits") or 4), *(int(rule["bits"]) for pattern, rule in dynamic.items()
                                        if not pattern.startswith("-:") and isinstance(rule, dict) and "bits" in rule)}


class VllmEngine:
    """A vLLM worker that serves one model at a time: `with VllmEngine(python) as engine: engine.load(...)`. One
    worker serves several models in turn; vLLM's import is most of a start (~10 s against ~3 s per tiny model)."""

    def __init__(self, python: str):
        self.python = python
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self._kernels: dict = {}

    def __enter__(self) -> "VllmEngine":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="quantkit-vllm-")
        self.log = open(Path(self.tmp.name) / "worker.log", "w+")
        self.env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE":
                                 os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), "TOKENIZERS_PARALLELISM": "false",
                                 W4A8_ENV: os.environ.get(W4A8_ENV, "0")}
        self.proc = subprocess.Popen([self.python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=self.env, start_new_session=True)

    def load(self, model: str, dtype: str, max_model_len: int, max_logprobs: int = 20,
             max_num_seqs: int = 16) -> dict:
        """Serves `model` (a folder) from now on; returns vLLM's version, its quantization method and dtype, and a
        `warning` where this CPU's kernels make the measurements worse than a server's."""
        path = Path(model) / "config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        if fp4_weights(config):
            raise QuantkitError(f"vllm: cannot serve {model}: {NO_FP4}")
        if weight_only_bits(config) - {4} and self.kernels()["device"] == "cpu":
            raise QuantkitError(f"vllm: cannot serve {model}: {ONLY_4BIT}")
        for refused, why in ((w4afp8, NO_W4AFP8), (mxfp8_weights, NO_MXFP8)):
            if refused(config) and self.kernels()["device"] == "cpu":
                raise QuantkitError(f"vllm: cannot serve {model}: {why}")
        if weight_only_int(config) and not self.has_wna16():
            raise QuantkitError(f"vllm: cannot serve {model}: {NO_WNA16}")
        refused = self.fp8_refusal(fp8_layout(config))
        if refused:
            raise QuantkitError(f"vllm: cannot serve {model}: {refused}")
        kv = fp8_kv_cache(config)
        if kv and self.kernels()["device"] == "cpu" and not self.kernels().get("avx512"):
            raise QuantkitError(f"vllm: cannot serve {model}: {NO_FP8_KV}")
        self.info = self._call({"op": "load", "model": str(Path(model).resolve()), "dtype": dtype,
                                "max_model_len": max_model_len, "max_logprobs": max_logprobs,
                                "max_num_seqs": max_num_seqs, "kv_cache_dtype": "fp8" if kv else "auto"},
                               f"vLLM refused {model}")
        if int8_activations(config) and self.kernels().get("int8_exact") is False:
            self.info["warning"] = INT8_INEXACT
        elif weight_only_int(config) and self.kernels()["device"] == "cpu":
            if moe(config):
                self.info["warning"] = MOE_W4A8
            elif dtype == "bfloat16" and self.kernels().get("amx") and self.env[W4A8_ENV] != "0":
                self.info["warning"] = W4A8
        return self.info

    def kernels(self) -> dict:
        """vLLM's device type and, on a CPU, what its kernels can do here (workers/vllm_serve.py `kernels`)."""
        if not self._kernels:
            self._kernels = {k: v for k, v in self._call({"op": "kernels"}, "kernels").items() if k != "ok"}
        return self._kernels

    def fp8_refusal(self, layout: str | None) -> str | None:
        """Why this machine's vLLM build cannot run an FP8 layout (fp8_layout), or None (always None off the CPU)."""
        if layout is None or self.kernels()["device"] != "cpu":
            return None
        if layout == "block":
            return None if self.kernels().get("amx") else NO_FP8_BLOCK
        return NO_FP8_STATIC

    def has_wna16(self) -> bool:
        """Whether this machine's vLLM build can serve weight-only integer formats (always, off the CPU)."""
        return self.kernels()["device"] != "cpu" or self.kernels()["wna16"]

    def close(self, wait_s: float = 30) -> None:
        """Ends the worker: stdin closed, `wait_s` for it to leave, then its whole session is killed."""
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=wait_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
            try:  # the worker's session: vLLM's own helpers too
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None
            self.log.close()
            self.tmp.cleanup()

    def _call(self, request: dict, what: str) -> dict:
        timeout = float(os.environ.get("QUANTKIT_VLLM_TIMEOUT", TIMEOUT_S))
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            # one reply line per request, read whole: nothing waits in stdout's buffer while select() looks
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            if not ready:
                last = self._last_error()
                self.close(wait_s=0)
                raise QuantkitError(f"vllm: the worker gave no reply to {request['op']} within {timeout:g} s and was "
                                    f"stopped (set QUANTKIT_VLLM_TIMEOUT to wait longer); its last line: {last}")
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            code = self.proc.wait()
            raise QuantkitError(f"vllm: the worker died (exit code {code}) during {request['op']}: {self._last_error()}")
        reply = json.loads(line)
        if "error" in reply:
            raise QuantkitError(f"vllm: {what}: {reply['error']}")
        return reply

    def _last_error(self) -> str:
        self.log.flush()
        self.log.seek(0)
        lines = [x.strip() for x in self.log.read().splitlines() if x.strip()]
        errors = [x for x in lines if "Error" in x or "error" in x]
        return (errors or lines or ["no output"])[-1][-300:]

    def prompt_logprobs(self, windows: torch.Tensor, top_k: int) -> list[dict[str, torch.Tensor]]:
        """windows [n, seq_len] token ids -> per window topk_idx / topk_logp [seq_len-1, k], target_logp."""
        src, out = Path(self.tmp.name) / "windows.pt", Path(self.tmp.name) / "logprobs.pt"
        torch.save(windows.cpu(), src)
        self._call({"op": "prompt_logprobs", "windows": str(src), "top_k": top_k, "out": str(out)},
                   "prompt log-probs")
        result = torch.load(out)
        out.unlink()
        return result

    def bench(self, concurrency: list[int], prompt_len: int, gen_len: int, reps: int) -> dict:
        return self._call({"op": "bench", "concurrency": concurrency, "prompt_len": prompt_len, "gen_len": gen_len,
                           "reps": reps}, "bench")

    def generate(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False) -> list[list[int]]:
        return self._call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens, "ignore_eos": ignore_eos},
                          "generation")["tokens"]

    def tasks(self, model: str, dtype: str, max_model_len: int, names: list[str], limit: int | None,
              num_fewshot: int | None, batch_size: int) -> dict:
        """lm-eval `names` on `model` through lm-eval's vLLM model type, with quantkit's task definitions
        (lm_eval_tasks.py) and bundled data. It ends the served model: load another one after it."""
        from .. import lm_eval_tasks
        from ..data import BUNDLED

        return self._call({"op": "tasks", "model": str(Path(model).resolve()), "dtype": dtype,
                           "max_model_len": max_model_len, "batch_size": batch_size, "tasks": names, "limit": limit,
                           "num_fewshot": num_fewshot, "task_module": lm_eval_tasks.__file__, "data": str(BUNDLED)},
                          f"lm-eval tasks {names}")
