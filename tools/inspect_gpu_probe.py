"""What torch's debug_dump writes on this GPU, for labkit.inspect (run on a GPU machine).

    python tools/inspect_gpu_probe.py --out DIR

Writes into DIR the DOT files CUDA printed (``fork_join.dot``: two streams joined;
``mlp.dot``: lesson 02's MLP) and prints, for each, what :func:`labkit.inspect.parse_dot`
reads from it. It also answers one question the code of ``CUDAGraph::capture_end`` raises:
does ``enable_debug_mode()`` on a plain graph (no ``keep_graph``) still let ``debug_dump``
print it? (``capture_end`` sets ``has_graph_ = false`` whenever ``keep_graph`` is False, and
``debug_dump`` prints only if ``has_graph_``.) The DOT files can become test fixtures.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("inspect_probe_out"),
                   help="folder for the DOT files (created)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU here: this probe reads what CUDA prints; run it on a GPU machine",
              file=sys.stderr)
        return 2
    from labkit import backend
    from labkit.inspect import captured_dag, fork_join, inspectable_graph, parse_dot

    B = backend.get("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.get_device_name()}")

    g, x, d = fork_join(B)
    g.debug_dump(str(args.out / "fork_join.dot"))
    dag = captured_dag(g, B)
    print("fork_join:", dag.describe())
    print("   edges", dag.edges, "| labels", [n.label for n in dag.nodes])
    g.replay()
    torch.cuda.synchronize()
    print("   replay == 3x + 2:", torch.equal(d, 3 * x + 2))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 8)).cuda()
    static_x = torch.zeros(4, 16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(s)
    g2 = inspectable_graph(B)
    with torch.no_grad(), torch.cuda.graph(g2):
        model(static_x)
    g2.debug_dump(str(args.out / "mlp.dot"))
    dag2 = parse_dot((args.out / "mlp.dot").read_text(), source="cuda")
    print("mlp:", dag2.describe())
    for n in dag2.nodes:
        print(f"   {n.index}: {n.kind:6s} {n.label}  {n.detail}")

    g3 = torch.cuda.CUDAGraph()
    g3.enable_debug_mode()
    with torch.no_grad(), torch.cuda.graph(g3):
        model(static_x)
    path = args.out / "debug_mode_only.dot"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        g3.debug_dump(str(path))
    wrote = path.exists() and path.stat().st_size > 0
    print("enable_debug_mode() without keep_graph: debug_dump wrote a file:", wrote,
          "| torch's warnings:", [str(w.message)[:60] for w in seen])
    return 0


if __name__ == "__main__":
    sys.exit(main())
