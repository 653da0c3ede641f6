"""Running a fixed sample through the blocks from layer k up only, the blocks below replaced by what they output.

An update of layers k and above leaves the residual stream entering block k unchanged. The retain budget reads one
sample under many scales of a band's update near the top of the network (SmolLM2: layers 28-29 of 30): `BlockCache`
keeps the stream entering block k for each of the sample's batches (captured during a pass that runs anyway), and
`BlockCache.running()` runs a pass from there, the blocks below taken out of the model's block list and the cached
stream put in place of the input embedding's output. Positions, rotary embeddings and the attention mask are built
from the batch as in a full pass; nothing else changes.

Whether this is exact depends on the model's forward (a family that rescales the embedding's output, Gemma's, would
not be): `BlockCache.verify` compares a run from block k with the full pass's readings, and callers use it only where
they agree.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from grom_core.adapter import get_module


@dataclass
class BlockCache:
    """The residual stream entering block `layer` (of the ModuleList at `blocks`) for each batch of a sample, in
    order: `hidden[i]` is batch i's (B, T, hidden) tensor."""

    model: nn.Module
    blocks: str
    layer: int
    hidden: list[torch.Tensor] = field(default_factory=list)
    exact: bool = False

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Record the stream entering block `layer` on every forward pass in the block (one per batch, in order)."""
        block = get_module(self.model, self.blocks)[self.layer]

        def hook(module, args, kwargs):
            self.hidden.append((args[0] if args else kwargs["hidden_states"]).detach().clone())

        handle = block.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    @contextmanager
    def running(self) -> Iterator[None]:
        """Forward passes over the sample's batches, in order, run from block `layer`: the blocks below are out of
        the block list and the input embedding's output is the cached stream. Restored on exit."""
        owner_name, _, attr = self.blocks.rpartition(".")
        owner = get_module(self.model, owner_name) if owner_name else self.model
        full = getattr(owner, attr)
        cached = iter(self.hidden)

        def hook(module, args, output):
            stream = next(cached)
            if stream.shape[:2] != output.shape[:2]:
                raise RuntimeError(f"the cached stream {tuple(stream.shape)} does not fit the batch "
                                   f"{tuple(output.shape)}: the sample's batches changed")
            return stream

        handle = self.model.get_input_embeddings().register_forward_hook(hook)
        setattr(owner, attr, nn.ModuleList(list(full)[self.layer:]))
        try:
            yield
        finally:
            setattr(owner, attr, full)
            handle.remove()

    def covers(self, modules: Sequence[str]) -> bool:
        """Every module lies in block `layer` or above (so the stream entering block `layer` is unchanged)."""
        count = len(get_module(self.model, self.blocks))
        above = tuple(f"{self.blocks}.{i}." for i in range(self.layer, count))
        return bool(self.hidden) and all(name.startswith(above) for name in modules)

    def verify(self, full: torch.Tensor, from_cache: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
        """Mark the cache exact where a reading from block `layer` equals the full pass's (same values, same shape)."""
        self.exact = full.shape == from_cache.shape and torch.allclose(full.float(), from_cache.float(), rtol=rtol,
                                                                       atol=atol)
        return self.exact
