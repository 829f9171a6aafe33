"""Generate ``exercises/NN_*.ipynb`` from ``solutions/NN_*.ipynb``.

``solutions/`` is the single source. In a solution notebook, mark what the learner must
write::

    def scale_and_shift(x, a, b):
        ### BEGIN SOLUTION
        return a * x + b
        ### END SOLUTION

The exercise keeps everything else and gets nbgrader's stub instead of the marked lines::

    def scale_and_shift(x, a, b):
        # YOUR CODE HERE
        raise NotImplementedError()

The replacement is nbgrader's own ``ClearSolutions`` preprocessor, run through nbconvert
together with nbconvert's ``ClearOutputPreprocessor``; a last step strips what changes from
run to run (execution metadata, language_info versions) so the same solution always gives
the same bytes. Cells need no nbgrader metadata: markers alone are enough
(``enforce_metadata`` is off).

    python -m labkit exercises           write exercises/ (make exercises)
    python -m labkit exercises --check   exit 1 and list stale files, write nothing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = [
    "CODE_STUB",
    "PATTERN",
    "build_exercise",
    "exercise_path",
    "find_solutions",
    "main",
    "repo_root",
    "sync",
]

CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
PATTERN = "[0-9][0-9]_*.ipynb"

_KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
# cell metadata that records a run, not the content
_VOLATILE_CELL_KEYS = ("execution", "ExecuteTime", "collapsed", "scrolled")


def repo_root() -> Path:
    """The checkout labkit lives in (labkit is installed editable)."""
    return Path(__file__).resolve().parent.parent


def find_solutions(root: Path | None = None) -> list[Path]:
    root = Path(root) if root is not None else repo_root()
    return sorted((root / "solutions").glob(PATTERN))


def exercise_path(solution: Path) -> Path:
    return solution.parent.parent / "exercises" / solution.name


def _normalize(nb, source_name: str):
    """Make the notebook depend only on its content: fixed metadata, fixed cell ids."""
    nb.metadata = {
        "kernelspec": dict(_KERNELSPEC),
        "language_info": {"name": "python"},
        "labkit": {
            "generated_from": f"solutions/{source_name}",
            "regenerate_with": "make exercises",
        },
    }
    nb.nbformat, nb.nbformat_minor = 4, 5
    seen: set[str] = set()
    for i, cell in enumerate(nb.cells):
        for key in _VOLATILE_CELL_KEYS:
            cell.metadata.pop(key, None)
        cid = cell.get("id")
        if not cid or cid in seen:
            cid = f"cell-{i:03d}"
        cell["id"] = cid
        seen.add(cid)
    return nb


def build_exercise(solution: Path | str) -> str:
    """The exercise notebook (as JSON text) that ``solution`` generates."""
    import nbformat
    from nbconvert.exporters import NotebookExporter
    from nbconvert.preprocessors import ClearOutputPreprocessor
    from nbgrader.preprocessors import ClearSolutions
    from traitlets.config import Config

    solution = Path(solution)
    nb = nbformat.read(solution, as_version=4)

    config = Config()
    config.ClearSolutions.code_stub = {"python": CODE_STUB}
    config.ClearSolutions.enforce_metadata = False

    exporter = NotebookExporter(config=config)
    exporter.register_preprocessor(ClearSolutions(config=config), enabled=True)
    exporter.register_preprocessor(ClearOutputPreprocessor(config=config), enabled=True)
    # ClearSolutions reads the language from the kernelspec, so fix that first.
    nb.metadata["kernelspec"] = dict(_KERNELSPEC)
    body, _ = exporter.from_notebook_node(nb)

    out = nbformat.reads(body, as_version=4)
    out = _normalize(out, solution.name)
    text = nbformat.writes(out, version=4)
    return text if text.endswith("\n") else text + "\n"


def sync(root: Path | None = None, *, check: bool = False, out=sys.stdout) -> list[Path]:
    """Write (or, with ``check``, only compare) every exercise; return the stale paths.

    Stale: an exercise that is missing, differs from what its solution generates, or has
    no solution any more (an orphan; removed when writing).
    """
    root = Path(root) if root is not None else repo_root()
    solutions = find_solutions(root)
    stale: list[Path] = []
    wanted: set[str] = set()
    for sol in solutions:
        ex = exercise_path(sol)
        wanted.add(ex.name)
        text = build_exercise(sol)
        current = ex.read_text(encoding="utf-8") if ex.exists() else None
        if current == text:
            continue
        stale.append(ex)
        if check:
            why = "missing" if current is None else "differs from its solution"
            print(f"stale: {ex.relative_to(root)} ({why})", file=out)
        else:
            ex.parent.mkdir(parents=True, exist_ok=True)
            ex.write_text(text, encoding="utf-8")
            print(f"wrote {ex.relative_to(root)}", file=out)
    for ex in sorted((root / "exercises").glob(PATTERN)):
        if ex.name not in wanted:
            stale.append(ex)
            if check:
                print(f"stale: {ex.relative_to(root)} (no solutions/{ex.name})", file=out)
            else:
                ex.unlink()
                print(f"removed {ex.relative_to(root)} (no solutions/{ex.name})", file=out)
    if not stale:
        n = len(solutions)
        print(f"exercises/ is up to date ({n} notebook{'s' if n != 1 else ''})", file=out)
    elif check:
        print("run `make exercises` (python -m labkit exercises) to regenerate", file=out)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labkit exercises",
        description="Generate exercises/NN_*.ipynb from solutions/NN_*.ipynb.",
    )
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 listing stale exercises")
    parser.add_argument("--root", type=Path, default=None,
                        help="repository root (default: the checkout labkit is in)")
    args = parser.parse_args(argv)
    stale = sync(args.root, check=args.check)
    return 1 if (args.check and stale) else 0
