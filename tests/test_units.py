import pytest

from kvd.units import SizeError, format_iec, format_si, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("1KiB", 1024),
        ("3.8GiB", int(3.8 * 1024**3)),
        ("3.8 GiB", int(3.8 * 1024**3)),
        ("4GB", 4 * 10**9),
        ("512MB", 512 * 10**6),
        ("512MIB", 512 * 2**20),
        ("2kB", 2000),
        ("1TiB", 2**40),
        ("10B", 10),
        (7, 7),
    ],
)
def test_parses_iec_and_si(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "abc",
        "-1GiB",
        "0",
        "0GiB",
        "3.8Gb",
        "512mib",
        "3.8G",
        "1.5",
        "GiB",
        "1e9",
        "1,000",
        "4 GiBs",
        -5,
    ],
)
def test_rejects_garbage(text: str | int) -> None:
    with pytest.raises(SizeError):
        parse_size(text)


def test_formats() -> None:
    assert format_iec(320 * 2**20) == "320 MiB"
    assert format_iec(128 * 1024) == "128 KiB"
    assert format_si(42_949_672_960) == "42.9 GB"
    assert format_si(343_597_383_680) == "343.6 GB"
