"""``python -m labkit demo``: every lesson's demo runs from a terminal, labels what is not a
GPU measurement, prints its key figures and saves a real PNG; bad input gets a message
naming it, a non-zero exit and no traceback, and no file but a demo's own PNG is
overwritten. Each demo runs once, as the real command in a subprocess, on the emulator."""

from __future__ import annotations

import argparse
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from labkit import demo

ROOT = Path(__file__).resolve().parent.parent
NUMBERS = [f"{i:02d}" for i in range(10)]

# What each demo must print on the emulator: its key figures, measured in that run.
KEY_FIGURES = {
    "00": [r"-> static_y \[1\.0, 3\.0, 5\.0, 7\.0\]", r"-> static_y \[21\.0, 41\.0, 61\.0, 81\.0\]",
           r"every replay gave 2·x \+ 1 for the new x: True"],
    "01": [r"µs per kernel, this run\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d×",
           r"verdict over 5 interleaved rounds: graph faster than eager: \d/5 rounds",
           r"CPU cost to issue one eager op: \d+\.\d+ µs",
           r"eager: 20 adds of 256 elements \[simulated \(H200\)\]\s+step\s+\d+\.\d µs",
           r"graphed: 20 adds of 256 elements \[simulated \(H200\)\]",
           r"the eager step is \d+\.\d× as long"],
    "02": [r"recorded 3 kernels \(ATen ops the emulator recorded\): aten\.addmm\.default, "
           r"aten\.gelu\.default, aten\.addmm\.default",
           r"3 replays, each equal to model\(batch\): True",
           r"now holds replay 3's result: True",
           r"eager forward\s+\d+\.\d µs \| graph replay\s+\d+\.\d µs",
           r"medians of 5 interleaved rounds; verdict: graph replay "],
    "03": [r"capture by hand stops at the first hazard: CUDA error: operation not permitted "
           r"when stream is capturing",
           r"lint_capture\(step\): 10 findings \(7 fails capture, 2 silently wrong, 1 check\)",
           r"CPU sync \[fails capture\] at line \d+: n = x\.sum\(\)\.item\(\)"],
    "04": [r"labkit bridge \(wgrads cloned\)\s+max \|Δ weight\| vs eager\s+\S+\s+== eager",
           r"bridge, clone_wgrads=False\s+max \|Δ weight\| vs eager\s+\S+\s+WRONG"],
    "05": [r"in flight per stage, 1F1B:\s+\[4, 3, 2, 1\]",
           r"in flight per stage, GPipe:\s+\[8, 8, 8, 8\]",
           r"created in recorded\s+order: max \|Δ weight\| vs eager\s+\S+\s+== eager",
           r"created in grouped\s+order: max \|Δ weight\| vs eager\s+\S+\s+WRONG"],
    "06": [r"captured 6 decode graphs \(buckets \[1, 2, 4, 8, 12, 16\]\)",
           r"eager\s+decode\s+\d+\.\d tokens/s", r"graphed\s+decode\s+\d+\.\d tokens/s",
           r"speed-up \(decode tokens/s\): \d+\.\d\d×",
           r"tokens identical, request by request: True",
           r"every one a graph replay: True"],
    "07": [r"2  capture \+ replay\s+(\d+\.\d+)\s+\1", r"5  replay\s+(\d+\.\d+)\s+\1",
           r"weights after 6 steps equal eager training's: True",
           r"eager step\s+\d+\.\d+ ms \| whole-step graphs\s+\d+\.\d+ ms"],
    "08": [r"call 1: warm-up\s+equals eager: True", r"call 2: record\s+equals eager: True",
           r"call 5: replay\s+equals eager: True",
           r"for a CPU-only function torch counted cudagraph_skips \+1 and logged 0 line",
           r"by hand: copy x \+ replay\s+\d+\.\d µs per call"],
    "09": [r"split at attention: 3 pieces, 2 attention calls; captured 9 piece graphs",
           r"prefill 4x4\s+PIECEWISE .*same greedy tokens as eager: True",
           r"mixed 8 \+ 4 decodes\s+PIECEWISE .*same greedy tokens as eager: True",
           r"decode 4\s+FULL .*same greedy tokens as eager: True",
           r"same tokens as plain greedy: True"],
}


def run(*args, cwd=None, timeout=180):
    r = subprocess.run([sys.executable, "-m", "labkit", "demo", *args], capture_output=True,
                       text=True, cwd=cwd or ROOT, timeout=timeout,
                       env={k: v for k, v in os.environ.items() if k != "LABKIT_BACKEND"})
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a well-formed PNG: signature, IHDR first, every CRC right, IEND."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, kinds = 8, []
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"{path}: bad CRC in {kind!r}"
        kinds.append(kind)
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds, kinds
    return width, height


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Each demo once on the emulator: {NN: (CompletedProcess, png path)}, run lazily."""
    out, cache = tmp_path_factory.mktemp("demos"), {}

    def get(nn):
        if nn not in cache:
            png = out / f"demo-{nn}.png"
            cache[nn] = (run(nn, "--backend", "emulated", "--out", str(png)), png)
        return cache[nn]
    return get


# ---- every demo on the CPU emulator -------------------------------------------------------

@pytest.mark.parametrize("nn", NUMBERS)
def test_demo_runs_on_the_emulator_and_saves_its_png(ran, nn):
    r, png = ran(nn)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == "", r.stderr                      # no warnings or library noise
    assert f"labkit demo {nn}" in r.stdout
    assert "backend: emulated" in r.stdout
    width, height = png_size(png)
    assert width >= 600 and height >= 250, (width, height)
    assert demo.is_demo_png(png)
    assert f"saved {png}" in r.stdout
    assert not list(png.parent.glob(".labkit-demo-*")), "a temporary file was left behind"


@pytest.mark.parametrize("nn", NUMBERS)
def test_demo_says_it_ran_on_the_emulator(ran, nn):
    r, _ = ran(nn)
    assert re.search(r"^emulated: labkit's CPU emulator runs the graphs", r.stdout, re.M), r.stdout


@pytest.mark.parametrize("nn", NUMBERS)
def test_demo_prints_its_key_figures(ran, nn):
    r, _ = ran(nn)
    missing = [p for p in KEY_FIGURES[nn] if not re.search(p, r.stdout)]
    assert not missing, f"demo {nn} did not print {missing}:\n{r.stdout}"


@pytest.mark.parametrize("nn", ["01", "02", "06", "07", "08", "09"])
def test_timings_on_the_emulator_are_labelled_as_not_a_gpu(ran, nn):
    r, _ = ran(nn)
    body = r.stdout.split("\n\n", 1)[1]                # after the header's general note
    assert re.search(r"µs|ms|tokens/s", body)
    assert re.search(r"^emulated: .*(not a GPU|nothing about (a )?GPU|SIMULATED|not what a GPU)",
                     body, re.M), body


def test_default_path_and_a_rerun_over_its_own_png(ran, tmp_path):
    _, png = ran("00")
    default = tmp_path / "labkit-demo-00.png"
    default.write_bytes(png.read_bytes())                # an earlier demo's picture
    before = default.stat().st_mtime_ns
    r = run("0", "--backend", "emulated", cwd=tmp_path)  # "0" means 00; no --out
    assert r.returncode == 0, r.stderr
    assert "saved labkit-demo-00.png" in r.stdout
    assert demo.is_demo_png(default) and default.stat().st_mtime_ns != before
    assert sorted(f.name for f in tmp_path.iterdir()) == ["labkit-demo-00.png"]


# ---- --list and bad input -------------------------------------------------------------------

def test_list_names_every_demo_and_what_it_shows():
    r = run("--list")
    assert r.returncode == 0, r.stderr
    for nn, d in demo.DEMOS.items():
        assert re.search(rf"^\s+{nn}\s+{re.escape(d.lesson)}$", r.stdout, re.M), nn
        assert d.shows in r.stdout
    assert list(demo.DEMOS) == NUMBERS


@pytest.mark.parametrize("args, given, expected", [
    (["99"], "'99'", "00, 01, 02, 03, 04, 05, 06, 07, 08, 09"),
    (["abc"], "'abc'", "00, 01, 02, 03, 04, 05, 06, 07, 08, 09"),
    (["1.5"], "'1.5'", "--list"),
    (["01", "--backend", "gpu"], "'gpu'", "'auto', 'cuda', 'emulated'"),
    ([], "give a demo number", "--list"),
])
def test_bad_arguments_are_named(args, given, expected):
    r = run(*args)
    assert r.returncode == 2
    assert given in r.stderr and expected in r.stderr, r.stderr


def test_out_to_a_folder_is_refused(tmp_path):
    r = run("01", "--backend", "emulated", "--out", str(tmp_path))
    assert r.returncode == 2
    assert f"--out {tmp_path} is a folder" in r.stderr and ".png" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["notes.txt", "lesson.ipynb", "picture"])
def test_out_over_a_file_that_is_not_png_is_refused_and_kept(tmp_path, name):
    f = tmp_path / name
    f.write_text("a learner's work\n")
    r = run("01", "--backend", "emulated", "--out", str(f))
    assert r.returncode == 2
    assert f"--out {f} does not end in .png" in r.stderr, r.stderr
    assert f.read_text() == "a learner's work\n"


def test_out_over_a_png_no_demo_saved_is_refused_and_kept(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = tmp_path / "my_plot.png"
    fig = plt.figure(figsize=(2, 2))
    fig.savefig(f)
    plt.close(fig)
    before = f.read_bytes()
    r = run("01", "--backend", "emulated", "--out", str(f))
    assert r.returncode == 2
    assert "not a PNG that a labkit demo saved" in r.stderr and "another path" in r.stderr
    assert f.read_bytes() == before


def test_out_in_a_missing_folder_is_refused(tmp_path):
    r = run("01", "--backend", "emulated", "--out", str(tmp_path / "nope" / "x.png"))
    assert r.returncode == 2
    assert "does not exist" in r.stderr and "mkdir -p" in r.stderr, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_backend_cuda_without_a_gpu_is_named(tmp_path):
    r = run("00", "--backend", "cuda", "--out", str(tmp_path / "d.png"))
    assert r.returncode == 2
    assert "--backend cuda" in r.stderr and "--backend emulated" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_out_in_a_folder_without_write_permission_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: permissions do not stop writing")
        r = run("01", "--backend", "emulated", "--out", str(locked / "x.png"))
    finally:
        locked.chmod(0o755)
    assert r.returncode == 2
    assert "cannot write" in r.stderr and "another path" in r.stderr, r.stderr


# ---- the PNG check and a demo that fails, in process ----------------------------------------

def test_check_out_path(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = tmp_path / "ours.png"
    fig = plt.figure(figsize=(2, 2))
    demo.cli._save(fig, ours, "03")
    plt.close(fig)
    assert demo.is_demo_png(ours) and demo.check_out_path(ours) is None
    assert demo.check_out_path(tmp_path / "new.PNG") is None           # free path, any case
    fake = tmp_path / "fake.png"
    fake.write_text("not a png")
    assert not demo.is_demo_png(fake)
    assert "not a PNG that a labkit demo saved" in demo.check_out_path(fake)


def test_a_demo_that_raises_ends_in_a_message_and_writes_nothing(tmp_path, monkeypatch, capsys):
    def broken(B, small):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setitem(demo.DEMOS, "00", demo.Demo("00", "start here", "x", broken))
    out = tmp_path / "d.png"
    args = argparse.Namespace(list=False, number="00", backend="emulated", out=str(out))
    assert demo.run(args) == 1
    err = capsys.readouterr().err
    assert "demo 00 failed on backend emulated: ZeroDivisionError: division by zero" in err
    assert "python -m labkit doctor" in err
    assert list(tmp_path.iterdir()) == []


# ---- on a GPU ---------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("nn", NUMBERS)
def test_demo_on_the_gpu_is_measured_not_emulated(tmp_path, nn):
    png = tmp_path / f"demo-{nn}.png"
    r = run(nn, "--backend", "cuda", "--out", str(png))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "backend: cuda" in r.stdout and "emulated" not in r.stdout, r.stdout
    assert "simulated" not in r.stdout.lower(), r.stdout
    png_size(png)
    seconds = float(re.search(r"saved .* \((\d+\.\d) s\)", r.stdout).group(1))
    assert seconds < 30, f"demo {nn} took {seconds} s on the GPU"


def test_list_with_a_number_shows_that_demo_only():
    r = run("--list", "3")
    assert r.returncode == 0 and "  03  " in r.stdout
    assert "  01  " not in r.stdout and "  07  " not in r.stdout


def test_out_to_a_folder_that_does_not_exist_says_so(tmp_path):
    r = run("00", "--out", f"{tmp_path}/slides/")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "names a folder that does not exist" in r.stderr
    assert f"{tmp_path}/slides/labkit-demo-01.png" in r.stderr
    assert not (tmp_path / "slides").exists()
