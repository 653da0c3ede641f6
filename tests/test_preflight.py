"""Bad input to `grom unlearn` and `grom model register`, as a new user or an attacker gives it: each is one line on
stderr naming the problem and the fix, exit code 2, before any work, and the workspace is left as it was."""

import json
import shutil
import struct
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import FORGET, RETAIN, run_grom
from safetensors.torch import load_file, save_file

ROWS = [ex.record() for ex in FORGET[:4]]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _model_copy(trained_dir, tmp_path, change) -> Path:
    out = tmp_path / "model"
    shutil.copytree(trained_dir, out)
    change(out)
    return out


def _truncate(out):
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    (header,) = struct.unpack("<Q", data[:8])
    weights.write_bytes(data[:8 + header + 1000])  # the header is whole, the tensors are not


def _corrupt_header(out):
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", 50) + b"{not json at all, definitely not a header}!!!!!!!" + data[58:])


def _nan_weights(out):
    tensors = load_file(str(out / "model.safetensors"))
    name = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _config(text):
    return lambda out: (out / "config.json").write_text(text)


def _no_tokenizer(out):
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "special_tokens_map.json"):
        (out / name).unlink(missing_ok=True)


MODEL_FAULTS = {
    "truncated weights": (_truncate, "is truncated"),
    "corrupt header": (_corrupt_header, "not a readable safetensors file"),
    "NaN weights": (_nan_weights, "NaN or infinite"),
    "no config": (lambda out: (out / "config.json").unlink(), "has no config.json"),
    "config not JSON": (_config("{model_type: llama"), "is not valid JSON"),
    "unknown architecture": (_config(json.dumps({"model_type": "mamba"})), "unknown architecture 'mamba'"),
    "no tokenizer": (_no_tokenizer, "no tokenizer files"),
    "pickle weights only": (lambda out: (out / "model.safetensors").rename(out / "pytorch_model.bin"),
                            "no .safetensors weights"),
}


def _bad_files(root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (forget file, expected message)."""
    root.mkdir(exist_ok=True)
    (root / "notutf8.jsonl").write_bytes(b'{"question": "caf\xe9", "answer": "x"}\n')
    (root / "empty.jsonl").write_text("")
    (root / "rows.txt").write_text("q\ta\n")
    columns = root / "columns.json"
    columns.write_text(json.dumps({"question": [r["question"] for r in ROWS], "answer": [r["answer"] for r in ROWS]}))
    ints = root / "ints.parquet"
    pq.write_table(pa.table({"question": ["How many?"], "answer": pa.array([3], pa.int64())}), ints)
    binary = root / "binary.parquet"
    pq.write_table(pa.table({"text": pa.array([b"\x00\x01"], pa.binary())}), binary)
    return {
        "missing file": (root / "nope.jsonl", "does not exist"),
        "unsupported suffix": (root / "rows.txt", "unsupported file type"),
        "not UTF-8": (root / "notutf8.jsonl", "not UTF-8"),
        "empty file": (root / "empty.jsonl", "holds no rows"),
        "column-oriented JSON": (columns, "column-oriented"),
        "int answer in Parquet": (ints, "'answer' is int"),
        "binary text in Parquet": (binary, "'text' is bytes"),
        "answer is an object": (_jsonl(root / "obj.jsonl", [{"question": "q?", "answer": {"a": 1}}]),
                                "'answer' is dict"),
        "no question nor text": (_jsonl(root / "none.jsonl", [{"prompt": "x"}]), "has no value for"),
        "blank answer": (_jsonl(root / "blank.jsonl", [{"question": "q?", "answer": "   "}]), "has no value for"),
        "duplicate rows": (_jsonl(root / "dup.jsonl", [ROWS[0], ROWS[1], ROWS[0]]), "rows 1 and 3 are the same"),
        "forget also retained": (_jsonl(root / "overlap.jsonl", [RETAIN[0].record()]), "cannot be forgotten and kept"),
        "longer than the model": (_jsonl(root / "long.jsonl", [{"text": "word " * 300}]), "longer than the model's"),
    }


PARAMS = {
    "gain a string": ('{"gain": "high"}', "GromParams.gain must be float"),
    "negative gain": ('{"gain": -5}', "need gain > 0"),
    "a drop kind's knob flat": ('{"beta": 40}', "GromParams has no parameter 'beta'"),
    "zero batch": ('{"batch_size": 0}', "batch_size >= 1"),
    "layers a string": ('{"layers": "a"}', "GromParams.layers must be a list of int"),
    "layer out of range": ('{"layers": [99]}', "layers [99] do not exist"),
    "unknown key": ('{"bogus": 1}', "has no parameter 'bogus'"),
    "not JSON": ("{beta: 1}", "not valid JSON"),
    "unknown target": ('{"target": "erase"}', "target must be 'suppress' or 'corrupt'"),
}


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def _refused(capsys, monkeypatch, home: Path, args: list[str], expected: str) -> None:
    before = _snapshot(home)
    code, out, err = run_grom(capsys, monkeypatch, *args, "--home", str(home))
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and out == "", err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], err[-2000:]
    assert _snapshot(home) == before  # nothing written: catalog, registry, lake and models as they were


@pytest.fixture()
def inputs(tmp_path):
    home = tmp_path / "ws"
    home.mkdir()
    return {"home": home, "forget": _jsonl(tmp_path / "forget.jsonl", ROWS),
            "retain": _jsonl(tmp_path / "retain.jsonl", [ex.record() for ex in RETAIN])}


@pytest.mark.parametrize("fault", sorted(MODEL_FAULTS))
def test_a_broken_model_folder_is_refused(fault, trained_dir, tmp_path, inputs, capsys, monkeypatch):
    change, expected = MODEL_FAULTS[fault]
    model = _model_copy(trained_dir, tmp_path, change)
    _refused(capsys, monkeypatch, inputs["home"], ["unlearn", "--model", str(model), "--forget",
                                                   str(inputs["forget"]), "--retain", str(inputs["retain"])], expected)


BAD_FILES = ("missing file", "unsupported suffix", "not UTF-8", "empty file", "column-oriented JSON",
             "int answer in Parquet", "binary text in Parquet", "answer is an object", "no question nor text",
             "blank answer", "duplicate rows", "forget also retained", "longer than the model")


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_forget_file_is_refused(case, trained_dir, tmp_path, inputs, capsys, monkeypatch):
    files = _bad_files(tmp_path / "bad")
    assert set(files) == set(BAD_FILES)
    path, expected = files[case]
    _refused(capsys, monkeypatch, inputs["home"], ["unlearn", "--model", str(trained_dir), "--forget", str(path),
                                                   "--retain", str(inputs["retain"])], expected)


@pytest.mark.parametrize("case", sorted(PARAMS))
def test_bad_parameters_are_refused_like_flags(case, trained_dir, inputs, capsys, monkeypatch):
    params, expected = PARAMS[case]
    common = ["--model", str(trained_dir), "--retain", str(inputs["retain"]), "--params", params]
    _refused(capsys, monkeypatch, inputs["home"], ["unlearn", "--forget", str(inputs["forget"]), *common], expected)
    # a service stores its parameters: they are checked the same way when it is registered
    _refused(capsys, monkeypatch, inputs["home"], ["model", "register", *common], expected)


@pytest.mark.parametrize(("name", "expected"), [("../../x", "is not allowed"), ("it's", "is not allowed"),
                                                ("a" * 101, "is not allowed")])
def test_names_that_mlflow_or_the_file_system_would_trip_on_are_refused(name, expected, trained_dir, inputs, capsys,
                                                                        monkeypatch):
    _refused(capsys, monkeypatch, inputs["home"], ["unlearn", "--model", str(trained_dir), "--forget",
                                                   str(inputs["forget"]), "--retain", str(inputs["retain"]),
                                                   "--model-name", name], expected)
    _refused(capsys, monkeypatch, inputs["home"], ["model", "register", "--model", str(trained_dir), "--retain",
                                                   str(inputs["retain"]), "--name", name], expected)


def test_a_model_folder_with_good_weights_passes_every_check(trained_dir):
    from flows.preflight import check_model

    assert check_model(trained_dir)["model_type"] == "llama"
    assert torch.isfinite(next(iter(load_file(str(Path(trained_dir) / "model.safetensors")).values()))).all()
