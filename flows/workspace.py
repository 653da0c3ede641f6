"""The workspace: one folder that holds everything a run writes (default ./.grom, or GROM_HOME, or --home)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grom_core.errors import GromError

if TYPE_CHECKING:
    from tasks.catalog import Catalog


@dataclass(frozen=True)
class Workspace:
    root: Path

    @classmethod
    def resolve(cls, home: str | Path | None = None) -> Workspace:
        """--home wins over GROM_HOME, which wins over ./.grom. The folder is created and must be writable."""
        root = Path(home or os.environ.get("GROM_HOME") or Path.cwd() / ".grom").expanduser().resolve()
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe = root / ".write-probe"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            raise GromError(f"workspace {root} is not writable ({exc.strerror}); pass --home DIR or set GROM_HOME "
                            f"to a writable folder") from exc
        from tasks.relocation import relocate

        relocate(root)  # a copied or moved workspace never reads or writes into the one it came from
        return cls(root)

    def catalog(self) -> Catalog:
        """The workspace's DuckDB catalog (runs, datasets, requests)."""
        from tasks.catalog import Catalog

        return Catalog(self.root / "catalog.duckdb")

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def edits(self) -> Path:
        return self.root / "edits"
