"""Loading local checkpoints safely: safetensors only, no remote code, no network."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grom_core.errors import DataError


def check_model_dir(path: str | Path) -> Path:
    """A local model directory with safetensors weights, or a DataError that says how to get one."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"model directory {path} does not exist; pass a local directory written by save_pretrained")
    if not any(path.glob("*.safetensors")):
        raise DataError(f"{path} has no .safetensors weights; convert the checkpoint with "
                        f"model.save_pretrained(dir, safe_serialization=True)")
    return path


def load_model(path: str | Path, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
               trust_remote_code: bool = False):
    """Load a causal LM and its tokenizer from a local directory; returns (model, tokenizer), model in eval mode.

    Refuses a directory without `*.safetensors` weights (pickle checkpoints can run arbitrary code on load).
    `device` defaults to CUDA when available, else CPU; `dtype` defaults to the checkpoint's own.
    """
    path = check_model_dir(path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                 trust_remote_code=trust_remote_code, dtype=dtype or "auto")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    model.to(device)
    model.eval()
    return model, tokenizer
