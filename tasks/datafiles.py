"""Reading user data files (JSON, JSONL, Parquet, CSV) into rows, and the real benchmarks' column layouts.

Every mistake gets an error that names the file, what was expected and what was found.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from grom_core.data import read_jsonl
from grom_core.errors import DataError
from tasks.records import example_sha256

SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")

# The column layouts of the real benchmarks' files (as their Hugging Face datasets publish them).
LAYOUTS: dict[str, dict[str, tuple[str, ...]]] = {
    "qa_or_text": {"qa": ("question", "answer"), "text": ("text",)},
    "tofu_eval": {"tofu": ("question", "answer", "perturbed_answer")},
    "muse_text": {"text": ("text",)},
    "muse_knowmem": {"qa": ("question", "answer")},
    "muse_verbmem": {"verbmem": ("prompt", "gt")},
    "wmdp": {"mc": ("question", "choices", "answer")},
}


def _read_json(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8-sig")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return read_jsonl(path)  # TOFU ships JSON lines under a .json suffix
    if isinstance(data, dict):
        for key in ("data", "rows", "train", "examples"):
            if isinstance(data.get(key), list):
                return data[key]
        return [data]  # a single row (also what a one-line JSON lines file looks like)
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of rows")
    return data


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for a broken file
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from exc


def _read_csv(path: Path) -> list[dict]:
    # utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark, which would otherwise join the first column's name
    with path.open(newline="", encoding="utf-8-sig") as handle:
        return list(csv.DictReader(handle))


def check_data_file(path: Path) -> None:
    """A regular file that can be read, or an error that says what `path` is instead (a folder, a pipe, nothing)."""
    import stat

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise DataError(f"data file {path} does not exist") from None
    except OSError as exc:
        raise DataError(f"data file {path} cannot be read ({exc.strerror})") from exc
    if stat.S_ISDIR(mode):
        raise DataError(f"data file {path} is a folder, not a file; give the path of a JSON, JSONL, Parquet or CSV "
                        f"file inside it")
    if not stat.S_ISREG(mode):
        raise DataError(f"data file {path} is not a regular file (a pipe, socket or device); save the data to a file "
                        f"and give that")


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a JSON (list or JSON lines), JSONL, Parquet or CSV file, as dicts."""
    path = Path(path)
    check_data_file(path)
    suffix = path.suffix.lower()
    readers = {".json": _read_json, ".jsonl": read_jsonl, ".parquet": _read_parquet, ".csv": _read_csv}
    if suffix not in readers:
        raise DataError(f"{path}: unsupported file type '{suffix}'; use one of {', '.join(SUFFIXES)}")
    try:
        rows = readers[suffix](path)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text; save it as UTF-8") from exc
    if not all(isinstance(r, dict) for r in rows):
        raise DataError(f"{path}: every row must be an object with named columns")
    return rows


def check_layout(rows: list[dict], layout: str, path: str | Path = "data") -> str:
    """Which variant of `layout` the rows follow; a clear error listing the expected columns otherwise."""
    if not rows:
        raise DataError(f"{path} holds no rows")
    variants = LAYOUTS[layout]
    found = sorted(rows[0])
    for variant, columns in variants.items():
        if all(c in rows[0] for c in columns):
            for number, row in enumerate(rows, start=1):
                missing = [c for c in columns if c not in row or row[c] is None or row[c] == ""]
                if missing:
                    raise DataError(f"{path}: row {number} has no value for {missing}")
            return variant
    expected = " or ".join(str(list(c)) for c in variants.values())
    raise DataError(f"{path}: columns {found} do not match the {layout} layout; expected {expected}")


def _filled(row: dict, column: str) -> bool:
    value = row.get(column)
    return value is not None and not (isinstance(value, str) and not value.strip())


def _string(path, number: int, row: dict, column: str) -> str:
    """The cell as text, or an error: a number, a list or an object is not silently turned into its repr."""
    value = row[column]
    if isinstance(value, str):
        return value
    hint = (" (a column-oriented file? give one object per row: {\"question\": ..., \"answer\": ...})"
            if isinstance(value, list) else "")
    raise DataError(f"{path}: row {number}: '{column}' is {type(value).__name__} {str(value)[:40]!r}, not text; "
                    f"every question, answer and text must be a string{hint}")


def read_examples(path: str | Path) -> list[dict]:
    """QA pairs ({question, answer}) and texts ({text}) for training and unlearning, validated. Each row is one or
    the other, and a file may hold both (a retain set of facts and of general prose, like minirwku's). A QA row may
    name its `subject` (the editors key their update at its last token; see grom_core.data.Example)."""
    rows = read_rows(path)
    if not rows:
        raise DataError(f"{path} holds no rows")
    examples = []
    for number, row in enumerate(rows, start=1):
        if _filled(row, "question") and _filled(row, "answer"):
            columns = ("question", "answer", "subject") if _filled(row, "subject") else ("question", "answer")
            examples.append({c: _string(path, number, row, c) for c in columns})
        elif _filled(row, "text"):
            examples.append({"text": _string(path, number, row, "text")})
        else:
            raise DataError(f"{path}: with columns {sorted(row)}, row {number} has no value for ['question', "
                            f"'answer'] nor for ['text']; every row needs a question and an answer, or a text")
    return examples


def read_benchmark_file(path: str | Path, layout: str) -> list[dict]:
    """Rows of a real benchmark's file (TOFU, MUSE, WMDP), checked against that layout's columns."""
    if layout not in LAYOUTS:
        raise DataError(f"unknown layout '{layout}'; known: {', '.join(sorted(LAYOUTS))}")
    rows = read_rows(path)
    check_layout(rows, layout, path)
    if layout == "wmdp":
        for number, row in enumerate(rows, start=1):
            if not isinstance(row["choices"], list) or not 0 <= int(row["answer"]) < len(row["choices"]):
                raise DataError(f"{path}: row {number} needs a list of choices and an answer index into it")
    if layout == "tofu_eval":
        for number, row in enumerate(rows, start=1):
            if not isinstance(row["perturbed_answer"], list) or not row["perturbed_answer"]:
                raise DataError(f"{path}: row {number}: perturbed_answer must be a non-empty list")
    return rows


def tofu_splits_from_dir(directory: str | Path, forget_split: str = "forget10") -> dict[str, list[dict]]:
    """The real TOFU evaluation files of a local folder as minitofu-style splits (see
    `grom_core.benchmarks.minitofu.tofu_splits_from_files`), in any of the formats `read_rows` reads."""
    from grom_core.benchmarks.minitofu import tofu_splits_from_files

    return tofu_splits_from_files(directory, forget_split, read_benchmark_file, SUFFIXES)


def check_overlap(forget: list[dict], retain: list[dict], forget_path, retain_path) -> None:
    """No forget example twice, and none that the retain data asks to keep."""
    seen: dict[str, int] = {}
    for number, row in enumerate(forget, start=1):
        sha = example_sha256(row)
        if sha in seen:
            raise DataError(f"{forget_path}: rows {seen[sha]} and {number} are the same example; remove the "
                            f"duplicate")
        seen[sha] = number
    for number, row in enumerate(retain, start=1):
        if example_sha256(row) in seen:
            raise DataError(f"{retain_path}: row {number} is also forget row {seen[example_sha256(row)]} of "
                            f"{forget_path}: an example cannot be forgotten and kept; remove it from one of them")
