"""Prefect's environment for the embedded default: a temporary local server, state under the workspace.

Prefect reads its settings when it is imported, so `configure_prefect` runs before any module importing prefect.
With PREFECT_API_URL set (a real server), that server is used instead and nothing here overrides it.
"""

from __future__ import annotations

import os

from flows.workspace import Workspace


def configure_prefect(ws: Workspace) -> None:
    os.environ.setdefault("PREFECT_HOME", str(ws.root / "prefect"))
    # a temporary server takes 15-25 s to start on 2 cores; the default timeout of 20 s is too tight
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LOG_PRINTS", "false")
    os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class _NoTraceback:
    """Keeps Prefect's failure messages but drops their tracebacks: a user mistake gets one line, not a trace."""

    def filter(self, record) -> bool:
        if record.exc_info:
            record.msg = f"{record.getMessage()}: {record.exc_info[1]}"
            record.args = ()
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_prefect_tracebacks() -> None:
    """Call after prefect is imported (it configures its loggers on import)."""
    import logging

    for name in ("prefect.flow_runs", "prefect.task_runs", "prefect.flow_engine", "prefect.task_engine"):
        logging.getLogger(name).addFilter(_NoTraceback())
