"""Data-parallel retain statistics on Dask: each worker streams one shard of the retain data through the model and
writes its partial Gram sums (safetensors); the driver merges them (an exact sum). Only the driver touches the
DuckDB catalog.

Workers need the model directory on a path they can read (a shared filesystem on a real cluster) and, when they
report to Prefect, PREFECT_API_URL pointing at a real Prefect server.
"""

from __future__ import annotations

import logging
from pathlib import Path

from grom_core.statistics import GramStats

log = logging.getLogger(__name__)


def shard_statistics(model_dir: str, rows: list[dict], first_id: int, modules: list[str], fingerprint: str,
                     data_digest: str, batch_size: int, max_length: int, out_dir: str,
                     prompt_format: str = "qa") -> dict[str, str]:
    """Worker side: Gram sums of one shard of retain rows; returns module -> safetensors path."""
    import torch

    from grom_core.data import as_examples, make_batches
    from grom_core.loading import load_model
    from grom_core.statistics import accumulate
    from tasks.names import safe_name

    torch.set_num_threads(1)  # one thread per worker process: the cluster provides the parallelism
    model, tokenizer = load_model(model_dir, device="cpu")
    batches = make_batches(tokenizer, as_examples(rows), batch_size, max_length, first_id=first_id,
                           fmt=prompt_format, by_length=True)
    stats = accumulate(model, batches, modules, fingerprint=fingerprint, data_digest=data_digest)
    paths = {}
    for name, st in stats.items():
        path = Path(out_dir) / f"shard-{first_id}-{safe_name(name)}.safetensors"
        st.save(path)
        paths[name] = str(path)
    return paths


def sharded_statistics(model_dir: str, rows: list[dict], modules: list[str], *, fingerprint: str,
                       data_digest: str, out_dir: Path, workers: int = 2, address: str | None = None,
                       batch_size: int = 16, max_length: int = 512, first_id: int = 0,
                       prompt_format: str = "qa") -> dict[str, GramStats]:
    """Retain statistics computed on a Dask cluster (an existing one at `address`, or a local one with `workers`
    processes) and merged on the driver. Equal to the single-process result up to float64 summation order."""
    from dask.distributed import Client, LocalCluster

    cluster = None
    if address:
        client = Client(address)
    else:
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None)
        client = Client(cluster)
    try:
        n_shards = max(1, len(client.scheduler_info()["workers"]))
        size = -(-len(rows) // n_shards)
        out_dir.mkdir(parents=True, exist_ok=True)
        futures = [client.submit(shard_statistics, model_dir, rows[start:start + size], first_id + start, modules,
                                 fingerprint, data_digest, batch_size, max_length, str(out_dir), prompt_format,
                                 pure=False)
                   for start in range(0, len(rows), size)]
        log.info("retain statistics: %d shards on %d Dask workers", len(futures), n_shards)
        merged: dict[str, GramStats] = {}
        for paths in client.gather(futures):
            for name, path in paths.items():
                part = GramStats.load(path, expect_fingerprint=fingerprint)
                merged[name] = part if name not in merged else merged[name].merge(part, data_digest=data_digest)
        for stats in merged.values():
            stats.data_digest = data_digest
        return merged
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
