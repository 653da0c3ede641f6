"""Content digests of model weights and of datasets.

Caches are keyed by what a thing *is*, never by its name: an edited model keeps its name but gets a new
fingerprint, so statistics computed on the original are never reused for it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are hashed: the request queue digests data without it
    import torch


def _tensor_digest(tensor: torch.Tensor) -> bytes:
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).digest()  # the buffer itself: no copy to bytes


def weights_fingerprint(model: torch.nn.Module, threads: int | None = None) -> str:
    """sha256 (hex) over every entry of the state dict in name order: its name, dtype, shape and the sha256 of
    its raw bytes.

    The per-tensor digests run on `threads` threads (default: up to 8; hashlib releases the GIL) straight from the
    tensors' buffers, and tied parameters are hashed once: a closed-form edit on a cached model is otherwise
    dominated by this hash. Tied parameters appear under both of their names with the same bytes, so tying or
    untying the LM head does not change the fingerprint, while any change of any weight does.
    """
    from concurrent.futures import ThreadPoolExecutor

    state = model.state_dict()
    names = sorted(state)
    storage = {name: (state[name].data_ptr(), state[name].dtype, tuple(state[name].shape),
                      tuple(state[name].stride()), state[name].device) for name in names}
    first: dict[tuple, str] = {}  # tied tensors share one storage key: hashed under the first of their names
    for name in names:
        first.setdefault(storage[name], name)
    workers = max(1, min(threads or 8, os.cpu_count() or 1, len(first)))
    with ThreadPoolExecutor(workers) as pool:
        digests = dict(zip(first, pool.map(lambda key: _tensor_digest(state[first[key]]), first), strict=True))
    digest = hashlib.sha256()
    for name in names:
        tensor = state[name]
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(json.dumps(list(tensor.shape)).encode())
        digest.update(digests[storage[name]])
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
