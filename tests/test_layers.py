"""The house as a contract: pyproject.toml's import-linter contracts (layers in data-flow order, no import circle)
hold, and the tensor-math floor names no model class."""

import re
from pathlib import Path

from importlinter.cli import lint_imports

PACKAGE = Path(__file__).resolve().parents[1] / "quantkit"


def test_import_contracts_are_kept(monkeypatch):
    monkeypatch.chdir(PACKAGE.parent)  # lint-imports reads pyproject.toml from the working directory
    assert lint_imports(no_cache=True) == 0  # its report above names each import that broke a contract


def test_the_math_floor_names_no_model_class():
    # family knowledge (norm and block classes, routers) lives in quantkit/families; algorithms/ only computes
    named = {f.name: re.findall(r"\b\w+(?:DecoderLayer|RMSNorm|ForCausalLM)\b", f.read_text())
             for f in (PACKAGE / "algorithms").glob("*.py")}
    assert not {f: names for f, names in named.items() if names}
