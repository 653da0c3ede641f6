"""The architecture's layering, checked on the source: grom_core is a library that imports nothing from the
orchestration stack or the layers above it; tasks never import flows. Also: the shipped data is package data."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORCHESTRATION = {"prefect", "mlflow", "duckdb", "pyarrow", "dask", "distributed"}
FORBIDDEN = {
    "grom_core": ORCHESTRATION | {"tasks", "flows"},
    "tasks": {"flows"},
}


def imported_modules(path: Path) -> set[str]:
    """Top-level package names imported anywhere in the file, inside functions too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_nothing_from_the_layers_above(package):
    offenders = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_modules(path) & FORBIDDEN[package]
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}, f"{package} must not import {sorted(FORBIDDEN[package])}: {offenders}"


def test_the_checker_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os\n\ndef f():\n    from flows.evaluation import build\n    import prefect.tasks\n")
    assert imported_modules(source) == {"os", "flows", "prefect"}


def test_the_command_line_and_the_queue_load_no_model_stack_until_a_command_needs_it(tmp_path):
    """`grom --help`, usage errors and the request queue's commands answer in a fraction of a second: importing the
    command line, the method registry, grom_core's errors and the queue's commands, and resolving a workspace, load
    neither torch and transformers nor Prefect and MLflow (the registry names where each method's parameters and
    entry point live; grom_core's exports are imported on first use)."""
    import subprocess
    import sys

    probe = ("import sys, flows.cli, flows.request_queue, grom_core, grom_core.errors, grom_core.methods as m; "
             "from flows.workspace import Workspace; "
             f"Workspace.resolve({str(tmp_path / 'ws')!r}); "
             "heavy = sorted({'torch', 'transformers', 'scipy', 'prefect', 'mlflow', 'pyarrow'} & set(sys.modules)); "
             "names = [(n, e.gradient) for n, e in m.METHODS.items()]; "
             "print(heavy, len(names)); "
             "assert grom_core.GromParams is m.METHODS['grom'].params; "
             "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = done.stdout.splitlines()
    assert before.startswith("[] ")  # nothing heavy until a method's parameters were asked for
    assert after == "True"  # ... and then they were imported where the registry says they live


def test_grom_core_exports_are_imported_on_first_use():
    import grom_core

    assert set(grom_core.__all__) == set(grom_core._EXPORTS)
    for name in grom_core.__all__:
        assert getattr(grom_core, name) is not None and name in dir(grom_core)
    with pytest.raises(AttributeError, match="no attribute 'GROMParams'"):
        grom_core.GROMParams  # noqa: B018


def test_every_package_and_shipped_file_is_in_the_wheels_configuration():
    """pyproject.toml names its packages one by one (data/ installs as grom_data): a new package folder or a shipped
    file the list does not cover would be missing from a non-editable install."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"grom_data": "data"}
    folders = {".".join(p.parent.relative_to(ROOT).parts) for top in ("grom_core", "tasks", "flows")
               for p in (ROOT / top).rglob("__init__.py")}
    assert {p for p in config["packages"] if not p.startswith("grom_data")} == folders
    tofu = ROOT / "data" / "tofu"
    patterns = config["package-data"]["grom_data.tofu"]
    shipped = {p.relative_to(tofu) for p in tofu.rglob("*") if p.is_file()}
    assert shipped and {p for p in shipped if any(p.match(pattern) for pattern in patterns)} == shipped


@pytest.mark.e2e
def test_a_non_editable_install_finds_the_shipped_data(tmp_path):
    """Build the wheel from a copy of the sources, install it elsewhere, and read the TOFU files from there."""
    import shutil
    import subprocess
    import sys

    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("grom_core", "tasks", "flows", "data"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)], check=True,
                   cwd=tmp_path)
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), *map(str, wheels.glob("*.whl"))],
                   check=True, cwd=tmp_path)
    probe = ("from grom_core.benchmarks.minitofu import real_world_rows, tofu_data_dir; "
             "print(tofu_data_dir()); print(len(real_world_rows('world_facts')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    folder, count = done.stdout.split()
    assert folder.startswith(str(target)) and int(count) > 50
