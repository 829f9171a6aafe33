"""Record every checker's printed output and return value, to compare before/after a refactor.

Issue #31 rewrites ``labkit/checks`` with no behaviour change: the checkers' messages for
the correct answers and for every wrong answer in ``tests/`` must stay identical. This
script records them into one JSON file:

* it runs the checker tests (``tests/test_checks*.py``, ``tests/test_timeline.py``) under
  pytest with the plugin :mod:`tools.checker_capture`, which records each checker call's
  printed output and return value under the test's node id;
* it calls every exercise checker once with an untouched stub (a function raising
  ``NotImplementedError``), as an untouched exercise notebook does.

Usage (from the repository root)::

    python tools/checker_outputs.py record tools/data/checker_outputs_before.json
    python tools/checker_outputs.py record /tmp/after.json tests/test_checks_lesson00.py
    python tools/checker_outputs.py diff tools/data/checker_outputs_before.json /tmp/after.json

``diff`` compares only the tests present in both files (record one lesson's tests, diff
against the whole baseline), lists the tests missing from the second, and exits 1 when a
recorded call differs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TESTS = ("tests/test_checks.py", "tests/test_checks_lesson0*.py", "tests/test_timeline.py")
STUB_KEY = "stub::untouched exercise"


def _stub(*args, **kwargs):
    raise NotImplementedError


def _stub_calls() -> dict:
    """Each public ``check_*`` called with the untouched stub (quietly where it can)."""
    import importlib
    import pkgutil

    sys.path.insert(0, str(ROOT))
    import labkit.checks as checks
    from tools.checker_capture import _describe, _norm

    out = {}
    for m in sorted(pkgutil.iter_modules(checks.__path__), key=lambda m: m.name):
        if not m.name.startswith("lesson"):
            continue
        pkg = importlib.import_module(f"labkit.checks.{m.name}")
        for attr in getattr(pkg, "__all__", ()):
            if not attr.startswith("check_"):
                continue
            buf = io.StringIO()
            entry: dict = {"fn": f"{m.name}.{attr}"}
            with contextlib.redirect_stdout(buf):
                try:
                    entry["return"] = _describe(getattr(pkg, attr)(_stub))
                except Exception as exc:  # a checker that needs more than one function
                    entry["raised"] = _norm(f"{type(exc).__name__}: {exc}")
            entry["stdout"] = _norm(buf.getvalue())
            out[f"{STUB_KEY}::{m.name}.{attr}"] = [entry]
    return out


def record(path: Path, tests: list[str]) -> int:
    path = path.resolve()
    if path.exists():
        path.unlink()
    env = dict(os.environ, CHECKER_OUTPUTS=str(path), LABKIT_BACKEND="emulated")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tools.checker_capture",
           *(tests or _expand(DEFAULT_TESTS))]
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    data.update(_stub_calls())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(sorted(data.items())), indent=1, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    n = sum(len(v) for v in data.values())
    print(f"recorded {n} checker calls from {len(data)} tests into {path} (pytest rc {rc})")
    return rc


def _expand(patterns) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for pat in patterns for p in ROOT.glob(pat))


def diff(before: Path, after: Path) -> int:
    a = json.loads(before.read_text(encoding="utf-8"))
    b = json.loads(after.read_text(encoding="utf-8"))
    common = sorted(set(a) & set(b))
    changed = [k for k in common if a[k] != b[k]]
    for k in changed:
        print(f"--- {k}")
        for i, (x, y) in enumerate(zip(a[k], b[k])):
            if x != y:
                print(f"  call {i}:\n    before: {json.dumps(x, ensure_ascii=False)[:1500]}"
                      f"\n    after:  {json.dumps(y, ensure_ascii=False)[:1500]}")
        if len(a[k]) != len(b[k]):
            print(f"  calls: {len(a[k])} before, {len(b[k])} after")
    only_a = [k for k in a if k not in b]
    only_b = [k for k in b if k not in a]
    calls = sum(len(a[k]) for k in common)
    print(f"{len(common)} tests ({calls} checker calls) compared: {len(changed)} differ; "
          f"{len(only_a)} only in {before.name}, {len(only_b)} only in {after.name}")
    return 1 if changed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run the checker tests and record every checker call")
    r.add_argument("out", type=Path)
    r.add_argument("tests", nargs="*", help="test files (default: all checker tests); the "
                   "stub calls are always recorded")
    d = sub.add_parser("diff", help="compare two recordings")
    d.add_argument("before", type=Path)
    d.add_argument("after", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "record":
        return record(args.out, args.tests)
    return diff(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
