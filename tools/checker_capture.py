"""A pytest plugin that records what every checker prints and returns, test by test.

Used by ``tools/checker_outputs.py`` (issue #31: the checkers' refactor must not change a
single message). Loaded with ``-p tools.checker_capture`` and the environment variable
``CHECKER_OUTPUTS=path.json``, it wraps, before the tests are collected:

* every public function of ``labkit.checks.lessonNN`` (its ``__all__``), in the package and
  in the module that defines it;
* ``labkit.checks``' own entry points (``check``, ``hint``, ``fail``, ``passed``, ...),
  but not ``call_learner``: a checker calls it while the learner's code runs, so a
  wrapper of it (a frame outside labkit) would sit in the traceback of every error and
  could be named as "the learner's line".

Each outermost call (a checker calling ``check`` is one call, not two) records its printed
output (still printed: ``capsys`` sees it as before) and its return value, under the test's
node id, in call order. Memory addresses (``0x7f...``) are normalized; nothing else is.
"""

from __future__ import annotations

import functools
import importlib
import io
import json
import os
import pkgutil
import re
import sys

_RECORDS: dict[str, list] = {}
_STATE = {"test": None, "depth": 0}
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_FRAMEWORK = ("check", "hint", "fail", "passed", "verdict", "learner_raised",
              "compare_outputs", "describe_exception", "short_description")


def _norm(text: str) -> str:
    return _ADDRESS.sub("0x…", text)


def _describe(value) -> object:
    """A JSON-able account of a checker's return value."""
    from labkit.checks import CheckResult

    if isinstance(value, CheckResult):
        return {"CheckResult": {
            "name": value.name, "passed": value.passed, "message": _norm(value.message),
            "trials": value.trials, "failed_trial": value.failed_trial, "kind": value.kind,
            "more_hints": [_norm(h) for h in value.more_hints],
            "details": sorted(map(str, value.details)),
        }}
    if value is None or isinstance(value, (bool, int, float, str)):
        return _norm(value) if isinstance(value, str) else value
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _describe(v) for k, v in value.items()}
    return _norm(f"<{type(value).__name__}> {value!r}"[:400])


class _Tee(io.TextIOBase):
    def __init__(self, out):
        self.out, self.buf = out, io.StringIO()

    def write(self, s):
        self.buf.write(s)
        return self.out.write(s)

    def flush(self):
        self.out.flush()


def _wrap(fn, label: str):
    if getattr(fn, "_checker_capture", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _STATE["depth"] or _STATE["test"] is None:
            return fn(*args, **kwargs)
        _STATE["depth"] += 1
        tee = _Tee(sys.stdout)
        old, sys.stdout = sys.stdout, tee
        entry = {"fn": label}
        try:
            value = fn(*args, **kwargs)
            entry["return"] = _describe(value)
            return value
        except BaseException as exc:
            entry["raised"] = _norm(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            sys.stdout = old
            _STATE["depth"] -= 1
            entry["stdout"] = _norm(tee.buf.getvalue())
            _RECORDS.setdefault(_STATE["test"], []).append(entry)

    wrapper._checker_capture = True
    return wrapper


def _install() -> None:
    import labkit.checks as checks

    lessons = sorted(m.name for m in pkgutil.iter_modules(checks.__path__)
                     if m.name.startswith("lesson"))
    for name in lessons:
        pkg = importlib.import_module(f"labkit.checks.{name}")
        for attr in getattr(pkg, "__all__", ()):
            fn = getattr(pkg, attr)
            if not callable(fn) or isinstance(fn, type):
                continue
            w = _wrap(fn, f"{name}.{attr}")
            setattr(pkg, attr, w)
            home = sys.modules.get(getattr(fn, "__module__", ""))
            if home is not None and getattr(home, attr, None) is fn:
                setattr(home, attr, w)
    for attr in _FRAMEWORK:
        if hasattr(checks, attr):
            setattr(checks, attr, _wrap(getattr(checks, attr), f"checks.{attr}"))


def pytest_configure(config):
    if os.environ.get("CHECKER_OUTPUTS"):
        _install()


def pytest_runtest_setup(item):
    _STATE["test"] = item.nodeid


def pytest_runtest_teardown(item, nextitem):
    _STATE["test"] = None


def pytest_unconfigure(config):
    path = os.environ.get("CHECKER_OUTPUTS")
    if not path:
        return
    old = {}
    if os.path.exists(path):  # several pytest runs add to one file
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    old.update(_RECORDS)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(dict(sorted(old.items())), f, indent=1, ensure_ascii=False)
        f.write("\n")
