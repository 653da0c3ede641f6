"""Signals: SIGTERM unwinds a run like Ctrl-C (finally blocks and rollbacks run), and what a SIGKILLed grom process
started (Prefect's temporary server) does not outlive it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = str(Path(__file__).resolve().parents[1])


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path} never appeared"


def test_sigterm_unwinds_the_run(tmp_path):
    ready, cleaned = tmp_path / "ready", tmp_path / "cleaned"
    child = _python(f"""
import time
from pathlib import Path
from flows.runtime import stop_on_sigterm
stop_on_sigterm()
try:
    Path({str(ready)!r}).write_text("x")
    time.sleep(120)
finally:
    Path({str(cleaned)!r}).write_text("rolled back")
""")
    _wait_for(ready)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 128 + signal.SIGTERM
    assert cleaned.read_text() == "rolled back"


def test_children_of_a_killed_process_are_ended(tmp_path):
    pid_file = tmp_path / "child.pid"
    parent = _python(f"""
import subprocess, sys, time
from pathlib import Path
from flows.reaper import watch_children
watch_children()
server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
time.sleep(1.5)  # the watchdog polls every 0.5 s: it has seen the child
Path({str(pid_file)!r}).write_text(str(server.pid))
time.sleep(600)
""")
    _wait_for(pid_file)
    server = psutil.Process(int(pid_file.read_text()))
    parent.send_signal(signal.SIGKILL)  # no handler, no finally: only the watchdog can end the child now
    parent.wait(timeout=30)
    gone, alive = psutil.wait_procs([server], timeout=30)
    assert gone and not alive
