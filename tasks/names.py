"""File names derived from user input: a request's file, a model's name, a module's, an edit id from a tag."""

from __future__ import annotations

import re


def safe_name(text: str) -> str:
    """A file name derived from user input or module names: only [A-Za-z0-9_.-], no leading dot."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "_", text).lstrip(".")
    return cleaned[:150] or "unnamed"
