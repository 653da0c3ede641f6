"""How numbers look in grom's tables (the terminal, Markdown reports, the Prefect UI)."""

from __future__ import annotations


def fmt(value) -> str:
    """A table cell: 4 significant digits, and blank for a metric that does not apply (None)."""
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


MARKDOWN_PUNCTUATION = set("\\`*_{}[]()<>#|~&")  # what is inline syntax inside a table cell


def md_cell(value, limit: int | None = None) -> str:
    """User text as one literal Markdown table cell: on one line, every character Markdown or a table gives a
    meaning (a link's brackets, emphasis, a `|` that would end the cell, an HTML tag) backslash-escaped, so that the
    reader sees what was written; cut to `limit` characters (before escaping) with an ellipsis."""
    text = " ".join(fmt(value).split())
    if limit is not None and len(text) > limit:
        text = text[:limit] + "…"
    return "".join("\\" + c if c in MARKDOWN_PUNCTUATION else c for c in text)


def quantization_columns(quantized: dict) -> list[str]:
    """The columns of a quantization-attack table: each recovered forget metric, its recovery, and how much of
    the edit survived, in the order the attacks report them."""
    columns: list[str] = []
    for metrics in quantized.values():
        if not isinstance(metrics, dict):
            continue
        for key in metrics:
            if key.startswith("recovery_"):
                for column in (key.removeprefix("recovery_"), key):
                    if column not in columns:
                        columns.append(column)
    return columns + [c for c in ("codes_changed", "norm_survival")
                      if any(isinstance(m, dict) and c in m for m in quantized.values())]
