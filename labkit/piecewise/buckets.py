"""Token-count buckets: which piecewise graphs to capture.

A piece's shape is fixed by the number of tokens in the batch, whatever the requests
are, so piecewise graphs are captured per *token count* and a batch is padded up to the
smallest bucket that holds its tokens (decode graphs, lesson 06, are keyed by requests).
vLLM's default list (``CompilationConfig.max_cudagraph_capture_size``'s docstring) is
dense where batches are small and sparse above 256:

    [1, 2, 4] + range(8, 256, 8) + range(256, max_cudagraph_capture_size + 1, 16)
"""

from __future__ import annotations

from labkit.core.validate import check_int
from labkit.decode.buckets import make_buckets

__all__ = ["vllm_token_buckets", "token_buckets"]


def vllm_token_buckets(max_num_tokens: int) -> list[int]:
    """vLLM's default capture sizes up to ``max_num_tokens`` (itself always included)."""
    max_num_tokens = check_int("max_num_tokens", max_num_tokens, 1,
                               fix="the most tokens one batch may hold, e.g. 256")
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_num_tokens + 1, 16))
    return sorted({s for s in sizes if s <= max_num_tokens} | {max_num_tokens})


def token_buckets(max_num_tokens: int, scheme="vllm") -> list[int]:
    """Buckets by scheme name ("vllm", "pow2", "every") or an explicit list of token
    counts (sorted, each 1..max_num_tokens)."""
    max_num_tokens = check_int("max_num_tokens", max_num_tokens, 1,
                               fix="the most tokens one batch may hold, e.g. 256")
    if isinstance(scheme, str):
        if scheme == "vllm":
            return vllm_token_buckets(max_num_tokens)
        if scheme in ("pow2", "every"):
            return make_buckets(max_num_tokens, scheme)
        raise ValueError(f"unknown token bucket scheme {scheme!r}: choose 'vllm', 'pow2', "
                         "'every' or pass a list of token counts")
    if not hasattr(scheme, "__iter__"):
        raise TypeError(f"buckets must be a scheme name ('vllm', 'pow2', 'every') or a list "
                        f"of token counts, got {type(scheme).__name__}")
    sizes = [check_int(f"buckets[{i}]", b, 1, max_num_tokens,
                       fix=f"a bucket is a token count, at most max_num_tokens={max_num_tokens}")
             for i, b in enumerate(scheme)]
    if not sizes:
        raise ValueError("buckets is an empty list: give at least one token count, e.g. [16, 64]")
    return sorted(set(sizes))
