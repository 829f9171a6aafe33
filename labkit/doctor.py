"""``python -m labkit doctor``: what this machine has, and what to do about what it lacks.

In a notebook::

    from labkit.doctor import doctor
    report, info = doctor()
    print(report)

``report`` is plain text in aligned columns; ``info`` holds the same facts as a dict
(versions are ``None`` where a package is missing).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import shutil
import sys

__all__ = ["doctor", "add_arguments", "run", "main", "PACKAGES", "TOOLS"]

# What the lesson code imports: a lesson cannot run without these.
_RUNTIME = "`make lab` or `make test` installs it (or: pip install -e .)"
PACKAGES: dict[str, str] = {
    "ipywidgets": _RUNTIME,
    "matplotlib": _RUNTIME,
    "tqdm": _RUNTIME,
    "numpy": _RUNTIME,
}
# Tools around the lessons: the lessons run without them (e.g. in a kernel that VS Code or
# nbconvert started), so a missing one is a fact, not a problem. Authoring tools (nbgrader)
# are not listed: no learner needs them.
TOOLS: dict[str, str] = {
    "jupyterlab": "opens the lessons in a browser; `make lab` installs it",
    "ipykernel": "runs notebook code; `make lab` installs it (with jupyterlab)",
    "nbconvert": "`make execute-notebooks`; installed with jupyterlab",
    "pytest": "`make test`; `make test` installs it (or: pip install -e '.[test]')",
    "nbval": "`make test` (notebooks); `make test` installs it (or: pip install -e '.[test]')",
}

_WIDTH = 20


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _torch_facts(info: dict, advice: list[str]) -> None:
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install raising anything else
        info.update(torch=None, torch_build=None, cuda_available=False, device_name=None,
                    capability=None, torch_error=f"{type(exc).__name__}: {exc}")
        advice.append(
            "torch is missing: `make lab` / `make test` install a CPU build into .venv. "
            "GPU users: install the CUDA build of torch that matches your driver first, "
            "then `make lab` (it keeps that torch)."
        )
        return

    info["torch"] = torch.__version__
    info["torch_path"] = os.path.dirname(torch.__file__)
    if getattr(torch.version, "hip", None):
        info["torch_build"] = f"ROCm {torch.version.hip}"
    elif torch.version.cuda:
        info["torch_build"] = f"CUDA {torch.version.cuda}"
    else:
        info["torch_build"] = "CPU only"

    # Triton ships with CUDA builds of torch (as "triton" or "pytorch-triton"); lesson 06's
    # attention="triton" backend needs it, everything else runs without it.
    info["triton"] = _version("triton") or _version("pytorch-triton")
    try:
        available = bool(torch.cuda.is_available())
    except Exception:  # a driver problem can raise here
        available = False
    info["cuda_available"] = available
    info["device_name"] = info["capability"] = None
    if available:
        idx = torch.cuda.current_device()
        info["device_name"] = torch.cuda.get_device_name(idx)
        major, minor = torch.cuda.get_device_capability(idx)
        info["capability"] = f"{major}.{minor} (sm_{major}{minor})"
        info["device_count"] = torch.cuda.device_count()
    elif info["torch_build"] == "CPU only" and shutil.which("nvidia-smi"):
        advice.append(
            "nvidia-smi is here but this torch is a CPU-only build: to run the lessons on the "
            "GPU, install a CUDA build of torch (see pytorch.org), then recreate .venv "
            "(`make distclean lab`)."
        )


def _backend_facts(info: dict, advice: list[str]) -> None:
    info["labkit_backend_env"] = os.environ.get("LABKIT_BACKEND")
    try:
        from labkit import backend
    except Exception as exc:
        info["backend"] = None
        info["backend_error"] = f"{type(exc).__name__}: {exc}"
        return
    try:
        name = backend.resolve("auto")
    except Exception as exc:
        info["backend"] = None
        info["backend_error"] = f"{type(exc).__name__}: {exc}"
        advice.append(f"backend: {exc}")
        return
    info["backend"] = name
    try:
        B = backend.get(name)
        info["backend_device"] = str(B.device)
    except Exception as exc:
        info["backend_error"] = f"{type(exc).__name__}: {exc}"
        advice.append(f"backend {name!r} does not load: {type(exc).__name__}: {exc}")


def _row(label: str, value: object) -> str:
    return f"  {label:<{_WIDTH}}{value}"


def doctor() -> tuple[str, dict]:
    """Collect the facts; return ``(report, info)``. Prints nothing."""
    info: dict = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(terse=True),
    }
    advice: list[str] = []
    _torch_facts(info, advice)
    _backend_facts(info, advice)
    info["packages"] = {name: _version(name) for name in PACKAGES}
    info["tools"] = {name: _version(name) for name in TOOLS}
    for name, version in info["packages"].items():
        if version is None:
            advice.append(f"{name} is missing and the lessons import it: {PACKAGES[name]}")
    info["advice"] = advice

    lines = ["labkit doctor: what this machine has for the CUDA Graphs Lab", ""]
    lines.append(_row("Python", f"{info['python']}  ({info['python_executable']})"))
    lines.append(_row("platform", info["platform"]))
    if info.get("torch"):
        lines.append(_row("torch", f"{info['torch']}  ({info['torch_path']})"))
        lines.append(_row("torch build", info["torch_build"]))
        lines.append(_row("triton", info["triton"] or "not installed (lesson 06's triton "
                          "attention backend needs it; the torch_native one runs anywhere)"))
    else:
        lines.append(_row("torch", f"missing  ({info.get('torch_error', '')})"))
    lines.append(_row("CUDA available", "yes" if info["cuda_available"] else "no"))
    if info["cuda_available"]:
        count = info.get("device_count", 1)
        lines.append(_row("device", f"{info['device_name']}  ({count} visible)"))
        lines.append(_row("capability", info["capability"]))
    else:
        lines.append(_row("device", "none (CPU)"))
    env = info["labkit_backend_env"]
    lines.append(_row("LABKIT_BACKEND", env if env is not None else "(not set)"))
    if info.get("backend"):
        why = {
            "cuda": "real CUDA graphs on the GPU",
            "emulated": "CPU emulator: same semantics, no real timing",
        }[info["backend"]]
        if env not in (None, "auto"):
            why += f"; forced by LABKIT_BACKEND={env}"
        lines.append(_row('backend "auto"', f"{info['backend']}  ({why})"))
        if "backend_device" in info:
            lines.append(_row("backend device", info["backend_device"]))
    else:
        lines.append(_row('backend "auto"', f"unavailable  ({info.get('backend_error', '')})"))
    if info.get("backend_error") and info.get("backend"):
        lines.append(_row("backend error", info["backend_error"]))
    lines.append("")
    lines.append("what the lessons import:")
    for name, version in info["packages"].items():
        lines.append(_row(name, version or "MISSING"))
    lines.append("tools around them (the lessons run without these):")
    for name, version in info["tools"].items():
        why = TOOLS[name].split(";")[0]
        lines.append(_row(name, version or f"not installed (used for: {why})"))
    lines.append("")
    if advice:
        lines.append("What to do:")
        lines.extend(f"  - {a}" for a in advice)
    else:
        lines.append("Everything the lessons need is here.")
    return "\n".join(lines), info


HELP = "what this machine has (Python, torch, GPU, backend, notebook tools)"
DESCRIPTION = "What this machine has for the CUDA Graphs Lab."


def add_arguments(parser) -> None:
    """The options of ``python -m labkit doctor``."""
    parser.add_argument("--json", action="store_true",
                        help="print the facts as one JSON object instead of the report")


def run(args) -> int:
    report, info = doctor()
    if args.json:
        import json

        print(json.dumps(info, indent=1, sort_keys=True, default=str))
    else:
        print(report)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit.doctor``: the same command as ``python -m labkit doctor``, with
    its options checked (an unknown one exits with status 2 and the usage)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m labkit doctor", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
