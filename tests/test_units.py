"""Torch-free helpers: units, argument checks and JSON format versions."""

from __future__ import annotations

import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipetrain.checks import is_int, non_negative_int, non_negative_number, positive_int
from pipetrain.jsonfile import unversioned, versioned
from pipetrain.units import (
    counted,
    format_bandwidth,
    format_bytes,
    format_seconds,
    parse_bandwidth,
    parse_bytes,
    time_unit,
)

# ---- units ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0 s"), (2.5, "2.5 s"), (0.0357, "35.7 ms"), (1e-3, "1 ms"), (4.2e-6, "4.2 µs")],
)
def test_format_seconds_picks_a_readable_unit(seconds: float, text: str) -> None:
    assert format_seconds(seconds) == text


def test_time_unit_scales_into_the_unit() -> None:
    assert time_unit(0.25) == (1e3, "ms")
    assert time_unit(90.0) == (1.0, "s")
    assert time_unit(1e-5) == (1e6, "µs")


@pytest.mark.parametrize(
    ("size", "text"),
    [(0, "0 B"), (512, "512 B"), (1500, "1.5 kB"), (2.5e6, "2.5 MB"), (1.5e9, "1.5 GB")],
)
def test_format_bytes_uses_decimal_units(size: float, text: str) -> None:
    assert format_bytes(size) == text


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("16GiB", 16 * 1024**3),
        ("500MB", 5e8),
        ("1024", 1024.0),
        ("1.5kB", 1500.0),
        ("1e9", 1e9),
        (" 2 KiB ", 2048.0),
        ("7B", 7.0),
    ],
)
def test_parse_bytes(text: str, size: float) -> None:
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["16 gigs", "", "GB", "16iB", "-1MB"])
def test_parse_bytes_refuses_non_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("text", "bandwidth"),
    [
        ("16GB/s", 16e9),
        ("10Gbit/s", 10e9 / 8),
        ("10Gb/s", 10e9 / 8),
        ("100Mbps", 100e6 / 8),
        ("1.5kB/s", 1500.0),
        ("infB/s", math.inf),
    ],
)
def test_parse_bandwidth(text: str, bandwidth: float) -> None:
    assert parse_bandwidth(text) == bandwidth


@pytest.mark.parametrize("text", ["16GB", "fast", "10 Gbit", "GB/s"])
def test_parse_bandwidth_refuses_non_bandwidths(text: str) -> None:
    with pytest.raises(ValueError, match="is not a bandwidth"):
        parse_bandwidth(text)


def test_format_bandwidth() -> None:
    assert format_bandwidth(16e9) == "16GB/s"
    assert format_bandwidth(1.25e9) == "1.25GB/s"
    assert format_bandwidth(500.0) == "500B/s"
    assert format_bandwidth(math.inf) == "infB/s"


@given(st.floats(min_value=1e-3, max_value=1e15, allow_nan=False))
def test_format_bandwidth_reads_back(bandwidth: float) -> None:
    assert parse_bandwidth(format_bandwidth(bandwidth)) == pytest.approx(bandwidth, rel=1e-11)


def test_units_and_checks_import_neither_torch_nor_the_rest_of_pipetrain() -> None:
    package = Path(__file__).resolve().parents[1] / "pipetrain"
    paths = [str(package / f"{name}.py") for name in ("units", "checks", "jsonfile")]
    # load each file on its own, so the package's __init__ (which imports the rest) stays out
    code = "\n".join(
        [
            "import importlib.util, sys",
            f"for path in {paths!r}:",
            "    spec = importlib.util.spec_from_file_location('helper', path)",
            "    spec.loader.exec_module(importlib.util.module_from_spec(spec))",
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pipetrain')))",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


# ---- checks ---------------------------------------------------------------------------------


def test_is_int_excludes_bools_and_floats() -> None:
    assert is_int(3) and is_int(-1)
    assert not is_int(True) and not is_int(3.0) and not is_int("3")


def test_positive_int() -> None:
    assert positive_int("runs", 4) == 4
    for bad in (0, -2, 1.5, True, "2", None):
        with pytest.raises(ValueError, match=f"runs must be a positive integer, got {bad!r}"):
            positive_int("runs", bad)


def test_non_negative_int() -> None:
    assert non_negative_int("warmup", 0) == 0
    for bad in (-1, 0.0, False):
        with pytest.raises(ValueError, match="warmup must be a non-negative integer"):
            non_negative_int("warmup", bad)


def test_non_negative_number() -> None:
    assert non_negative_number("size", 3) == 3.0
    assert type(non_negative_number("size", 3)) is float
    assert non_negative_number("size", Fraction(1, 4)) == 0.25
    for bad in (-0.5, math.nan, math.inf, True, "1", None):
        with pytest.raises(ValueError, match="size must be a finite number >= 0"):
            non_negative_number("size", bad)


# ---- JSON format versions -------------------------------------------------------------------


def test_versioned_round_trip() -> None:
    data = versioned(3, {"a": 1})
    assert data == {"format_version": 3, "a": 1}
    assert unversioned(data, "plan", 3) == {"a": 1}


def test_unversioned_refuses_other_versions_with_advice() -> None:
    with pytest.raises(ValueError, match=r"plan format_version 2 is not supported.*Plan again\."):
        unversioned({"format_version": 2}, "plan", 3, "Plan again.")
    with pytest.raises(ValueError, match="plan format_version None is not supported"):
        unversioned({"a": 1}, "plan", 3)
    with pytest.raises(ValueError, match="a plan must be a JSON object, got list"):
        unversioned([], "plan", 3)


def test_unversioned_default_stands_in_for_a_missing_version() -> None:
    assert unversioned({"a": 1}, "timeline", 1, default=1) == {"a": 1}
    with pytest.raises(ValueError, match="format_version 2"):
        unversioned({"format_version": 2}, "timeline", 1, default=1)


def test_counted_words() -> None:
    assert counted(1, "stage") == "1 stage"
    assert counted(3, "stage") == "3 stages"
    assert counted(2, "micro-batch", "micro-batches") == "2 micro-batches"
