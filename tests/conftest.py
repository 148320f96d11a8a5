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
