"""Retain statistics: the Gram sum G = X X^T (float64) and the count r of retain keys, per module.

These are sufficient for the retain side of the solve, they add exactly across shards (so they can be computed in
parallel and merged), and they are cached by (model weights fingerprint, retain data digest, module). Keys are
streamed into the sum batch by batch; nothing holds all retain keys in memory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from grom_core.adapter import get_module, weight_out_in
from grom_core.capture import iter_captured
from grom_core.data import Batch
from grom_core.errors import DataError, FingerprintMismatchError, NonFiniteError, ShapeMismatchError

FORMAT_VERSION = 1


class StatsStore(Protocol):
    """A cache of retain statistics keyed by (model weights fingerprint, stats digest, module); the stats digest
    covers the retain data and everything else the keys depend on (max_length)."""

    def load(self, fingerprint: str, data_digest: str, modules: Sequence[str]) -> dict[str, GramStats]:
        """The cached statistics among `modules` (missing ones are simply absent)."""
        ...

    def save(self, stats: Mapping[str, GramStats]) -> None:
        ...


class MemoryStatsStore:
    """A StatsStore in memory (for a notebook or a benchmark that runs a method twice in one process)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str, str], GramStats] = {}

    def load(self, fingerprint: str, data_digest: str, modules: Sequence[str]) -> dict[str, GramStats]:
        return {m: self.entries[(fingerprint, data_digest, m)] for m in modules
                if (fingerprint, data_digest, m) in self.entries}

    def save(self, stats: Mapping[str, GramStats]) -> None:
        for name, st in stats.items():
            self.entries[(st.fingerprint, st.data_digest, name)] = st


# (modules, fingerprint, stats digest) -> statistics of those modules, computed somewhere else (a Dask cluster)
StatsComputer = Callable[[Sequence[str], str, str], dict[str, "GramStats"]]


@dataclass
class GramStats:
    """Streaming second-moment statistics of the keys entering one module.

    Attributes:
        module: dotted module name.
        gram: (n, n) float64, sum over positions of k k^T.
        count: number of positions summed (r).
        fingerprint: weights fingerprint of the model the keys came from.
        data_digest: digest of the data the keys came from.
        key_sum: (n,) float64 sum of the keys (kept for diagnostics and centring; cheap).
    """

    module: str
    gram: torch.Tensor
    count: int = 0
    fingerprint: str = ""
    data_digest: str = ""
    key_sum: torch.Tensor = field(default=None)  # type: ignore[assignment]

    @classmethod
    def empty(cls, module: str, dim: int, fingerprint: str = "", data_digest: str = "",
              device: torch.device | str = "cpu") -> GramStats:
        return cls(module=module, gram=torch.zeros(dim, dim, dtype=torch.float64, device=device), count=0,
                   fingerprint=fingerprint, data_digest=data_digest,
                   key_sum=torch.zeros(dim, dtype=torch.float64, device=device))

    @property
    def dim(self) -> int:
        return int(self.gram.shape[0])

    def update(self, keys: torch.Tensor) -> None:
        """Add keys (k, n), any float dtype, in float64."""
        if keys.ndim != 2 or keys.shape[1] != self.dim:
            raise ShapeMismatchError(f"{self.module}: keys of shape {tuple(keys.shape)} do not match the "
                                     f"statistics' dimension {self.dim}")
        k = keys.to(device=self.gram.device, dtype=torch.float64)
        if not torch.isfinite(k).all():
            raise NonFiniteError(f"{self.module}: non-finite retain keys; run the model in float32 or bfloat16")
        self.gram.addmm_(k.T, k)
        self.key_sum += k.sum(dim=0)
        self.count += int(k.shape[0])

    def merge(self, other: GramStats, data_digest: str | None = None) -> GramStats:
        """Exact sum of two partial statistics (two shards of the same retain data, same model and module).

        The merged digest is `data_digest` when given (the digest of the whole data), else a digest of the pair.
        """
        if other.module != self.module or other.dim != self.dim:
            raise ShapeMismatchError(f"cannot merge statistics of '{self.module}' ({self.dim}) and "
                                     f"'{other.module}' ({other.dim})")
        if other.fingerprint != self.fingerprint:
            raise FingerprintMismatchError(f"{self.module}: cannot merge statistics of two different models "
                                           f"({self.fingerprint[:12]} vs {other.fingerprint[:12]})")
        if data_digest is None:
            data_digest = hashlib.sha256(f"{self.data_digest}+{other.data_digest}".encode()).hexdigest()
        return GramStats(module=self.module, gram=self.gram + other.gram.to(self.gram.device),
                         count=self.count + other.count, fingerprint=self.fingerprint, data_digest=data_digest,
                         key_sum=self.key_sum + other.key_sum.to(self.gram.device))

    def metadata(self) -> dict:
        return {"format_version": FORMAT_VERSION, "module": self.module, "count": self.count, "dim": self.dim,
                "fingerprint": self.fingerprint, "data_digest": self.data_digest}

    def save(self, path: str | Path) -> Path:
        """Write one safetensors file; the JSON metadata rides in its header under the key "grom"."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file({"gram": self.gram.cpu().contiguous(), "key_sum": self.key_sum.cpu().contiguous()}, str(tmp),
                  metadata={"grom": json.dumps(self.metadata())})
        tmp.replace(path)  # atomic: a crash never leaves a half-written cache entry
        return path

    @classmethod
    def load(cls, path: str | Path, expect_fingerprint: str | None = None) -> GramStats:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            meta = json.loads(handle.metadata()["grom"])
        tensors = load_file(str(path))
        if expect_fingerprint is not None and meta["fingerprint"] != expect_fingerprint:
            raise FingerprintMismatchError(f"statistics in {path} belong to model {meta['fingerprint'][:12]}, "
                                           f"not {expect_fingerprint[:12]}; recompute them for this model")
        return cls(module=meta["module"], gram=tensors["gram"], count=int(meta["count"]),
                   fingerprint=meta["fingerprint"], data_digest=meta["data_digest"], key_sum=tensors["key_sum"])


def module_input_dim(model: nn.Module, name: str) -> int:
    return int(weight_out_in(get_module(model, name)).shape[1])


def accumulate(model: nn.Module, batches: Iterable[Batch], modules: Sequence[str], *, fingerprint: str = "",
               data_digest: str = "", early_stop: bool = True) -> dict[str, GramStats]:
    """Stream retain batches through the model and sum the Gram of each module's input keys.

    Returns module name -> GramStats (on the model's device). Memory: one batch of keys plus n x n per module.
    """
    device = next(model.parameters()).device
    stats = {name: GramStats.empty(name, module_input_dim(model, name), fingerprint, data_digest, device)
             for name in modules}
    for got in iter_captured(model, batches, inputs=list(modules), early_stop=early_stop, desc="retain statistics"):
        for name in modules:
            stats[name].update(got.inputs[name])
    return stats


class RetainSource(Protocol):
    """What retain statistics are read from and checked against: the retain batches, the model's weights
    fingerprint and the digest of what the statistics depend on (retain data, max_length, prompt format)."""

    retain_batches: Sequence[Batch]
    fingerprint: str
    stats_digest: str


def check_statistics(stats: Mapping[str, GramStats], source: RetainSource) -> None:
    """Refuse statistics computed on other weights, other retain data or another `max_length`."""
    for name, st in stats.items():
        if st.fingerprint != source.fingerprint:
            raise FingerprintMismatchError(
                f"retain statistics of '{name}' were computed on model {st.fingerprint[:12] or '(unrecorded)'}, not "
                f"{source.fingerprint[:12]}; recompute them for this model")
        if st.data_digest != source.stats_digest:
            raise DataError(f"retain statistics of '{name}' were computed on other retain data (or another "
                            f"max_length): digest {st.data_digest[:12] or '(unrecorded)'}, expected "
                            f"{source.stats_digest[:12]}; recompute them for this retain data")


def retain_statistics(model: nn.Module, source: RetainSource, modules: Sequence[str],
                      cached: Mapping[str, GramStats] | None = None, *, store: StatsStore | None = None,
                      compute: StatsComputer | None = None) -> tuple[dict[str, GramStats], list[str]]:
    """GramStats per module and the names of those that were reused.

    Reused: `cached` (checked against the source's fingerprint and digest), then whatever `store` holds under
    them. The rest are computed (by `compute` when given, e.g. sharded over a cluster, else in this process, the
    pass stopped at the last hooked input) and saved to `store`.
    """
    stats = {m: st for m, st in (cached or {}).items() if m in modules}
    check_statistics(stats, source)
    missing = [m for m in modules if m not in stats]
    if missing and store is not None:
        found = store.load(source.fingerprint, source.stats_digest, missing)
        check_statistics(found, source)
        stats.update(found)
    reused = [m for m in modules if m in stats]
    missing = [m for m in modules if m not in stats]
    if missing:
        if compute is not None:
            computed = compute(missing, source.fingerprint, source.stats_digest)
        else:
            computed = accumulate(model, source.retain_batches, missing, fingerprint=source.fingerprint,
                                  data_digest=source.stats_digest)
        check_statistics(computed, source)
        if store is not None:
            store.save(computed)
        stats.update(computed)
    return {m: stats[m] for m in modules}, reused
