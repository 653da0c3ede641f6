"""The deployments of prefect.yaml as a user runs them: a local Prefect server on 127.0.0.1, `prefect deploy --all`
from the repository root, a process worker on the pool, and one run of each deployment through it."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import FORGET, RETAIN

from tasks import requests as queue
from tasks.catalog import Catalog
from tasks.tracking import serving_version, versions

pytestmark = pytest.mark.e2e  # the end-to-end tier: real flows, registry, catalog and CLI

REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_healthy(url: str, server: subprocess.Popen, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"the Prefect server did not answer: {log.read_text()[-3000:]}")


def _run(args, env, **kwargs):
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, **kwargs)
    assert done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])
    return done


def _finish(client, run_id, worker: subprocess.Popen, log: Path, timeout_s: float = 900):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert worker.poll() is None, log.read_text()[-3000:]
        state = client.read_flow_run(run_id).state
        if state is not None and state.is_final():
            return state
        time.sleep(2)
    raise AssertionError(f"flow run {run_id} did not finish: {log.read_text()[-3000:]}")


def test_prefect_deploy_all_and_a_worker_run_both_deployments(trained_dir, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    data = tmp_path / "data"
    data.mkdir()
    files = {}
    for name, rows in (("forget", FORGET[:8]), ("request", FORGET[8:]), ("retain", RETAIN)):
        files[name] = data / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(ex.record()) + "\n" for ex in rows))
    home = tmp_path / "ws"
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
           "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": url, "GROM_REPO_DIR": str(REPO),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    logs = {name: tmp_path / f"{name}.log" for name in ("server", "worker")}
    with logs["server"].open("w") as out:
        server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    worker = None
    try:
        _wait_healthy(url, server, logs["server"])
        _run([PREFECT, "work-pool", "create", "grom-pool", "--type", "process"], env)
        deployed = _run([PREFECT, "--no-prompt", "deploy", "--all"], env, cwd=REPO)  # as prefect.yaml's header says
        assert "unlearn/unlearn" in deployed.stdout and "process-deletion-requests" in deployed.stdout
        # a service with one pending request, through the CLI, in the same workspace
        grom = [sys.executable, "-m", "flows.cli"]
        _run(grom + ["model", "register", "--model", str(trained_dir), "--retain", str(files["retain"]), "--home",
                     str(home), "--name", "svc", "--evaluation", '{"quantizers": ["rtn4"], "attacks": ["head_swap"]}',
                     "--json"], env)
        _run(grom + ["request", "add", "--forget", str(files["request"]), "--home", str(home), "--json"], env)
        with logs["worker"].open("w") as out:
            worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "grom-pool"], env=env, cwd=REPO,
                                      stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        with temporary_settings(updates={PREFECT_API_URL: url}), get_client(sync_client=True) as client:
            runs = {}
            for name, parameters in (
                    ("unlearn/unlearn", {"model": str(trained_dir), "forget": str(files["forget"]),
                                         "retain": str(files["retain"]), "home": str(home), "model_name": "unl",
                                         "quantization": False}),
                    ("process-deletion-requests/process-deletion-requests", {"home": str(home)})):
                deployment = client.read_deployment_by_name(name)
                run = client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
                runs[name] = _finish(client, run.id, worker, logs["worker"])  # one after the other
        assert {name: state.type.value for name, state in runs.items()} == {
            "unlearn/unlearn": "COMPLETED", "process-deletion-requests/process-deletion-requests": "COMPLETED"}, \
            logs["worker"].read_text()[-4000:]
    finally:
        for process in (worker, server):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, 9)
                process.wait()
    # the catalog and the registry as after the CLI
    catalog = Catalog(home / "catalog.duckdb")
    flows = sorted((r["flow"], r["model_name"]) for r in catalog.query("SELECT flow, model_name FROM runs"))
    assert flows == [("process-deletion-requests", "svc"), ("register", "svc"), ("unlearn", "unl")]
    assert [(r["status"], r["model_version"]) for r in queue.list_requests(catalog)] in ([("done", "2")],
                                                                                          [("review", "2")])
    assert sorted(str(v.version) for v in versions(home, "svc")) == ["1", "2"]
    assert serving_version(home, "svc") in ("1", "2")
    assert sorted(str(v.version) for v in versions(home, "unl")) == ["1", "2"]  # the root and the edit
