"""`grom serve`: run `process-deletion-requests` on a schedule.

With PREFECT_API_URL set, the flow is served against that server. Without it, a local Prefect server is started
first (state under <workspace>/prefect, log in <workspace>/prefect/server.log) and stopped with `grom serve`:
Ctrl-C, or SIGTERM to the `grom serve` process, stops the runner and then the server it started.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from flows.runtime import prefect_environment, prefect_home
from flows.workspace import Workspace
from grom_core.errors import GromError

log = logging.getLogger("grom.serve")

DEPLOYMENT = "process-deletion-requests"


def start_local_server(ws: Workspace, port: int, timeout_s: float = 180) -> subprocess.Popen:
    """Start `prefect server start` on 127.0.0.1:`port` (its database under the workspace) and wait until its
    health endpoint answers."""
    logfile = ws.root / "prefect" / "server.log"
    logfile.parent.mkdir(parents=True, exist_ok=True)
    prefect = Path(sys.executable).with_name("prefect")
    command = [str(prefect) if prefect.exists() else "prefect", "server", "start", "--host", "127.0.0.1",
               "--port", str(port)]
    with logfile.open("ab") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                  env={**os.environ, **prefect_home(ws)}, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = logfile.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise GromError(f"the local Prefect server exited at start ({tail[0]}); is port {port} taken? pass "
                            f"--port, or set PREFECT_API_URL to a running server (log: {logfile})")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    log.info("local Prefect server at %s (log %s)", url, logfile)
                    return server
        except OSError:
            time.sleep(0.5)
    stop_server(server)
    raise GromError(f"the local Prefect server did not answer within {timeout_s:.0f} s (log: {logfile})")


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)  # the server runs its API in child processes: stop the whole group
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _interrupt(signum, frame) -> None:
    """SIGTERM before the runner starts: unwind through the finally of `serve`, which stops the server."""
    raise KeyboardInterrupt


def _ctrl_c(signum, frame) -> None:
    """Ctrl-C as SIGTERM. Prefect's runner stops gracefully on SIGTERM (its own handler, once started), while a
    SIGINT only cancels asyncio's main task, which the runner's task groups can swallow."""
    os.kill(os.getpid(), signal.SIGTERM)


def serve(home: str | None = None, cron: str | None = "*/30 * * * *", interval_s: float | None = None,
          model_name: str | None = None, port: int = 4200) -> None:
    """Serve the scheduled deletion-request run until interrupted; `interval_s` replaces `cron` when given.

    One run at a time (`limit=1`): a run that lasts longer than the interval delays the next one instead of
    overlapping it (overlapping runs would be safe, as claims are atomic, but would only find nothing to do)."""
    ws = Workspace.resolve(home)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _ctrl_c)
    server, api_url = None, os.environ.get("PREFECT_API_URL")
    try:
        if not api_url:
            server = start_local_server(ws, port)
            api_url = f"http://127.0.0.1:{port}/api"
        from flows.process_requests import process_deletion_requests

        schedule = {"interval": interval_s} if interval_s else {"cron": cron}
        log.info("serving %s (%s) for workspace %s; stop with Ctrl-C", DEPLOYMENT, schedule, ws.root)
        with prefect_environment(ws, api_url=api_url):
            process_deletion_requests.serve(name=DEPLOYMENT, limit=1, pause_on_shutdown=False,
                                            parameters={"home": str(ws.root), "model_name": model_name},
                                            **schedule)
    except KeyboardInterrupt:
        log.info("stopping")
    finally:
        if server is not None:
            stop_server(server)
            log.info("local Prefect server stopped")
