"""Children die with their parent: a watchdog for the temporary Prefect server a `grom` process starts.

Prefect starts its temporary API server (uvicorn) as a child process and stops it on a normal exit; a parent
killed with SIGKILL cannot, and the server lives on, reparented to PID 1. `watch_children()` starts (once per
process) a small watchdog process, `python -m flows.reaper PID`, that records the parent's descendants every half
second and, once the parent is gone, terminates them (SIGTERM, then SIGKILL after a grace period) and exits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

POLL_S = 0.5
GRACE_S = 3.0
_started: set[int] = set()  # pids that have a watchdog (a forked child gets its own)


def watch_children() -> None:
    """Start the watchdog for this process, once."""
    pid = os.getpid()
    if pid in _started:
        return
    subprocess.Popen([sys.executable, "-m", "flows.reaper", str(pid)], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _started.add(pid)


def reap(parent_pid: int) -> list[int]:
    """Watch `parent_pid` until it is gone, then end the descendants it had; returns their pids."""
    me = os.getpid()
    known: dict[int, psutil.Process] = {}
    try:
        parent = psutil.Process(parent_pid)
        while parent.is_running() and parent.status() != psutil.STATUS_ZOMBIE:
            for child in parent.children(recursive=True):
                if child.pid != me:
                    known.setdefault(child.pid, child)
            time.sleep(POLL_S)
    except psutil.NoSuchProcess:
        pass
    alive = [p for p in known.values() if p.is_running()]  # is_running also checks the pid was not reused
    for process in alive:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            continue
    _, left = psutil.wait_procs(alive, timeout=GRACE_S)
    for process in left:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    return [p.pid for p in alive]


if __name__ == "__main__":
    reap(int(sys.argv[1]))
