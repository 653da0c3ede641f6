"""The process and Prefect settings grom runs under.

`configure_process` (called first thing by `grom`'s `main()`) sets what does not depend on the workspace: no
telemetry, no network for Hugging Face, a generous start-up timeout for Prefect's temporary server. Variables the
user set are left alone.

`prefect_environment(ws)` applies the workspace's Prefect settings (its home under the workspace) with Prefect's
own `temporary_settings`, around a flow call: which module imported Prefect first does not matter. With
PREFECT_API_URL set (a real server) that server is used, and a PREFECT_HOME the user set is kept.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from flows.workspace import Workspace

PROCESS_DEFAULTS = {
    # a temporary server takes 15-25 s to start on 2 cores; the default timeout of 20 s is too tight
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LOG_PRINTS": "false",
    "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ENABLE_TELEMETRY": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # transformers' "Loading weights" / "Writing model shards" / GGUF conversion bars (tqdm, which reads
    # TQDM_DISABLE): a model of a few hundred tensors loads in seconds, and a bar per load buries the stage lines;
    # grom's own bars are rich's
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
}

QUIET_DEFAULTS = {
    # Prefect's own run-state lines ("Finished in state Completed()", commit hooks, the temporary server's notice)
    # and MLflow's (database migrations, "Successfully registered model"): each library configures its loggers
    # itself when imported, from these variables
    "PREFECT_LOGGING_LEVEL": "ERROR",
    "MLFLOW_LOGGING_LEVEL": "ERROR",
}


def configure_process() -> None:
    """Process-wide defaults (see PROCESS_DEFAULTS); the user's own environment wins."""
    for key, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(key, value)


def quiet_libraries(verbose: bool) -> None:
    """Without `grom -v`, Prefect and MLflow log errors only (QUIET_DEFAULTS; set before either is imported, which
    `grom`'s commands do lazily). The user's own environment wins."""
    if not verbose:
        for key, value in QUIET_DEFAULTS.items():
            os.environ.setdefault(key, value)


def set_threads(threads: int | None) -> None:
    """The CPU threads torch uses in this process and the processes it starts (Dask workers): `threads`, else
    OMP_NUM_THREADS where the user set it (torch reads it at import), else torch's default (one per core)."""
    if threads is None:
        return
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


KILL_AFTER_ENV = "GROM_KILL_AFTER_STAGE"


def kill_point(stage: str) -> None:
    """Fault injection for the kill tests: with GROM_KILL_AFTER_STAGE=<stage> the process SIGKILLs itself as that
    stage ends (no handler, no finally: what the OOM killer or a power cut does). Unset, it does nothing."""
    if os.environ.get(KILL_AFTER_ENV) == stage:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def stop_on_sigterm() -> None:
    """SIGTERM stops a run the way Ctrl-C does: the exception unwinds the flow, so open transactions roll back,
    claimed requests are given back and Prefect's temporary server is stopped (Python's default would end the
    process without any of that, or leave a run going while its server is gone)."""
    import signal
    import threading

    def stop(signum, frame) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
        signal.signal(signal.SIGTERM, stop)


def prefect_home(ws: Workspace) -> dict[str, str]:
    """PREFECT_HOME for this workspace, unless the user set one."""
    return {} if "PREFECT_HOME" in os.environ else {"PREFECT_HOME": str(ws.root / "prefect")}


@contextmanager
def prefect_environment(ws: Workspace, api_url: str | None = None) -> Iterator[None]:
    """Prefect settings for flow runs of this workspace, for the duration of the block; `api_url` points the runs
    at a server (default: PREFECT_API_URL if set, else a temporary local server)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    updates = {}
    if "PREFECT_HOME" in prefect_home(ws):
        updates[PREFECT_HOME] = prefect_home(ws)["PREFECT_HOME"]
    if api_url:
        updates[PREFECT_API_URL] = api_url
    if not (api_url or os.environ.get("PREFECT_API_URL")):
        from flows.reaper import watch_children

        watch_children()  # the temporary server Prefect starts must not outlive a killed process
    with temporary_settings(updates=updates):
        quiet_prefect_tracebacks()
        yield


class _NoTraceback:
    """Keeps Prefect's failure messages but drops their tracebacks: a user mistake gets one line, not a trace."""

    def filter(self, record) -> bool:
        if record.exc_info:
            record.msg = f"{record.getMessage()}: {record.exc_info[1]}"
            record.args = ()
            record.exc_info = None
            record.exc_text = None
        return True


_FILTER = _NoTraceback()


def quiet_prefect_tracebacks() -> None:
    """Attach the filter to Prefect's run loggers (once; Prefect configures its loggers when imported)."""
    for name in ("prefect.flow_runs", "prefect.task_runs", "prefect.flow_engine", "prefect.task_engine"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
