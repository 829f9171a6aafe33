"""The outputs stored in the lessons and solutions are clean: no error, no stderr, and no
traceback printed as text (a child process's failure printed by a cell is still a failure)."""

from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("solutions/*.ipynb")])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_stored_outputs_hold_no_errors(path):
    nb = nbformat.read(path, as_version=4)
    bad = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            text = out.get("text", "")
            if isinstance(text, list):
                text = "".join(text)
            for mime in ("text/plain", "text/html"):
                data = out.get("data", {}).get(mime, "")
                text += "".join(data) if isinstance(data, list) else data
            if out.output_type == "error":
                bad.append(f"cell {i}: an error output ({out.get('ename')})")
            elif out.output_type == "stream" and out.get("name") == "stderr":
                bad.append(f"cell {i}: stderr: {text[:120]!r}")
            elif "Traceback (most recent call last)" in text:
                bad.append(f"cell {i}: a traceback printed as output: {text[:160]!r}")
    assert not bad, f"{path.name}: re-run it (make execute-notebooks) after fixing:\n" + \
        "\n".join(bad)
