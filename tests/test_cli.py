"""The `grom` console script as a user runs it: JSON on stdout, logs on stderr, one-line errors."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ATTACK, HAS_BITSANDBYTES, run_grom

pytestmark = pytest.mark.e2e  # the end-to-end tier: real flows, registry, catalog and CLI


def grom(*args, env=None):
    # no tight limit: the demo takes minutes on 2 cores, and a loaded machine may need several times that
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, timeout=3600)


def test_demo_json(small_workspace, harness):
    """The README's main command, on a smaller minitofu (10 authors) so that the suite stays quick: first as a user
    runs it (its own temporary Prefect server), then against the session's server (one server start fewer)."""
    from prefect.settings import PREFECT_API_URL

    tmp_path = small_workspace
    done = grom("demo", "--json", "--authors", "10", "--home", str(tmp_path / "ws"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # exactly one JSON object, nothing else on stdout
    assert result["method"] == "grom" and len(result["edit_id"]) == 16
    from pathlib import Path

    assert list(Path(result["model_dir"]).glob("*.safetensors")) and result["peak_rss_mb"] > 100  # torch alone
    before, after = result["metrics"]["before"], result["metrics"]["after"]
    assert {"forget_quality", "model_utility", "forget_rougeL_recall", "retain_rougeL_recall",
            "forget_truth_ratio"} <= set(after)
    assert after["forget_rougeL_recall"] < before["forget_rougeL_recall"]
    timings = result["timings_s"]
    assert result["mlflow"]["version"] == "2"  # version 1 holds the unedited weights, version 2 the edit
    assert timings["total"] >= sum(timings[k] for k in ("ingest", "unlearn", "evaluate_before", "evaluate_after"))
    quantized = result["metrics"]["quantized"]
    attacks = ({"fp4", "nf4", "int8", "rtn4", "gguf_q4_1", "fp4_head_kept"} if HAS_BITSANDBYTES
               else {"rtn4", "gguf_q4_1", "_note"})
    assert attacks == set(quantized)
    attack = quantized[ATTACK]
    assert "recovery_forget_rougeL_recall" in attack and 0 <= attack["codes_changed"] <= 1
    assert (tmp_path / "ws" / "catalog.duckdb").exists()
    # quiet by default: a summary line per stage, none of the libraries' own lines (grom -v brings them back)
    assert "stage unlearn" in done.stderr and "stage quantization" in done.stderr
    for noise in ("Finished in state", "Beginning flow run", "Loading weights", "Writing model shards",
                  "Successfully registered model", "mlflow.store.db.utils", "interpreted in multiple ways"):
        assert noise not in done.stderr, noise
    # a gradient baseline through the same flow, reusing the trained models of the first run
    done = grom("demo", "--json", "--authors", "10", "--home", str(tmp_path / "ws"), "--method", "npo",
                "--compose", "sago", "--params", '{"trainer": {"epochs": 2}}', "--no-quantization",
                env={"PREFECT_API_URL": PREFECT_API_URL.value()})
    assert done.returncode == 0, done.stderr[-3000:]
    npo = json.loads(done.stdout)
    assert npo["method"] == "npo" and npo["compose"] == "sago" and npo["unlearning"]["steps"] > 0
    assert npo["mlflow"]["version"] == "3" and npo["unlearning"]["peak_rss_mb"] > 0
    assert npo["metrics"]["before"] == result["metrics"]["before"] and npo["metrics"]["quantized"] == {}
    done = grom("demo", "--home", str(tmp_path / "ws"), "--method", "grom", "--compose", "sago")
    assert done.returncode == 2 and "gradient methods only" in done.stderr


def test_workspace_that_is_a_file_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    done = grom("demo", "--home", str(blocker / "ws"))
    assert done.returncode == 2
    assert "not writable" in done.stderr and "Traceback" not in done.stderr


def test_bad_option_is_a_usage_error(tmp_path, capsys, monkeypatch):
    """Usage errors exit 2 with one line and no traceback, before anything is built (in this process: ten CLI
    starts would cost a minute; test_demo_json runs the console script itself)."""

    def in_process(*args):
        code, out, err = run_grom(capsys, monkeypatch, *args)
        return subprocess.CompletedProcess(args, code, out, err)

    done = in_process("demo", "--authors", "2", "--home", str(tmp_path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    done = in_process("demo", "--split", "forget50", "--home", str(tmp_path))
    assert done.returncode == 2 and "forget10" in done.stderr and "Traceback" not in done.stderr
    done = in_process("bench", "--benchmark", "minimuse", "--config", '{"shared_name": false}', "--home", str(tmp_path))
    assert done.returncode == 2 and "shared_names" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "benchmarks").exists()  # refused before anything was built
    done = in_process("benchmark", "build", "minimuse", "--config", '{"per_part": "2"}', "--home", str(tmp_path))
    assert done.returncode == 2 and "per_part must be int" in done.stderr and "Traceback" not in done.stderr
    done = in_process("evaluate", "--benchmark", "minimuse", "--model", str(tmp_path / "none"), "--config",
                      '{"shared_name": false}', "--home", str(tmp_path))
    assert done.returncode == 2 and "shared_names" in done.stderr and "Traceback" not in done.stderr
    # rows of one's own are ablation rows; their parameters are checked before anything is built
    done = in_process("bench", "--params", '{"relative_ridge": 0.1}', "--home", str(tmp_path))
    assert done.returncode == 2 and "add --ablation" in done.stderr and "Traceback" not in done.stderr
    done = in_process("bench", "--ablation", "--params", '[{"relative_ridge": 0.1}, {"ridge": 1}]', "--home",
                      str(tmp_path))
    assert done.returncode == 2 and "no parameter 'ridge'" in done.stderr and "Traceback" not in done.stderr
    done = in_process("bench", "--ablation", "--params", '[1, 2]', "--home", str(tmp_path))
    assert done.returncode == 2 and "a list of objects" in done.stderr and "Traceback" not in done.stderr
    done = in_process("bench", "--ablation", "--quantizers", "rtn4,q3", "--home", str(tmp_path))
    assert done.returncode == 2 and "no attack named 'q3'" in done.stderr
    assert not (tmp_path / "benchmarks").exists()


def test_tofu_score_on_the_real_logs():
    logs = "data/tofu/eval-logs"
    done = grom("tofu-score", f"{logs}/llama2-7b_full.json", "--retain", f"{logs}/llama2-7b_retain90.json", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert abs(result["forget_quality"] / 1.8e-21 - 1) < 0.05 and result["forget_quality_n"] == 300
    assert abs(result["model_utility"] - 0.62) < 0.005
    done = grom("tofu-score", "data/tofu/idontknow.jsonl", "--retain", f"{logs}/llama2-7b_retain90.json")
    assert done.returncode == 2 and "Traceback" not in done.stderr


def test_finetune_from_scratch_then_continue(tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"What is item {i}?", "answer": f"Item {i} is blue."})
                              for i in range(12)))
    done = grom("finetune", "--data", str(data), "--out", str(tmp_path / "m1"), "--epochs", "2", "--hidden-size",
                "32", "--layers", "1", "--vocab-size", "300", "--json")
    assert done.returncode == 0, done.stderr
    first = json.loads(done.stdout)
    assert first["examples"] == 12 and (tmp_path / "m1" / "model.safetensors").exists()
    done = grom("finetune", "--data", str(data), "--base", str(tmp_path / "m1"), "--out", str(tmp_path / "m2"),
                "--epochs", "2", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["final_loss"] < first["final_loss"]
    done = grom("finetune", "--data", str(tmp_path / "nope.csv"), "--out", str(tmp_path / "m3"))
    assert done.returncode == 2 and "does not exist" in done.stderr
    assert not (tmp_path / "m3").exists()
