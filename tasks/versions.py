"""Registered versions as a chain of edits: only the root of a chain holds full weights.

A 135M model is 540 MB per copy and a 7B one 14 GB, so an edited version does not store its weights: it stores
its edit (the factors, the undo and the manifest, a few MB, logged as the run's `edit` artifact) and the version
it was computed from. Its weights are materialised on demand: the parent's weights (materialised the same way),
the edit applied, the result checked against the version's `fingerprint` tag and cached under
`<workspace>/cache/registry/NAME/VERSION`. Applying an edit is deterministic, so a materialised version is bit for
bit the model the flow evaluated and registered.

How a version keeps its weights (tag `grom.storage`):

    full   a transformers model logged with the run (a registered base model; versions from before this scheme)
    edit   `edit_id` applied to `parent_version` (an unlearning run, a processed deletion request)
    same   the weights of version `restores` (a revert gives back its parent's weights exactly)
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from grom_core.errors import DataError, FingerprintMismatchError
from tasks.names import safe_name
from tasks.tracking import client, get_version

log = logging.getLogger(__name__)

FULL, EDIT, SAME = "full", "edit", "same"
STORAGE_TAG = "grom.storage"


def storage(tags: dict) -> str:
    return tags.get(STORAGE_TAG, FULL)


def cache_dir(root: Path, name: str, version: str) -> Path:
    return root / "cache" / "registry" / safe_name(name) / str(version)


def _saved_model(folder: Path) -> Path | None:
    """The folder under `folder` that holds a saved model (config.json beside safetensors), or None."""
    if not folder.is_dir():
        return None
    found = sorted(p.parent for p in folder.rglob("config.json") if any(p.parent.glob("*.safetensors")))
    return found[0] if found else None


def version_model_dir(root: Path, name: str, version: str, _chain: tuple[str, ...] = ()) -> Path:
    """A local folder with the weights of `version` of `name`: the folder the run saved (tag `model_dir`) while it
    is still there, else the materialised copy (see `materialize`). Callers that must be sure of the weights
    compare them with the `fingerprint` tag (the request flow does, before any work)."""
    tags = get_version(root, name, version).tags
    local = Path(tags.get("model_dir", ""))
    if tags.get("model_dir") and (local / "config.json").is_file():
        return local
    return materialize(root, name, version, _chain)


def materialize(root: Path, name: str, version: str, _chain: tuple[str, ...] = ()) -> Path:
    """The weights of `version` as a safetensors folder under the workspace's registry cache, built once.

    full: the registered artifacts downloaded. edit: the parent materialised (recursively), the edit applied and
    the result checked against the `fingerprint` tag before it is saved (under a temporary name, then renamed).
    same: the version it restores."""
    version = str(version)
    if version in _chain:
        raise DataError(f"the versions of '{name}' refer to each other in a loop ({' -> '.join(_chain + (version,))})")
    tags = get_version(root, name, version).tags
    kind = storage(tags)
    if kind == SAME:
        return materialize(root, name, tags["restores"], _chain + (version,))
    out = cache_dir(root, name, version)
    found = _saved_model(out)
    if found is not None:
        return found
    if kind == FULL:
        return _download_full(root, name, version, out)
    if kind != EDIT:
        raise DataError(f"version {version} of '{name}' has storage '{kind}', which this grom does not know; "
                        f"upgrade grom")
    parent = tags.get("parent_version")
    if not parent or not tags.get("edit_id"):
        raise DataError(f"version {version} of '{name}' is stored as an edit but names no parent version or edit id")
    parent_dir = version_model_dir(root, name, parent, _chain + (version,))
    return _apply_edit(root, name, version, tags, parent_dir, out)


def _download_full(root: Path, name: str, version: str, out: Path) -> Path:
    import mlflow

    log.info("materialising %s version %s: downloading its registered weights", name, version)
    mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=str(out))
    found = _saved_model(out)
    if found is None:
        raise DataError(f"version {version} of '{name}' has no safetensors weights among its artifacts; register "
                        f"the model again")
    _gather_tokenizer(out, found)
    return found


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _gather_tokenizer(out: Path, model_dir: Path) -> None:
    """MLflow's transformers flavour logs the tokenizer beside the weights (`components/tokenizer/`), not with
    them: copy its files into the weights' folder, so that the folder loads on its own like the one registered."""
    if any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        return
    found = sorted(p.parent for f in TOKENIZER_FILES for p in out.rglob(f) if p.parent != model_dir)
    if not found:
        raise DataError(f"the registered artifacts under {out} hold no tokenizer; register the model again")
    for item in found[0].iterdir():
        if item.is_file() and not (model_dir / item.name).exists():
            shutil.copy2(item, model_dir / item.name)


def edit_folder(root: Path, name: str, version: str, tags: dict) -> Path:
    """The edit of a version: the workspace's own copy (`edits/<edit id>`) when it is there, else the run's `edit`
    artifact downloaded into the registry cache."""
    local = root / "edits" / safe_name(tags["edit_id"])  # a tag is text anyone with registry access can set
    if (local / "edit.json").is_file():
        return local
    import mlflow

    run_id = get_version(root, name, version).run_id
    dest = cache_dir(root, name, version).with_name(f"{version}.edit")
    log.info("materialising %s version %s: downloading edit %s from run %s", name, version, tags["edit_id"], run_id)
    path = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="edit", dst_path=str(dest)))
    if not (path / "edit.json").is_file():
        raise DataError(f"the run of version {version} of '{name}' has no edit artifact; the version cannot be "
                        f"materialised")
    return path


def _apply_edit(root: Path, name: str, version: str, tags: dict, parent_dir: Path, out: Path) -> Path:
    from grom_core.edit import Edit
    from grom_core.fingerprint import weights_fingerprint
    from tasks.steps import load_for_edit, save_model

    edit = Edit.load(edit_folder(root, name, version, tags))
    model, tokenizer = load_for_edit(str(parent_dir))
    edit.apply(model)  # refuses a parent whose weights are not those the edit was computed on
    fingerprint = weights_fingerprint(model)
    if tags.get("fingerprint") and fingerprint != tags["fingerprint"]:
        raise FingerprintMismatchError(f"edit {edit.edit_id} on version {tags['parent_version']} gave weights "
                                       f"{fingerprint[:12]}, not those registered as version {version} of '{name}' "
                                       f"({tags['fingerprint'][:12]})")
    log.info("materialised %s version %s: edit %s on version %s", name, version, edit.edit_id,
             tags["parent_version"])
    return save_model(model, tokenizer, out)


def drop_materialized(root: Path, name: str, version: str) -> None:
    """Remove the cached weights of a version (they can be materialised again)."""
    out = cache_dir(root, name, version)
    for path in (out, out.with_name(f"{version}.edit")):
        if path.exists():
            shutil.rmtree(path)


def root_version(root: Path, name: str, model_dir: str, fingerprint: str) -> str:
    """The version of `name` whose weights are `fingerprint` (the parent an unlearning run's edit hangs from);
    when there is none, `model_dir` is registered as a full version (`grom.kind` base). In a Prefect transaction
    a later failure deletes that registration again (tracking.register's rollback hook)."""
    from tasks.tracking import register, versions

    for version in sorted(versions(root, name), key=lambda v: int(v.version)):
        if version.tags.get("fingerprint") == fingerprint:
            return str(version.version)
    registration = register(root, run_name=f"base-{name}", model_name=name, params={"model_dir": str(model_dir)},
                            metrics={}, datasets=[], artifacts={}, model_dir=Path(model_dir),
                            tags={"grom.kind": "base", STORAGE_TAG: FULL, "fingerprint": fingerprint,
                                  "model_dir": str(model_dir)})
    return str(registration.version)


def resolve_model(root: Path, model: str) -> str:
    """A model argument as a local folder: `models:/NAME/VERSION` or `models:/NAME@ALIAS` is looked up in the
    workspace's registry (see `version_model_dir`); anything else is taken as a folder."""
    if not model.startswith("models:/"):
        return model
    ref = model.removeprefix("models:/")
    if "@" in ref:
        name, alias = ref.split("@", 1)
        from mlflow.exceptions import MlflowException

        try:
            version = str(client(root).get_model_version_by_alias(name, alias).version)
        except MlflowException as exc:
            raise DataError(f"{model}: registered model '{name}' has no alias '{alias}'") from exc
    else:
        name, _, version = ref.rpartition("/")
        if not name or not version:
            raise DataError(f"{model}: write models:/NAME/VERSION or models:/NAME@ALIAS")
    return str(version_model_dir(root, name, version))
