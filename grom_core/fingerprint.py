"""Content digests of model weights and of datasets.

Caches are keyed by what a thing *is*, never by its name: an edited model keeps its name but gets a new
fingerprint, so statistics computed on the original are never reused for it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import torch


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 (hex) over every entry of the state dict: name, dtype, shape and raw bytes, in name order.

    Tied parameters appear under both of their names with the same bytes, so tying or untying the LM head does
    not change the fingerprint, while any change of any weight does.
    """
    digest = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        tensor = state[name].detach()
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(json.dumps(list(tensor.shape)).encode())
        flat = tensor.cpu().contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def data_digest(records: Iterable[object]) -> str:
    """sha256 (hex) of a sequence of JSON-serialisable records, order-sensitive."""
    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps(record, sort_keys=True, ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def text_sha256(text: str) -> str:
    """sha256 (hex) of one text: what the catalog keeps once raw forget text is purged."""
    return hashlib.sha256(text.encode()).hexdigest()
