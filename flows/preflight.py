"""The checks every command runs before its first forward pass: a mistake costs one line and changes nothing.

    preflight(model_dir, forget_file, retain_file, method, params)

Order: the method's parameters (typed, through its dataclass), then the model folder (config, tokenizer, every
weight file's header and size, finite weights, layers and positions against the parameters), then the data files
(format, strings only, no forget example twice, no example both forgotten and retained). Each failure is a
`GromError` subclass naming the problem and the fix, which the CLI prints on one line with exit code 2.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

from grom_core.adapter import FAMILIES, HAND_NAMING_HINT
from grom_core.errors import DataError, UnsupportedArchitectureError
from grom_core.loading import check_model_dir
from grom_core.methods import method_params
from grom_core.params import Params
from tasks.datafiles import check_overlap, read_examples

log = logging.getLogger("grom.preflight")


def preflight(model: str | Path, forget: str | Path | None, retain: str | Path, method: str,
              params: dict | None) -> Params:
    """Check everything a run needs before it starts; returns the method's checked parameters."""
    checked = method_params(method, params)
    config = check_model(model)
    check_params_against_model(checked, config)
    retain_rows = read_examples(retain)
    forget_rows = read_examples(forget) if forget is not None else []
    check_overlap(forget_rows, retain_rows, forget, retain)
    check_lengths(model, config, checked, {forget: forget_rows, retain: retain_rows})
    return checked


def check_model(model: str | Path) -> dict:
    """The model folder's config (a dict), after checking its architecture, tokenizer and weight files."""
    path = check_model_dir(model)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise DataError(f"{path} has no config.json; it is not a Hugging Face model directory (save it with "
                        f"model.save_pretrained)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{config_file} is not valid JSON ({exc}); restore the file from the checkpoint") from exc
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise UnsupportedArchitectureError(f"unknown architecture '{model_type}' (known: {known}); from Python, "
                                           f"{HAND_NAMING_HINT}")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                                                      "tokenizer.model")):
        raise DataError(f"{path} has no tokenizer files; save the tokenizer beside the weights "
                        f"(tokenizer.save_pretrained(dir))")
    for weights in sorted(path.glob("*.safetensors")):
        check_weight_file(weights)
    return config


def check_weight_file(path: Path) -> None:
    """A safetensors file whose header parses, whose tensors fit in the file and whose values are finite."""
    size = path.stat().st_size
    fix = "copy the checkpoint again (or save it again with save_pretrained)"
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > size - 8:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(handle.read(length))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is not a readable safetensors file ({exc}); {fix}") from exc
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        raise DataError(f"{path} is truncated: its header needs {8 + length + end} bytes, the file has {size}; {fix}")
    import torch
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
            tensor = handle.get_tensor(name)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise DataError(f"{path}: tensor '{name}' holds NaN or infinite values; these weights cannot be "
                                f"edited or served; restore a good checkpoint")


def check_params_against_model(params: Params, config: dict) -> None:
    """Layers that exist, and sequences that fit the model's positions."""
    n_layers = config.get("num_hidden_layers", config.get("n_layer"))
    layers = getattr(params, "layers", None) or []
    bad = [layer for layer in layers if not (n_layers and 0 <= layer < n_layers)]
    if bad:
        raise DataError(f"layers {bad} do not exist; the model has layers 0..{(n_layers or 1) - 1}")


def check_lengths(model: str | Path, config: dict, params: Params, files: dict) -> None:
    """No example longer than the model's positions unless `max_length` cuts it to fit (a longer sequence would
    index past the position embeddings)."""
    positions = config.get("max_position_embeddings", config.get("n_positions"))
    max_length = getattr(params, "max_length", None)
    if not positions or (max_length and max_length <= positions):
        return
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    slack = 16  # the prompt template and special tokens around a question and answer
    for path, rows in files.items():
        for number, row in enumerate(rows, start=1):
            text = row.get("text") or f"{row.get('question')} {row.get('answer')}"
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + slack
            if n > positions:
                raise DataError(f"{path}: row {number} is about {n} tokens, longer than the model's {positions} "
                                f"positions; pass --params '{{\"max_length\": {positions}}}' to cut such rows, "
                                f"or shorten them")
