"""Generate ``exercises/NN_*.ipynb`` from ``solutions/NN_*.ipynb``, never losing a learner's work.

``solutions/`` is the single source. In a solution notebook, mark what the learner must
write::

    def scale_and_shift(x, a, b):
        ### BEGIN SOLUTION
        return a * x + b
        ### END SOLUTION

The exercise keeps everything else and gets a stub instead of the marked lines::

    def scale_and_shift(x, a, b):
        # YOUR CODE HERE
        raise NotImplementedError()

The replacement is nbgrader's own ``ClearSolutions`` preprocessor (a marked region in a
Markdown cell becomes ``YOUR ANSWER HERE``); markers that do not pair up are reported first,
with the file and cell. nbgrader is an authors' tool: ``make exercises`` installs it when it is
missing (``make test`` too, with the ``test`` extra); ``make lab`` neither installs nor
loads it. Outputs, execution counts and
run metadata are cleared, so the same solution always gives the same bytes.

Every generated notebook records, in ``metadata.labkit.cells_sha256``, a hash of its cells
(types and sources) as generated. That is how regeneration tells the two kinds of
difference apart:

* the solution changed (authored staleness): the file still hashes to its record, so
  nobody has edited it; it is rewritten;
* the learner edited it (their work): its cells no longer hash to the record. It is never
  overwritten silently: without ``--force`` it is left alone and reported; with
  ``--force`` it is first copied to ``exercises/backup/NN_name-<UTC time>.ipynb``.

A notebook that was run but not edited (it has outputs) counts as the learner's too.

    python -m labkit exercises            write exercises/ (make exercises)
    python -m labkit exercises --check    write nothing; exit 1 if an exercise needs regenerating
    python -m labkit exercises --force    also replace learner-edited files, after a backup

.. warning::
    ``exercises/`` is where learners work. A file whose content is not exactly what this
    module generated is treated as somebody's work: only ``--force`` replaces it, and
    only after saving a copy, because a blank notebook that replaced a finished one
    cannot be told from a bug by the learner who lost it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BACKUP_DIR",
    "CODE_STUB",
    "PATTERN",
    "TEXT_STUB",
    "ExerciseError",
    "Status",
    "build_exercise",
    "cells_hash",
    "classify",
    "exercise_path",
    "find_solutions",
    "add_arguments",
    "run",
    "repo_root",
    "sync",
]

CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
TEXT_STUB = "YOUR ANSWER HERE"
BEGIN, END = "BEGIN SOLUTION", "END SOLUTION"
PATTERN = "[0-9][0-9]_*.ipynb"
BACKUP_DIR = "backup"   # not a dot folder: JupyterLab hides those and will not open them
HASH_KEY = "cells_sha256"

_KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
# cell metadata that records a run, not the content
_VOLATILE_CELL_KEYS = ("execution", "ExecuteTime", "collapsed", "scrolled")


class ExerciseError(ValueError):
    """A solution notebook that cannot be turned into an exercise (names the file)."""


def repo_root() -> Path:
    """The checkout labkit lives in (labkit is installed editable)."""
    return Path(__file__).resolve().parent.parent


def find_solutions(root: Path | None = None) -> list[Path]:
    root = Path(root) if root is not None else repo_root()
    return sorted((root / "solutions").glob(PATTERN))


def exercise_path(solution: Path) -> Path:
    """``solutions/NN_name.ipynb`` → ``exercises/NN_name.ipynb`` (same checkout)."""
    solution = Path(solution)
    return solution.parent.parent / "exercises" / solution.name


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else str(src)


def cells_hash(cells) -> str:
    """sha256 of the cells' types and sources (not outputs, ids or metadata)."""
    payload = json.dumps([[c.get("cell_type", ""), _source(c)] for c in cells],
                         ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _check_markers(source: str, where: str) -> None:
    """Raise :class:`ExerciseError` unless every ``BEGIN SOLUTION`` has its ``END SOLUTION``."""
    inside = False
    for n, line in enumerate(source.split("\n"), 1):
        if BEGIN in line:
            if inside:
                raise ExerciseError(f"{where}, line {n}: a second '### {BEGIN}' before the "
                                    f"'### {END}' of the first; close each region first")
            inside = True
        elif END in line:
            if not inside:
                raise ExerciseError(f"{where}, line {n}: '### {END}' without a "
                                    f"'### {BEGIN}' above it")
            inside = False
    if inside:
        raise ExerciseError(f"{where}: '### {BEGIN}' is never closed by '### {END}'")


def _clear_solutions(nb):
    """nbgrader's ``ClearSolutions``: marked regions (and whole solution cells) → stubs."""
    try:
        from nbgrader.preprocessors import ClearSolutions
    except ImportError:
        raise ExerciseError("generating exercises needs nbgrader (an authors' tool): run "
                            "`make exercises` (it installs nbgrader), or `pip install nbgrader`"
                            ) from None
    from traitlets.config import Config

    config = Config()
    config.ClearSolutions.code_stub = {"python": CODE_STUB}
    config.ClearSolutions.text_stub = TEXT_STUB
    config.ClearSolutions.enforce_metadata = False  # markers alone are enough
    nb.metadata["kernelspec"] = dict(_KERNELSPEC)    # ClearSolutions reads the language
    nb, _ = ClearSolutions(config=config).preprocess(nb, {})
    return nb


def _read_solution(solution: Path):
    import nbformat

    try:
        text = solution.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ExerciseError(f"{solution}: no such solution notebook") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ExerciseError(f"{solution}: cannot be read ({exc})") from None
    try:
        nb = nbformat.reads(text, as_version=4)
    except Exception as exc:  # JSON errors, schema errors, a non-notebook file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExerciseError(f"{solution} is not a valid notebook ({first}); fix or restore it "
                            f"(git checkout -- {solution.name} in solutions/)") from None
    if not isinstance(nb.get("cells"), list):
        raise ExerciseError(f"{solution} is not a valid notebook (no list of cells)")
    return nb


def _point_badge_at_exercise(nb, name: str) -> None:
    """The "Open in Colab" badge (``metadata.labkit.colab == "badge"``, stamped by
    ``make colab-cells``) of ``solutions/NAME`` opens ``exercises/NAME`` instead."""
    for cell in nb.cells:
        if (cell.get("metadata", {}).get("labkit") or {}).get("colab") == "badge":
            cell["source"] = _source(cell).replace(f"/solutions/{name})",
                                                   f"/exercises/{name})")


def build_exercise(solution: Path | str) -> str:
    """The exercise notebook (as JSON text) that ``solution`` generates.

    Args:
        solution: a ``solutions/NN_name.ipynb`` notebook with ``### BEGIN SOLUTION`` /
            ``### END SOLUTION`` regions.

    Returns the notebook text, always the same bytes for the same solution, with the
    hash of its cells in ``metadata.labkit.cells_sha256``.

    Raises :class:`ExerciseError` (a ``ValueError``) naming the file and cell when the
    notebook cannot be read or its markers do not pair up.
    """
    import nbformat

    solution = Path(solution)
    nb = _read_solution(solution)
    for i, cell in enumerate(nb.cells):
        _check_markers(_source(cell), f"{solution}, cell {i + 1} ({cell.get('cell_type')})")
    nb = _clear_solutions(nb)
    _point_badge_at_exercise(nb, solution.name)
    seen: set[str] = set()
    for i, cell in enumerate(nb.cells):
        ctype = cell.get("cell_type")
        cell["source"] = _source(cell)
        if ctype == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        for key in _VOLATILE_CELL_KEYS:
            cell.get("metadata", {}).pop(key, None)
        cid = cell.get("id")
        if not cid or cid in seen:
            cid = f"cell-{i:03d}"
        cell["id"] = cid
        seen.add(cid)
    nb.metadata = {
        "kernelspec": dict(_KERNELSPEC),
        "language_info": {"name": "python"},
        "labkit": {
            "generated_from": f"solutions/{solution.name}",
            "regenerate_with": "make exercises",
            HASH_KEY: cells_hash(nb.cells),
        },
    }
    nb.nbformat, nb.nbformat_minor = 4, 5
    text = nbformat.writes(nb, version=4)
    return text if text.endswith("\n") else text + "\n"


# ---- telling authored staleness from learner edits -----------------------------------------

@dataclass(frozen=True)
class Status:
    """What an exercise file is, relative to what its solution generates now.

    ``kind`` is one of:

    * ``"up to date"``: the exact bytes the solution generates;
    * ``"missing"``: no exercise file yet;
    * ``"solution changed"``: untouched since it was generated, but its solution changed
      since (authored staleness: safe to rewrite);
    * ``"edited"``: the learner's work (edited cells, or outputs from a run), and the
      solution has not changed since it was generated: nothing to do;
    * ``"edited, solution changed"``: the learner's work, and the solution changed since:
      rewriting needs ``--force`` (which backs the file up first);
    * ``"unreadable"``: not a notebook any more (treated as the learner's);
    * ``"orphan"``: no solution generates it (``untouched`` says whether it is pristine).
    """

    path: Path
    kind: str
    untouched: bool
    detail: str = ""

    @property
    def needs_writing(self) -> bool:
        return self.kind in ("missing", "solution changed", "edited, solution changed",
                             "unreadable", "orphan")


def _recorded(nb: dict) -> str | None:
    return (nb.get("metadata", {}).get("labkit") or {}).get(HASH_KEY)


def _has_run_output(nb: dict) -> bool:
    return any(c.get("outputs") or c.get("execution_count") is not None
               for c in nb.get("cells", []) if c.get("cell_type") == "code")


def classify(path: Path, wanted: str | None) -> Status:
    """Classify the exercise file ``path`` against ``wanted`` (the text its solution
    generates now; ``None`` for an orphan)."""
    path = Path(path)
    if not path.exists():
        return Status(path, "missing", True)
    text = path.read_text(encoding="utf-8", errors="replace")
    if wanted is not None and text == wanted:
        return Status(path, "up to date", True)
    try:
        nb = json.loads(text)
        cells = nb["cells"]
        assert isinstance(cells, list)
    except Exception:
        return Status(path, "orphan" if wanted is None else "unreadable", False,
                      "not a readable notebook")
    got = cells_hash(cells)
    recorded = _recorded(nb)
    ran = _has_run_output(nb)
    wanted_hash = _recorded(json.loads(wanted)) if wanted is not None else None
    if recorded is None:
        # generated by an older labkit (no hash): untouched only if its cells are exactly
        # what the solution generates now and it was never run.
        untouched = wanted_hash is not None and got == wanted_hash and not ran
        if wanted is None:
            return Status(path, "orphan", False, "no record of what was generated")
        if untouched:
            return Status(path, "solution changed", True, "older format, same cells")
        if got == wanted_hash:
            return Status(path, "edited", False, "has outputs from a run")
        return Status(path, "edited, solution changed", False,
                      "generated before labkit recorded a hash, so edits cannot be told "
                      "from a changed solution")
    edited = got != recorded
    untouched = not edited and not ran
    if wanted is None:
        return Status(path, "orphan", untouched)
    if untouched:
        # same cells as recorded: either the solution changed, or only metadata / cell ids
        # differ (Jupyter rewrites metadata on save; an author may change cell metadata)
        return Status(path, "solution changed", True,
                      "" if recorded != wanted_hash else "metadata only")
    detail = "cells edited" if edited else "has outputs from a run"
    if recorded == wanted_hash:
        return Status(path, "edited", False, detail)
    return Status(path, "edited, solution changed", False, detail)


def _backup(path: Path, root: Path, stamp: str) -> Path:
    folder = path.parent / BACKUP_DIR
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / f"{path.stem}-{stamp}{path.suffix}"
    n = 1
    while dest.exists():
        n += 1
        dest = folder / f"{path.stem}-{stamp}-{n}{path.suffix}"
    shutil.copy2(path, dest)
    return dest


def _rel(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def sync(root: Path | None = None, *, check: bool = False, force: bool = False,
         out=sys.stdout) -> list[Path]:
    """Write (or, with ``check``, only compare) every exercise; return the paths that
    need writing (those still needing it after this call, when writing).

    Args:
        root: the checkout (default: the one labkit is in).
        check: write nothing; report each file's :class:`Status`.
        force: also replace learner-edited (or unreadable, or orphan) files, each after a
            copy to ``exercises/backup/``. Without it they are left alone and reported.
        out: where the report goes.

    .. warning::
        Without ``force`` nothing a learner wrote is ever overwritten or deleted; with it,
        it is backed up first. A pristine file (exactly as generated) is rewritten when
        its solution changed, and deleted when its solution is gone.
    """
    root = Path(root) if root is not None else repo_root()
    solutions = find_solutions(root)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    pending: list[Path] = []
    kept: list[Status] = []
    edited_ok: list[Status] = []
    wanted_names: set[str] = set()
    statuses: list[tuple[Status, str | None]] = []
    for sol in solutions:
        ex = exercise_path(sol)
        wanted_names.add(ex.name)
        text = build_exercise(sol)
        statuses.append((classify(ex, text), text))
    for ex in sorted((root / "exercises").glob(PATTERN)):
        if ex.name not in wanted_names:
            statuses.append((classify(ex, None), None))

    for st, text in statuses:
        rel = _rel(st.path, root)
        if st.kind == "up to date":
            continue
        if st.kind == "edited":
            edited_ok.append(st)
            print(f"yours: {rel} ({st.detail}; its solution has not changed: nothing to do)",
                  file=out)
            continue
        learners = not st.untouched
        if check:
            pending.append(st.path)
            if st.kind == "missing":
                print(f"missing: {rel}", file=out)
            elif st.kind == "solution changed":
                why = {
                    "older format, same cells": "written by an older labkit without a record "
                                                "of what was generated; same cells, nothing "
                                                "edited",
                    "metadata only": "only its metadata or cell ids differ from what its "
                                     "solution generates; nobody edited its cells",
                }.get(st.detail, "its solution changed since it was generated; nobody "
                                 "edited it")
                print(f"stale: {rel} ({why})", file=out)
            elif st.kind == "unreadable":
                print(f"unreadable: {rel} (not a readable notebook; --force saves it to "
                      f"exercises/{BACKUP_DIR}/ and writes a fresh one)", file=out)
            elif st.kind == "orphan":
                print(f"orphan: {rel} (no solutions/{st.path.name}"
                      f"{'' if st.untouched else '; has edits or outputs'})", file=out)
            else:
                print(f"yours, and stale: {rel} ({st.detail}; its solution changed since it "
                      f"was generated)", file=out)
            continue
        if learners and not force:
            pending.append(st.path)
            kept.append(st)
            what = {"orphan": "has no solution any more",
                    "unreadable": "is not a readable notebook"}.get(
                st.kind, "has a newer version (its solution changed)")
            print(f"kept: {rel} holds your work ({st.detail}) and {what}; not touched",
                  file=out)
            continue
        if learners:
            saved = _backup(st.path, root, stamp)
            print(f"saved your version of {rel} to {_rel(saved, root)}", file=out)
        if st.kind == "orphan":
            st.path.unlink()
            print(f"removed {rel} (no solutions/{st.path.name})", file=out)
            continue
        st.path.parent.mkdir(parents=True, exist_ok=True)
        st.path.write_text(text, encoding="utf-8")
        why = {"missing": "new", "solution changed": "its solution changed"}.get(
            st.kind, st.kind)
        if st.detail in ("metadata only", "older format, same cells"):
            why = f"{st.detail}; no edits"
        print(f"wrote {rel} ({why})", file=out)

    n = len(solutions)
    if not pending:
        extra = f"; {len(edited_ok)} with your edits" if edited_ok else ""
        print(f"exercises/ is up to date ({n} notebook{'s' if n != 1 else ''}{extra})",
              file=out)
    elif check:
        if any(not s.untouched for s, _ in statuses if s.path in pending):
            print("`python -m labkit exercises` rewrites the untouched ones; files with your "
                  "work are only replaced with --force, which first saves a copy to "
                  f"exercises/{BACKUP_DIR}/", file=out)
        else:
            print("run `make exercises` (python -m labkit exercises) to regenerate them",
                  file=out)
    else:
        print(f"{len(kept)} file(s) with your work were kept as they are. To replace them "
              f"with the new version anyway: python -m labkit exercises --force (each is "
              f"first copied to exercises/{BACKUP_DIR}/)", file=out)
    return pending


HELP = "regenerate exercises/*.ipynb from solutions/*.ipynb (never overwrites your edits)"
DESCRIPTION = ("Generate exercises/NN_*.ipynb from solutions/NN_*.ipynb. Files you edited are "
               "never overwritten without --force, and --force backs them up to "
               f"exercises/{BACKUP_DIR}/ first.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m labkit exercises`` (shared with ``labkit.__main__``)."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 if an exercise is missing or its solution "
                           "changed (your own edits are fine)")
    mode.add_argument("--force", action="store_true",
                      help=f"also replace files with your edits, after copying each to "
                           f"exercises/{BACKUP_DIR}/")
    parser.add_argument("--root", type=Path, default=None,
                        help="repository root (default: the checkout labkit is in)")


def run(args: argparse.Namespace) -> int:
    root = args.root
    if root is not None and not (Path(root) / "solutions").is_dir():
        print(f"error: --root {root}: no solutions/ folder there; give the lab's checkout",
              file=sys.stderr)
        return 2
    try:
        pending = sync(root, check=args.check, force=args.force)
    except ExerciseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a read-only checkout, a full disk
        print(f"error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 1 if pending else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit.exercises``: the same command as ``python -m labkit exercises``,
    with its options checked (an unknown one exits with status 2 and the usage)."""
    parser = argparse.ArgumentParser(prog="python -m labkit exercises", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
