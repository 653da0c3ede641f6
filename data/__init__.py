"""The datasets grom ships, installed as the package `grom_data` (pyproject.toml maps it to this folder), so that
a non-editable install finds them: `importlib.resources.files("grom_data") / "tofu"`.

    tofu/   TOFU's real-authors and world-facts sets, its "I don't know" answers and open-unlearning's evaluation
            logs of Llama-2-7B (LICENSE and README.md beside them say where each file comes from)
"""
