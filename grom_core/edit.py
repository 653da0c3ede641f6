"""The Edit value: per-module weight deltas, the parameters that produced them and the base weights fingerprint.

Computing an edit never touches the model; applying and reverting are separate, explicit steps:

    edit = compute_edit(...)        # model unchanged
    undo = edit.apply(model)        # W <- cast(W + P), refuses a model with another fingerprint
    edit.revert(model)              # W restored bit for bit

Why revert is exact: W' = cast(W + P) loses bits, so cast(W' - P) is usually, not always, W. `apply` records the
few entries where that reconstruction misses (their positions and original values, the Undo); `revert` recomputes
cast(W' - P) and patches those entries, which gives the original bits back without storing a copy of W.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from grom_core.adapter import get_module, shares_input_embedding, weight_out_in
from grom_core.errors import FingerprintMismatchError, MissingUndoError, ShapeMismatchError, TiedWeightsError
from grom_core.fingerprint import weights_fingerprint

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ROW_CHUNK_ELEMENTS = 1 << 24  # materialise at most ~16M float64 entries (128 MB) of a delta at a time

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.float64: torch.int64}


@dataclass(frozen=True)
class ModuleDelta:
    """The update P (out, in) of one module, float64, stored as factors left (k_rows, k) @ right (k, in) when that
    is smaller than the dense rows, else dense rows (k_rows, in).

    `row_index` (k_rows,) sorted, when set, names the only rows of P that are not zero (an LM-head edit touches only
    the rows of the tokens it suppresses: a few hundred of 49k); without it the stored rows are all `out` rows.
    """

    name: str
    shape: tuple[int, int]
    left: torch.Tensor | None = None
    right: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    row_index: torch.Tensor | None = None

    @classmethod
    def from_factors(cls, name: str, left: torch.Tensor, right: torch.Tensor,
                     row_index: torch.Tensor | None = None, out_features: int | None = None) -> ModuleDelta:
        """P = left @ right, or, with `row_index`, P[row_index] = left @ right and zero elsewhere (P then has
        `out_features` rows)."""
        m, k = left.shape
        if right.shape[0] != k:
            raise ShapeMismatchError(f"{name}: factors {tuple(left.shape)} and {tuple(right.shape)} do not chain")
        if row_index is not None:
            row_index = row_index.long().cpu()
            if row_index.numel() != m or out_features is None or (row_index.numel() and (
                    int(row_index.max()) >= out_features or bool((row_index.diff() <= 0).any()))):
                raise ShapeMismatchError(f"{name}: row_index must be {m} sorted distinct rows below out_features")
        n = right.shape[1]
        shape = (out_features if row_index is not None else m, n)
        left, right = left.double().cpu().contiguous(), right.double().cpu().contiguous()
        if k * (m + n) < m * n:
            return cls(name=name, shape=shape, left=left, right=right, row_index=row_index)
        return cls(name=name, shape=shape, dense=left @ right, row_index=row_index)

    @property
    def factored(self) -> bool:
        return self.dense is None

    def scaled(self, alpha: float) -> ModuleDelta:
        """alpha * P, with the same storage."""
        if self.factored:
            return dataclasses.replace(self, left=self.left * alpha)
        return dataclasses.replace(self, dense=self.dense * alpha)

    @property
    def rank_bound(self) -> int:
        stored = self.left.shape[1] if self.factored else min(self.dense.shape)
        return int(min(stored, *self.shape))

    def _stored(self, picks: torch.Tensor | slice) -> torch.Tensor:
        return self.left[picks] @ self.right if self.factored else self.dense[picks]

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of P, float64 (materialised only for those rows)."""
        if self.row_index is None:
            return self._stored(slice(start, stop))
        out = torch.zeros(stop - start, self.shape[1], dtype=torch.float64)
        picks = ((self.row_index >= start) & (self.row_index < stop)).nonzero().flatten()
        if picks.numel():
            out[self.row_index[picks] - start] = self._stored(picks)
        return out

    def rows_at(self, indices: torch.Tensor) -> torch.Tensor:
        """P[indices] (k, in), float64, for any row indices (repeats allowed)."""
        indices = indices.long().cpu()
        if self.row_index is None:
            return self._stored(indices)
        where = torch.searchsorted(self.row_index, indices).clamp_max(max(0, self.row_index.numel() - 1))
        hit = self.row_index.numel() > 0 and self.row_index[where] == indices
        out = torch.zeros(indices.numel(), self.shape[1], dtype=torch.float64)
        if self.row_index.numel():
            out[hit] = self._stored(where[hit])
        return out

    def touches(self, start: int, stop: int) -> bool:
        """Whether any row in start:stop may be non-zero."""
        return self.row_index is None or bool(((self.row_index >= start) & (self.row_index < stop)).any())

    def full(self) -> torch.Tensor:
        return self.rows(0, self.shape[0])

    def frobenius_norm(self) -> float:
        if not self.factored:
            return float(torch.linalg.matrix_norm(self.dense))
        # ||L R||_F^2 = trace((L^T L)(R R^T)): no (out, in) matrix needed
        return float(((self.left.T @ self.left) * (self.right @ self.right.T)).sum().clamp_min(0).sqrt())

    def distance(self, other: ModuleDelta | None) -> float:
        """||self - other||_F (other None: ||self||_F). Two factored deltas are compared through their stacked
        factors, [L1, -L2] [R1; R2], so no (out, in) matrix is formed."""
        if other is None:
            return self.frobenius_norm()
        if other.shape != self.shape:
            raise ShapeMismatchError(f"cannot compare deltas of {self.name} {self.shape} and {other.name} "
                                     f"{other.shape}")
        same_rows = (self.row_index is None and other.row_index is None) or (
            self.row_index is not None and other.row_index is not None
            and torch.equal(self.row_index, other.row_index))
        if self.factored and other.factored and same_rows:
            stacked = ModuleDelta(name=self.name, shape=self.shape, left=torch.cat([self.left, -other.left], dim=1),
                                  right=torch.cat([self.right, other.right], dim=0), row_index=self.row_index)
            return stacked.frobenius_norm()
        return float(torch.linalg.matrix_norm(self.full() - other.full()))

    def tensors(self) -> dict[str, torch.Tensor]:
        rows = {} if self.row_index is None else {f"{self.name}::row_index": self.row_index}
        if self.factored:
            return {f"{self.name}::left": self.left, f"{self.name}::right": self.right, **rows}
        return {f"{self.name}::dense": self.dense, **rows}


@dataclass
class Undo:
    """What `Edit.apply` needs to give the exact original bits back: per module, the flat [out, in] indices where
    cast(W' - P) != W, and the original values there."""

    edit_id: str
    base_fingerprint: str
    post_fingerprint: str
    indices: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, torch.Tensor] = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tensors = {}
        for name in self.indices:
            tensors[f"{name}::indices"] = self.indices[name].contiguous()
            tensors[f"{name}::values"] = self.values[name].contiguous()
        meta = {"edit_id": self.edit_id, "base_fingerprint": self.base_fingerprint,
                "post_fingerprint": self.post_fingerprint, "modules": sorted(self.indices)}
        save_file(tensors, str(path), metadata={"grom": json.dumps(meta)})
        return path

    @classmethod
    def load(cls, path: str | Path) -> Undo:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            meta = json.loads(handle.metadata()["grom"])
        tensors = load_file(str(path))
        return cls(edit_id=meta["edit_id"], base_fingerprint=meta["base_fingerprint"],
                   post_fingerprint=meta["post_fingerprint"],
                   indices={n: tensors[f"{n}::indices"] for n in meta["modules"]},
                   values={n: tensors[f"{n}::values"] for n in meta["modules"]})


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_VIEW[t.dtype]) if t.dtype in _INT_VIEW else t


def _touched_chunks(delta: ModuleDelta, device: torch.device) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(start, stop, the delta's rows start:stop as a float64 [stop - start, in] tensor on `device`) for each chunk
    of rows the delta touches; chunks of about ROW_CHUNK_ELEMENTS keep a dense copy of a 49k-row head out of
    memory."""
    step = max(1, ROW_CHUNK_ELEMENTS // max(1, delta.shape[1]))
    for start in range(0, delta.shape[0], step):
        stop = min(start + step, delta.shape[0])
        if delta.touches(start, stop):
            yield start, stop, delta.rows(start, stop).to(device)


@dataclass
class Edit:
    """An additive weight update for several modules of one model.

    Attributes:
        deltas: module name -> ModuleDelta (float64, [out, in] orientation whatever the module stores).
        base_fingerprint: weights fingerprint of the model the edit was computed on; apply refuses any other.
        params: the hyper-parameters that produced the edit (JSON-serialisable).
        metadata: anything else worth keeping (layer scores, counts, timings).
    """

    deltas: dict[str, ModuleDelta]
    base_fingerprint: str
    params: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)

    @property
    def edit_id(self) -> str:
        """Content address: sha256 over the base fingerprint, the parameters and the factor bytes (16 hex)."""
        digest = hashlib.sha256(self.base_fingerprint.encode())
        digest.update(json.dumps(self.params, sort_keys=True, default=str).encode())
        for name in sorted(self.deltas):
            for key, tensor in sorted(self.deltas[name].tensors().items()):
                digest.update(key.encode())
                digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:16]

    @property
    def modules(self) -> list[str]:
        return list(self.deltas)

    # -- apply / revert -----------------------------------------------------------------------------------------
    def _weights(self, model: nn.Module) -> Iterator[tuple[ModuleDelta, torch.Tensor]]:
        for name, delta in self.deltas.items():
            weight = weight_out_in(get_module(model, name))
            if tuple(weight.shape) != delta.shape:
                raise ShapeMismatchError(f"{name}: edit is {delta.shape}, the model's weight is "
                                         f"{tuple(weight.shape)} ([out, in]); this edit belongs to another model")
            yield delta, weight

    def _check_untied(self, model: nn.Module) -> None:
        for name in self.deltas:
            if shares_input_embedding(model, get_module(model, name)):
                raise TiedWeightsError(
                    f"'{name}' shares its weight with the input embedding, so editing it would change the "
                    f"embedding too; untie it first with ModelAdapter.for_model(model).untie_lm_head()")

    @torch.no_grad()
    def apply(self, model: nn.Module, verify: bool = True) -> Undo:
        """Add the deltas to the model's weights in place (one float64 add, one cast) and return the Undo.

        The Undo is also attached to the model so that `revert(model)` needs no argument. With verify=True the
        model must carry exactly the weights the edit was computed for.
        """
        self._check_untied(model)
        edit_id = self.edit_id  # a hash over every factor: once a call
        if verify:
            found = weights_fingerprint(model)
            if found != self.base_fingerprint:
                raise FingerprintMismatchError(
                    f"edit {edit_id} was computed for model {self.base_fingerprint[:12]}, this model is "
                    f"{found[:12]}; compute a new edit on this model (or revert the edits applied since)")
        pairs = list(self._weights(model))  # check every shape before changing anything
        undo = Undo(edit_id=edit_id, base_fingerprint=self.base_fingerprint, post_fingerprint="")
        for delta, weight in pairs:
            idx_parts, val_parts = [], []
            for start, stop, p in _touched_chunks(delta, weight.device):
                old = weight[start:stop].clone()
                new = (old.double() + p).to(weight.dtype)
                back = (new.double() - p).to(weight.dtype)
                miss = (_bits(back) != _bits(old)).flatten().nonzero().flatten()
                idx_parts.append((miss + start * delta.shape[1]).cpu())
                val_parts.append(old.flatten()[miss].cpu())
                weight[start:stop] = new
            undo.indices[delta.name] = torch.cat(idx_parts)
            undo.values[delta.name] = torch.cat(val_parts)
        undo.post_fingerprint = weights_fingerprint(model) if verify else ""
        model.__dict__.setdefault("_grom_undo", {})[edit_id] = undo
        log.debug("applied edit %s to %d modules", edit_id, len(pairs))
        return undo

    @torch.no_grad()
    def revert(self, model: nn.Module, undo: Undo | None = None, verify: bool = True) -> None:
        """Restore the weights the edit was applied to, bit for bit.

        `undo` defaults to the one `apply` attached to this model; pass a loaded Undo to revert in another process.
        """
        edit_id = self.edit_id  # a hash over every factor: once a call
        undo = undo or model.__dict__.get("_grom_undo", {}).get(edit_id)
        if undo is None or undo.edit_id != edit_id:
            raise MissingUndoError(f"no undo record of edit {edit_id} on this model; pass the Undo "
                                    f"that apply() returned (Undo.load(path) in another process)")
        if verify and undo.post_fingerprint:
            found = weights_fingerprint(model)
            if found != undo.post_fingerprint:
                raise FingerprintMismatchError(
                    f"the model changed after edit {edit_id} was applied ({found[:12]} is not "
                    f"{undo.post_fingerprint[:12]}); revert later edits first")
        for delta, weight in list(self._weights(model)):
            for start, stop, p in _touched_chunks(delta, weight.device):
                weight[start:stop] = (weight[start:stop].double() - p).to(weight.dtype)
            flat_idx = undo.indices[delta.name].to(weight.device)
            if flat_idx.numel():
                rows, cols = flat_idx // delta.shape[1], flat_idx % delta.shape[1]
                weight[rows, cols] = undo.values[delta.name].to(weight.device)
        if verify and weights_fingerprint(model) != self.base_fingerprint:
            raise RuntimeError(f"revert of edit {edit_id} did not restore the base weights")  # a bug, not input
        model.__dict__.get("_grom_undo", {}).pop(edit_id, None)
        log.debug("reverted edit %s", edit_id)

    @contextmanager
    def applied(self, model: nn.Module, verify: bool = True) -> Iterator[Undo]:
        """Apply for the duration of a `with` block, revert on exit (even on error)."""
        undo = self.apply(model, verify=verify)
        try:
            yield undo
        finally:
            self.revert(model, undo, verify=verify)

    # -- persistence --------------------------------------------------------------------------------------------
    def manifest(self) -> dict:
        return {
            "format_version": FORMAT_VERSION, "edit_id": self.edit_id, "base_fingerprint": self.base_fingerprint,
            "params": self.params, "metadata": self.metadata,
            "modules": [{"name": d.name, "shape": list(d.shape), "factored": d.factored, "rank_bound": d.rank_bound,
                         "row_sparse": d.row_index is not None, "frobenius_norm": d.frobenius_norm()}
                        for d in self.deltas.values()],
        }

    def save(self, directory: str | Path) -> Path:
        """Write `edit.safetensors` (the factors) and `edit.json` (the manifest) into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for delta in self.deltas.values():
            tensors.update(delta.tensors())
        save_file(tensors, str(directory / "edit.safetensors"))
        (directory / "edit.json").write_text(json.dumps(self.manifest(), indent=2, default=str))
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> Edit:
        directory = Path(directory)
        manifest = json.loads((directory / "edit.json").read_text())
        tensors = load_file(str(directory / "edit.safetensors"))
        deltas = {}
        for entry in manifest["modules"]:
            name, shape = entry["name"], tuple(entry["shape"])
            rows = tensors.get(f"{name}::row_index")
            if entry["factored"]:
                deltas[name] = ModuleDelta(name, shape, left=tensors[f"{name}::left"], right=tensors[f"{name}::right"],
                                           row_index=rows)
            else:
                deltas[name] = ModuleDelta(name, shape, dense=tensors[f"{name}::dense"], row_index=rows)
        edit = cls(deltas=deltas, base_fingerprint=manifest["base_fingerprint"], params=manifest["params"],
                   metadata=manifest["metadata"])
        if edit.edit_id != manifest["edit_id"]:
            raise FingerprintMismatchError(f"{directory}: the factors do not match the manifest's edit id "
                                           f"{manifest['edit_id']} (corrupted or mixed files)")
        return edit
