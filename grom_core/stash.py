"""Weights set aside on disk for the length of a `with` block, so an attack that overwrites every matrix of a model
(a quantization round trip, a relearning fine-tune) can give the exact bits back without a second copy of the model
in memory.

`stashed(tensors)` writes the raw bytes of each tensor, one after the other, to a temporary file; `restore()` reads
them back one tensor at a time (a memory map of the file) into the same tensors. The peak memory the stash adds is
one tensor, not the model; the price is one sequential write and read of the weights.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class _Entry:
    offset: int
    nbytes: int


class Stash:
    """The bytes of some tensors in one file; `restore()` copies them back into those tensors, in place."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], path: Path) -> None:
        self.path, self._tensors, self._entries = path, dict(tensors), {}
        offset = 0
        with open(path, "wb") as handle:
            for name, tensor in self._tensors.items():
                raw = _bytes_of(tensor)
                raw.tofile(handle)
                self._entries[name] = _Entry(offset, raw.nbytes)
                offset += raw.nbytes

    def read(self, name: str) -> torch.Tensor:
        """The stashed value of one tensor: a new CPU tensor of its dtype and shape."""
        tensor, entry = self._tensors[name], self._entries[name]
        mapped = np.memmap(self.path, dtype=np.uint8, mode="r", offset=entry.offset, shape=(entry.nbytes,))
        try:
            return torch.from_numpy(np.array(mapped)).view(tensor.dtype).view(tensor.shape)
        finally:
            del mapped

    @torch.no_grad()
    def restore(self) -> None:
        """Every tensor back to the bits it had when stashed, one tensor in memory at a time."""
        for name, tensor in self._tensors.items():
            if self._entries[name].nbytes:
                tensor.copy_(self.read(name).to(tensor.device))


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array (a view where the tensor is contiguous on the CPU)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


@contextmanager
def stashed(tensors: Mapping[str, torch.Tensor], directory: str | Path | None = None) -> Iterator[Stash]:
    """`with stashed({name: tensor}) as stash: ...; stash.restore()`: the tensors' current bytes in a temporary file
    under `directory` (default: the system's temporary folder), deleted when the block ends. The same tensor under two
    names (a tied head and embedding) is stashed once."""
    unique, seen = {}, set()
    for name, tensor in tensors.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            unique[name] = tensor
    with tempfile.TemporaryDirectory(prefix="grom-stash-", dir=directory) as folder:
        yield Stash(unique, Path(folder) / "weights.bin")
