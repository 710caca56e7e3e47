"""Units: one byte-size parser for the CLIs' size flags, counts in the unit that fits (issue 22, item 7
and `xmoe-params`)."""

from __future__ import annotations

import pytest

from xmoe_jax.cli import params_main, plan_main
from xmoe_jax.cli_models import convert_main
from xmoe_jax.config import ConfigError
from xmoe_jax.units import format_count, parse_bytes


@pytest.mark.parametrize(
    "text, size",
    [
        ("500KB", 500_000),
        ("500kb", 500_000),
        ("500K", 500 * 1024),
        ("500KiB", 500 * 1024),
        ("64G", 64 * 2**30),
        ("64GiB", 64 * 2**30),
        ("64gib", 64 * 2**30),
        ("80GB", 80 * 10**9),
        ("0.02MB", 20_000),
        ("1.5 MiB", 3 * 2**19),
        ("2T", 2 * 2**40),
        ("1TB", 10**12),
        ("1e3", 1000),
        ("141e9", 141 * 10**9),
        ("4096B", 4096),
    ],
)
def test_parse_bytes_accepts_the_common_units(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["64X", "GB", "64 GBs", "-1GB", "0", "lots"])
def test_parse_bytes_errors_name_the_flag_and_the_units(text):
    with pytest.raises(ConfigError, match=r"--device-memory=.*KB/KiB.*GB/GiB"):
        parse_bytes(text, "--device-memory")


def test_size_flags_fail_in_one_line_before_anything_loads(capsys):
    assert plan_main(["--devices", "8", "--device-memory", "64Q"]) == 2
    assert convert_main(["export", "--run-dir", "nowhere", "--out", "x", "--max-shard-size", "5 gigs"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "--device-memory='64Q'" in err[0] and "--max-shard-size='5 gigs'" in err[1]


def test_format_count_picks_the_unit_that_fits():
    assert [format_count(n) for n in (448, 1_024, 341_440, 2_700_000, 11_014_359_040, 2.5e12)] == [
        "448",
        "1.02K",
        "341.44K",
        "2.70M",
        "11.01B",
        "2.50T",
    ]


def test_params_table_of_the_tiny_model_reads_in_thousands(capsys):
    assert params_main(["--set", "model.num_layers=3"]) == 0
    out = capsys.readouterr().out
    assert "0.00B" not in out and "K " in out
