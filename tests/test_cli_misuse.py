"""Command lines under misuse: each bad option or file is named, the exit code is non-zero,
and nothing prints a traceback or destroys a file (issue 11). Every case runs the real
command in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.bench import report

ROOT = Path(__file__).resolve().parent.parent
SOLUTION_00 = ROOT / "solutions" / "00_start_here.ipynb"


def run(*args, cwd=None, timeout=120):
    r = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                       cwd=cwd or ROOT, timeout=timeout)
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r


def _row(**kw):
    r = {"suite": "launch", "config_name": "c", "config": {}, "batch_size": None,
         "variant": "eager", "median_us": 10.0, "device": "D", "torch": "0", "date": "2026"}
    r.update(kw)
    return r


# ---- python -m labkit.bench -------------------------------------------------------------

def test_bench_render_mistyped_results_path_writes_nothing(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("committed tables\n")
    r = run("labkit.bench", "--render", "--results", str(tmp_path / "resluts.json"))
    assert r.returncode == 1
    assert f"results file {tmp_path / 'resluts.json'} does not exist" in r.stderr
    assert readme.read_text() == "committed tables\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]


@pytest.mark.parametrize("content, words", [
    ("[{\"suite\": \"launch\",", "is not valid JSON"),
    ("", "is not valid JSON"),
    ("{\"rows\": []}", "must hold a JSON list of rows"),
    ("[]", "holds no rows: nothing to render"),
    (json.dumps([_row(), {"suite": "launch"}]), "row 1: benchmark row lacks"),
    (json.dumps([_row(median_us="fast")]), "row 0: median_us must be a number"),
    (json.dumps([_row(batch_size="8")]), "row 0: batch_size must be an integer"),
])
def test_bench_render_corrupt_or_incomplete_results(tmp_path, content, words):
    results = tmp_path / "results.json"
    results.write_text(content)
    readme = tmp_path / "README.md"
    readme.write_text("committed tables\n")
    r = run("labkit.bench", "--render", "--results", str(results))
    assert r.returncode == 1, r.stdout
    assert str(results) in r.stderr and words in r.stderr
    assert readme.read_text() == "committed tables\n" and results.read_text() == content


def test_bench_results_is_a_directory(tmp_path):
    r = run("labkit.bench", "--render", "--results", str(tmp_path))
    assert r.returncode == 1 and "is a directory" in r.stderr


def test_bench_out_is_a_file(tmp_path):
    results = tmp_path / "results.json"
    report.append_results([_row()], results)
    out = tmp_path / "out.txt"
    out.write_text("x")
    r = run("labkit.bench", "--render", "--results", str(results), "--out", str(out))
    assert r.returncode == 1 and f"output folder {out} is a file" in r.stderr
    assert out.read_text() == "x"


def test_bench_corrupt_results_is_reported_before_measuring(tmp_path):
    results = tmp_path / "results.json"
    results.write_text("{ corrupt")
    r = run("labkit.bench", "launch", "--results", str(results))
    assert r.returncode == 1 and "is not valid JSON" in r.stderr
    assert "Nothing was measured" not in r.stdout and "labkit.bench on" not in r.stdout


@pytest.mark.parametrize("args, words", [
    (["nope"], "unknown suite(s) 'nope': choose from launch, decode, serve, train, capture"),
    (["launch", "Train"], "unknown suite(s) 'Train'"),
    (["--decode-compile-mode", "fast"], "argument --decode-compile-mode: invalid choice: "
                                        "'fast' (choose from 'default', "
                                        "'max-autotune-no-cudagraphs'"),
    (["--render", "--quik"], "unrecognized arguments: --quik"),
    (["--results"], "argument --results: expected one argument"),
])
def test_bench_bad_arguments(args, words):
    r = run("labkit.bench", *args)
    assert r.returncode == 2 and words in r.stderr


def test_bench_render_good_file_still_works(tmp_path):
    results = tmp_path / "results.json"
    report.append_results([_row(), _row(variant="graph", median_us=2.0)], results)
    r = run("labkit.bench", "--render", "--results", str(results), "--out", str(tmp_path / "o"))
    assert r.returncode == 0 and "wrote" in r.stdout
    assert "| c |  | `graph` | 2.0 µs |" in (tmp_path / "o" / "README.md").read_text()


# ---- python -m labkit -------------------------------------------------------------------

def _lab(tmp_path, solution_text):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "exercises").mkdir()
    (tmp_path / "solutions" / "00_start_here.ipynb").write_text(solution_text)
    return tmp_path


@pytest.mark.parametrize("text, words", [
    ("{ half a notebook", "is not a valid notebook"),
    ("", "is not a valid notebook"),
    ('{"cells": "none", "metadata": {}, "nbformat": 4, "nbformat_minor": 5}',
     "is not a valid notebook"),
])
def test_exercises_corrupt_solution_notebook(tmp_path, text, words):
    root = _lab(tmp_path, text)
    for extra in ([], ["--check"]):
        r = run("labkit", "exercises", "--root", str(root), *extra)
        assert r.returncode == 1
        assert f"error: {root / 'solutions' / '00_start_here.ipynb'}" in r.stderr
        assert words in r.stderr
    assert list((root / "exercises").iterdir()) == []


def test_exercises_unclosed_solution_marker(tmp_path):
    nb = json.loads(SOLUTION_00.read_text())
    first = None
    for i, cell in enumerate(nb["cells"]):
        src = "".join(cell["source"])
        if "END SOLUTION" in src:
            cell["source"] = src.replace("### END SOLUTION", "")
            first = i if first is None else first
    root = _lab(tmp_path, json.dumps(nb))
    r = run("labkit", "exercises", "--root", str(root))
    assert r.returncode == 1
    assert "'### BEGIN SOLUTION' is never closed by '### END SOLUTION'" in r.stderr
    assert f"cell {first + 1} (code)" in r.stderr   # counted from 1


def test_exercises_root_without_solutions(tmp_path):
    r = run("labkit", "exercises", "--root", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "no solutions/ folder there" in r.stderr


@pytest.mark.parametrize("args, words", [
    (["exercise"], "invalid choice: 'exercise' (choose from 'doctor', 'exercises', 'demo')"),
    (["exercises", "--chek"], "unrecognized arguments: --chek"),
    (["exercises", "--check", "--force"], "argument --force: not allowed with argument --check"),
    (["doctor", "--jsn"], "unrecognized arguments: --jsn"),
])
def test_labkit_bad_arguments(args, words):
    r = run("labkit", *args)
    assert r.returncode == 2 and words in r.stderr


def test_labkit_without_a_command_prints_help():
    r = run("labkit")
    assert r.returncode == 0 and "doctor" in r.stdout and "exercises" in r.stdout


# ---- python -m labkit.doctor (the module run directly; issue 29) ---------------------------------

@pytest.mark.parametrize("args, words", [
    (["--bogus"], "python -m labkit doctor: error: unrecognized arguments: --bogus"),
    (["--jsn"], "unrecognized arguments: --jsn"),
])
def test_doctor_module_rejects_unknown_options(args, words):
    """Before: ``python -m labkit.doctor --bogus`` ran nothing and exited 0, silently."""
    r = run("labkit.doctor", *args)
    assert r.returncode == 2 and words in r.stderr and "usage:" in r.stderr, r.stderr


def test_doctor_module_prints_the_report():
    r = run("labkit.doctor", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["python"], r.stdout


def test_exercises_module_rejects_unknown_options():
    """Before: ``python -m labkit.exercises --bogus`` ran nothing and exited 0, silently."""
    r = run("labkit.exercises", "--bogus")
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr, r.stderr
    assert "usage: python -m labkit exercises" in r.stderr


def test_exercises_module_checks_like_the_command():
    r = run("labkit.exercises", "--check")
    assert r.returncode == 0 and "up to date" in r.stdout, (r.stdout, r.stderr)
