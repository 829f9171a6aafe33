"""Re-run chosen cells of a notebook and store their outputs; every other cell keeps its own.

    python tools/rerun_cells.py notebooks/06_decode_bucketing.ipynb l06-44 l06-46 b71640ca

The lessons' stored outputs come from a GPU (an H200), cell by cell: a cell changed on a
machine without one is run there only so that its stored output is valid, and the GPU run
replaces it later. This runs the notebook's code cells in order in a fresh kernel (in the
notebook's folder) up to the last cell named, then writes back the outputs and execution
counts of the named cells only. Nothing is written if any cell run raises, or if a named
cell writes to stderr (the lessons store no error and no stderr: tests/test_stored_outputs.py).

``--store-in-source`` is for the GPU-only cells whose CPU branch prints the GPU's stored
output (``print(\"\"\"[GPU only: the output of this cell on ..., stored]`` and the text up
to the closing quotes): run on the GPU, it also puts the cell's new printed output there,
so that a machine without a GPU prints what the GPU printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python tools/rerun_cells.py",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("notebook", type=Path, help="the .ipynb to update in place")
    ap.add_argument("cells", nargs="+", metavar="CELL_ID", help="ids of the cells to re-run")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    ap.add_argument("--kernel", default="python3", help="kernel name (default python3)")
    ap.add_argument("--setup", nargs="+", default=None, metavar="CELL_ID",
                    help="run only these cells (in notebook order) before the named ones, "
                         "instead of every code cell above them (their outputs are kept)")
    ap.add_argument("--store-in-source", action="store_true",
                    help="also copy each named GPU-only cell's printed output into its CPU "
                         "branch's stored text (run on the GPU)")
    return ap


STORED_HEAD = '    print("""[GPU only: the output of this cell on '
STORED_TAIL = '""")'


def store_in_source(source: str, printed: str, device: str) -> str:
    """``source`` with the stored GPU output of its CPU branch replaced by ``printed``
    (the header names ``device``). Raises ValueError when the cell has no such branch or
    the text cannot sit inside triple quotes."""
    start = source.find(STORED_HEAD)
    end = source.find(STORED_TAIL, start + len(STORED_HEAD)) if start >= 0 else -1
    if start < 0 or end < 0:
        raise ValueError("no stored GPU output to replace (a line starting "
                         f"{STORED_HEAD.strip()!r} and closed by {STORED_TAIL!r})")
    if '"""' in printed or "\\" in printed:
        raise ValueError('the printed output holds """ or a backslash: store it by hand')
    article = "an " if device[:1].upper() in "AEIOUN" else "a "     # "an NVIDIA H200"
    head = f'{STORED_HEAD}{article}{device}, torch {torch_version()}, stored]\n'
    return source[:start] + head + printed.rstrip("\n") + source[end:]


def torch_version() -> str:
    import torch
    return torch.__version__.split("+")[0].rsplit(".", 1)[0]


def rerun(path: Path, ids: list[str], *, timeout: int = 600, kernel: str = "python3",
          in_source: bool = False, setup: list[str] | None = None) -> dict:
    """Run ``path``'s code cells up to the last of ``ids``; store the outputs of ``ids``.

    ``setup``: the only cells run before the named ones (else every code cell above).
    Returns ``{cell id: outputs}`` of the named cells. Raises ValueError (an unknown id,
    a named cell that is not code, a named cell that wrote to stderr) or nbclient's
    CellExecutionError; the file is written only when every cell ran cleanly.
    """
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    index = {c.get("id"): i for i, c in enumerate(nb.cells)}
    unknown = [i for i in [*ids, *(setup or [])] if i not in index]
    if unknown:
        code = ", ".join(c.get("id") for c in nb.cells if c.cell_type == "code")
        raise ValueError(f"{path}: no cell with id {', '.join(map(repr, unknown))}; its code "
                         f"cells are {code}")
    not_code = [i for i in [*ids, *(setup or [])] if nb.cells[index[i]].cell_type != "code"]
    if not_code:
        raise ValueError(f"{path}: {', '.join(map(repr, not_code))} not a code cell: only code "
                         "cells have outputs to re-run")
    last = max(index[i] for i in ids)
    run = nbformat.v4.new_notebook(metadata=nb.metadata)
    chosen = None if setup is None else {*ids, *setup}
    cells = [c for c in nb.cells[:last + 1] if c.cell_type == "code"
             and (chosen is None or c.get("id") in chosen)]
    run.cells = [nbformat.v4.new_code_cell(c.source) for c in cells]
    where = [c.get("id") for c in cells]
    NotebookClient(run, timeout=timeout, kernel_name=kernel,
                   resources={"metadata": {"path": str(path.parent.resolve())}}).execute()
    got = {}
    for cid, c in zip(where, run.cells):
        if cid not in ids:
            continue
        stderr = [o for o in c.outputs if o.output_type == "stream" and o.name == "stderr"]
        if stderr:
            raise ValueError(f"{path}: cell {cid} wrote to stderr: {stderr[0].text[:300]!r}; "
                             "nothing written (a lesson stores no stderr)")
        got[cid] = c.outputs
    if in_source:
        import torch
        if not torch.cuda.is_available():
            raise ValueError("--store-in-source stores a GPU's output: run it on the GPU")
        device = torch.cuda.get_device_name()
        for cid, outputs in got.items():
            printed = "".join(o.text for o in outputs
                              if o.output_type == "stream" and o.name == "stdout")
            try:
                nb.cells[index[cid]].source = store_in_source(nb.cells[index[cid]].source,
                                                              printed, device)
            except ValueError as e:
                raise ValueError(f"{path}: cell {cid}: {e}") from None
    for cid, outputs in got.items():
        cell = nb.cells[index[cid]]
        cell.outputs = outputs
        if cell.get("execution_count") is None:      # nbval refuses outputs on an unrun cell
            cell.execution_count = index[cid]
    nbformat.write(nb, path)
    return got


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if not args.notebook.is_file():
        _parser().error(f"{args.notebook}: no such notebook")
    try:
        got = rerun(args.notebook, args.cells, timeout=args.timeout, kernel=args.kernel,
                    in_source=args.store_in_source, setup=args.setup)
    except ValueError as e:
        print(f"rerun_cells: {e}", file=sys.stderr)
        return 2
    except Exception as e:                     # a cell raised: say which, write nothing
        print(f"rerun_cells: a cell failed, {args.notebook} left as it was:\n"
              f"{type(e).__name__}: {str(e)[-1500:]}", file=sys.stderr)
        return 1
    print(f"{args.notebook}: stored the outputs of {', '.join(got)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
