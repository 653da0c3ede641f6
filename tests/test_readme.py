"""The README's library example runs as written."""

import re
import runpy
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_library_example_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README lost its Python example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    before = float(re.search(r"forget probability before: (\S+)", out).group(1))
    after = float(re.search(r"forget probability after: +(\S+)", out).group(1))
    retain = float(re.search(r"retain probability after: +(\S+)", out).group(1))
    assert before > 0.9 and after < before / 10 and retain > 0.85
    assert (tmp_path / ".grom" / "edits" / "example" / "edit.safetensors").exists()
