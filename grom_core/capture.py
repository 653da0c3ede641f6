"""Key capture: forward hooks that collect the inputs (or outputs) of named modules at supervised positions.

A "key" of a weight matrix W at position t is the vector that enters W there. The edit only needs keys where the
next token is supervised (labels[t + 1] != -100); padding and prompt positions are never returned.
Hooks live inside a context manager so that they are removed even when a forward pass fails.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import torch
from torch import nn

from grom_core.adapter import get_module
from grom_core.data import IGNORE_INDEX, Batch
from grom_core.errors import NonFiniteError
from grom_core.modes import evaluating
from grom_core.progress import progress_bar

log = logging.getLogger(__name__)


class _StopForward(Exception):
    """Raised by the hook of the last module needed, so the rest of the forward pass is skipped."""


@dataclass
class CapturedBatch:
    """What one batch yields, restricted to its k supervised positions.

    Attributes:
        inputs: module name -> (k, n_in) input vectors (the keys), in the module's compute dtype.
        outputs: module name -> (k, n_out) output vectors.
        next_tokens: (k,) the gold next token y_t at each position.
        example_ids: (k,) the example each position belongs to.
        positions: (k,) the position t inside its sequence.
    """

    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    next_tokens: torch.Tensor
    example_ids: torch.Tensor
    positions: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.next_tokens.numel())


def supervised_mask(batch: Batch) -> torch.Tensor:
    """(B, T) bool: position t is kept when token t + 1 is supervised and real (not padding). Last column False."""
    mask = torch.zeros_like(batch.labels, dtype=torch.bool)
    nxt = (batch.labels[:, 1:] != IGNORE_INDEX) & (batch.attention_mask[:, 1:] == 1)
    mask[:, :-1] = nxt
    return mask


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class KeyCapture:
    """Hooks on named modules; `run(batch)` does one forward pass and returns the captured vectors.

    Use as a context manager (`with KeyCapture(model, inputs=[...]) as cap:`); the hooks are removed on exit.

    Args:
        model: a causal LM taking input_ids and attention_mask.
        inputs: names of modules whose *input* is captured (keys).
        outputs: names of modules whose *output* is captured (e.g. MLP outputs for layer scores).
        early_stop: stop the forward pass after the last hooked module has run (saves the rest of the network;
            only when no hooked module is the LM head, which runs last anyway).
        check_finite: raise NonFiniteError when a captured vector holds NaN or Inf.
    """

    def __init__(self, model: nn.Module, inputs: Sequence[str] = (), outputs: Sequence[str] = (),
                 early_stop: bool = True, check_finite: bool = True) -> None:
        self.model = model
        self.input_names = list(dict.fromkeys(inputs))
        self.output_names = list(dict.fromkeys(outputs))
        self.early_stop = early_stop
        self.check_finite = check_finite
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._mask: torch.Tensor | None = None
        self._got_in: dict[str, torch.Tensor] = {}
        self._got_out: dict[str, torch.Tensor] = {}
        wanted = set(self.input_names) | set(self.output_names)
        order = [name for name, _ in model.named_modules() if name in wanted]
        # named_modules() follows registration order, which is forward order for the supported families.
        self._last = order[-1] if order else None
        for name in wanted:
            get_module(model, name)  # clear error for a missing name, before any hook is attached

    def __enter__(self) -> KeyCapture:
        for name in self.input_names:
            module = get_module(self.model, name)
            self._handles.append(module.register_forward_pre_hook(self._input_hook(name)))
        for name in self.output_names:
            module = get_module(self.model, name)
            self._handles.append(module.register_forward_hook(self._output_hook(name)))
        return self

    def __exit__(self, *exc_info) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _select(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        selected = tensor[self._mask].detach()
        if self.check_finite and not torch.isfinite(selected).all():
            raise NonFiniteError(f"non-finite values captured at '{name}'; run the model in float32 or bfloat16 "
                                 f"instead of float16, or check the checkpoint for NaN weights")
        return selected

    def _maybe_stop(self, name: str) -> None:
        if self.early_stop and name == self._last:
            raise _StopForward

    def _input_hook(self, name: str):
        def hook(module, args):
            self._got_in[name] = self._select(name, args[0])
            if name not in self.output_names:
                self._maybe_stop(name)
        return hook

    def _output_hook(self, name: str):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            self._got_out[name] = self._select(name, out)
            self._maybe_stop(name)
        return hook

    @torch.no_grad()
    def run(self, batch: Batch, mask: torch.Tensor | None = None) -> CapturedBatch:
        """One forward pass over `batch` (moved to the model's device); returns its supervised positions, or the
        positions `mask` (B, T) bool selects (an editor's subject tokens)."""
        if not self._handles:
            raise RuntimeError("KeyCapture.run() called outside its `with` block")
        batch = batch.to(model_device(self.model))
        self._mask = supervised_mask(batch) if mask is None else mask.to(batch.input_ids.device)
        self._got_in, self._got_out = {}, {}
        with suppress(_StopForward):
            self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        rows, cols = self._mask.nonzero(as_tuple=True)
        return CapturedBatch(
            inputs=dict(self._got_in), outputs=dict(self._got_out),
            next_tokens=batch.labels[rows, cols + 1], example_ids=batch.example_ids[rows], positions=cols,
        )


@contextmanager
def capture(model: nn.Module, inputs: Sequence[str] = (), outputs: Sequence[str] = (), early_stop: bool = True):
    """Context manager form of KeyCapture; the model is put in eval mode for the duration and restored after."""
    with evaluating(model), KeyCapture(model, inputs, outputs, early_stop=early_stop) as cap:
        yield cap


def iter_captured(model: nn.Module, batches: Iterable[Batch], inputs: Sequence[str] = (),
                  outputs: Sequence[str] = (), early_stop: bool = True, desc: str = "capture"
                  ) -> Iterator[CapturedBatch]:
    """Yield one CapturedBatch per batch, with a progress bar named `desc` (a terminal's only) and a DEBUG line
    when the last batch is done."""
    batches = list(batches)
    positions = 0
    with capture(model, inputs, outputs, early_stop) as cap, progress_bar(len(batches), desc) as advance:
        for batch in batches:
            got = cap.run(batch)
            positions += got.size
            advance()
            yield got
    log.debug("%s: %d batches, %d supervised positions", desc, len(batches), positions)


def collect(model: nn.Module, batches: Iterable[Batch], inputs: Sequence[str] = (), outputs: Sequence[str] = (),
            early_stop: bool = True, device: torch.device | str = "cpu", desc: str = "capture") -> CapturedBatch:
    """Concatenate the captured vectors of all batches (for the forget side, which is small), on `device`."""
    parts = [got for got in iter_captured(model, batches, inputs, outputs, early_stop, desc)]
    if not parts:
        raise ValueError("collect() needs at least one batch")

    def cat(items: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.to(device) for t in items])

    return CapturedBatch(
        inputs={n: cat([p.inputs[n] for p in parts]) for n in parts[0].inputs},
        outputs={n: cat([p.outputs[n] for p in parts]) for n in parts[0].outputs},
        next_tokens=cat([p.next_tokens for p in parts]),
        example_ids=cat([p.example_ids for p in parts]),
        positions=cat([p.positions for p in parts]),
    )
