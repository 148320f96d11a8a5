"""Text sources for calibration and evaluation: the bundled WikiText-2 splits or a user's file."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import QuantkitError

BUNDLED = Path(__file__).resolve().parents[1] / "evals" / "data"
ALIASES = {  # name -> (calibration split, evaluation split)
    "wikitext2": ("wikitext-2-raw/wiki.valid.raw", "wikitext-2-raw/wiki.test.raw"),
}


def resolve(dataset: str, purpose: str, field: str) -> Path:
    """`purpose` is 'calibration' or 'eval'; `field` names the option for error messages."""
    if dataset in ALIASES:
        path = BUNDLED / ALIASES[dataset][0 if purpose == "calibration" else 1]
        if not path.is_file():
            raise QuantkitError(f"{field}: bundled data missing at {path} (run from a full quantkit checkout)")
        return path
    path = Path(dataset).expanduser()
    if not path.is_file():
        raise QuantkitError(
            f"{field}: file not found: {dataset} (expected wikitext2 or a .txt/.raw/.jsonl/.parquet file)"
        )
    return path


def wikitext_rows_text(raw: str) -> str:
    """The GPTQ-style evaluation text of a WikiText raw file: the HF rows (line i, blank lines as "")
    joined with "\\n\\n", which is what `"\\n\\n".join(load_dataset(...)["text"])` gives."""
    rows = [line + "\n" if line.strip() else "" for line in raw.split("\n")[:-1]]
    return "\n\n".join(rows)


def read_text(path: Path, text_field: str = "text", field: str = "dataset") -> str:
    suffix = path.suffix.lower()
    if suffix == ".raw":
        text = wikitext_rows_text(path.read_text(encoding="utf-8"))
    elif suffix == ".txt":
        text = path.read_text(encoding="utf-8")
    elif suffix == ".jsonl":
        docs = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise QuantkitError(f"{field}: {path} line {i} is not valid JSON") from None
            if not isinstance(row, dict) or text_field not in row:
                raise QuantkitError(f"{field}: {path} line {i} has no field '{text_field}' (set text_field)")
            docs.append(str(row[text_field]))
        text = "\n\n".join(docs)
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise QuantkitError(f"{field}: reading .parquet needs pyarrow (pip install pyarrow)") from None
        table = pq.read_table(path)
        if text_field not in table.column_names:
            raise QuantkitError(f"{field}: {path} has no column '{text_field}' (columns: {table.column_names})")
        text = "\n\n".join(str(x) for x in table.column(text_field).to_pylist())
    else:
        raise QuantkitError(f"{field}: unsupported file type '{suffix}' for {path} (use .txt, .raw, .jsonl, .parquet)")
    if not text.strip():
        raise QuantkitError(f"{field}: {path} contains no text")
    return text
