"""One benchmark result row as a dataclass, in the JSON shape ``results.json`` holds.

:class:`Row` is the schema of :mod:`labkit.bench.report`: :meth:`Row.from_dict` checks a
row read from JSON (the checks :func:`labkit.bench.report.validate_row` reports) and
:meth:`Row.to_dict` writes it back key for key, in the same order, optional keys left out
where unset, so that a row read and written again is the same JSON text.

.. warning::
    The variant must be declared (:mod:`labkit.bench.variants`): a row of an undeclared
    one cannot be ordered or described in the tables, so it is refused when it is made
    or read, never sorted quietly to the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.bench.variants import variant as _declared

__all__ = ["Row", "REQUIRED_KEYS", "OPTIONAL_KEYS"]

REQUIRED_KEYS = ("suite", "config_name", "config", "batch_size", "variant", "median_us",
                 "device", "torch", "date")
OPTIONAL_KEYS = ("back_to_back_us", "gpu_busy_us", "run", "note", "extra")
_JSON_ORDER = ("suite", "config_name", "config", "batch_size", "variant", "median_us",
               "back_to_back_us", "gpu_busy_us", "device", "torch", "date", "run", "note",
               "extra")


@dataclass
class Row:
    """One measurement: a variant of a suite at one configuration and batch size.

    Args:
        median_us: the synced per-call time, or None for a row that says (``note``) why
            it has no number.
        back_to_back_us, gpu_busy_us: per call back to back / GPU busy, where measured.
        run: the process that timed it (only rows of one run are compared).
        extra: suite-specific figures; ``extra["rounds"]`` maps each timing method to one
            value per interleaved round.
    """

    suite: str
    config_name: str
    config: dict
    batch_size: int | None
    variant: str
    median_us: float | None
    device: str
    torch: str
    date: str
    back_to_back_us: float | None = None
    gpu_busy_us: float | None = None
    run: str | None = None
    note: str | None = None
    extra: dict | None = None

    def __post_init__(self):
        self.check()

    def to_dict(self) -> dict:
        """The row as ``results.json`` holds it: keys in the file's order, the optional
        ones only where set."""
        return {k: getattr(self, k) for k in _JSON_ORDER
                if k in REQUIRED_KEYS or getattr(self, k) is not None}

    @classmethod
    def from_dict(cls, row: dict) -> Row:
        """Read (and check) one row of ``results.json``; ValueError naming what is wrong."""
        if not isinstance(row, dict):
            raise ValueError(f"a benchmark row must be an object with keys "
                             f"{', '.join(REQUIRED_KEYS)}, got {type(row).__name__}: {row!r}")
        missing = [k for k in REQUIRED_KEYS if k not in row]
        if missing:
            raise ValueError(f"benchmark row lacks {missing}: {row}")
        unknown = [k for k in row if k not in _JSON_ORDER]
        if unknown:
            raise ValueError(f"benchmark row has unknown keys {unknown} (a row holds "
                             f"{', '.join(_JSON_ORDER)}; put suite-specific figures in "
                             f"extra): {row}")
        if "run" in row and not isinstance(row["run"], str):
            raise ValueError(f"run must be a string naming the process, got {row['run']!r}")
        return cls(**row)

    def check(self) -> None:
        """Raise ValueError for a wrong type, a number-less row without a note, malformed
        ``extra.rounds`` or an undeclared variant."""
        row = self.to_dict()
        if self.median_us is not None and (isinstance(self.median_us, bool) or
                                           not isinstance(self.median_us, (int, float))):
            raise ValueError(f"median_us must be a number or null: {row}")
        if self.median_us is None and not self.note:
            raise ValueError(f"a row without a number needs a note saying why: {row}")
        for key in ("suite", "config_name", "variant", "device", "torch", "date"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"{key} must be a string, got {getattr(self, key)!r}: {row}")
        if self.batch_size is not None and (isinstance(self.batch_size, bool) or
                                            not isinstance(self.batch_size, int)):
            raise ValueError(f"batch_size must be an integer or null, got {self.batch_size!r}")
        if self.run is not None and not isinstance(self.run, str):
            raise ValueError(f"run must be a string naming the process, got {self.run!r}")
        _check_rounds(self.extra)
        _declared(self.suite, self.variant)


def _check_rounds(extra) -> None:
    rounds = extra.get("rounds") if isinstance(extra, dict) else None
    if rounds is None:
        return
    if not isinstance(rounds, dict) or not all(
            isinstance(v, list) and v and all(isinstance(x, (int, float))
                                              and not isinstance(x, bool) for x in v)
            for v in rounds.values()):
        raise ValueError("extra.rounds must map each method to a non-empty list of "
                         f"numbers, one per round, got {rounds!r}")
    if len({len(v) for v in rounds.values()}) > 1:
        raise ValueError("extra.rounds must hold the same number of rounds for every "
                         f"method, got {({k: len(v) for k, v in rounds.items()})}")
