"""Link rates in tc's syntax ("250mbit", "1gbit", "8gbit") as bytes per second."""

from __future__ import annotations

import re

# tc(8) "RATES": SI prefixes are powers of 1000, IEC prefixes (ki, mi, gi, ti) powers of 1024;
# "bit" counts bits, "bps" counts bytes; a bare number is bits per second.
_PREFIXES = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_UNITS = {"bit": 1 / 8, "bps": 1.0}
_RATE = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+)(?P<prefix>[kmgt]i?)?(?P<unit>bit|bps)?", re.IGNORECASE)


def parse_bandwidth(text: str) -> float:
    """Bytes per second of a rate written as for `tc ... rate RATE`.

        parse_bandwidth("1gbit")   == 125e6        # 10**9 bit/s / 8
        parse_bandwidth("250mbit") == 31.25e6
        parse_bandwidth("1mibps")  == 2**20        # IEC prefix, bytes
        parse_bandwidth("8000")    == 1000.0       # bare number: bit/s, as in tc

    Units are case-insensitive. Raises ValueError for anything tc would not read as a rate of at
    least one byte per second (empty text, unknown unit, spaces inside, zero).
    """
    match = _RATE.fullmatch(text.strip())
    if match is None or (match["prefix"] and not match["unit"]):
        raise ValueError(
            f"bandwidth {text!r}: expected a positive number with a tc rate unit, "
            "e.g. 250mbit, 1gbit, 8gbit, 100mbps (SI) or 1gibit (IEC)"
        )
    prefix = _PREFIXES[(match["prefix"] or "").lower()]
    unit = _UNITS[(match["unit"] or "bit").lower()]
    rate = float(match["number"]) * prefix * unit
    if rate < 1:  # tc keeps whole bytes per second: less is no rate at all
        raise ValueError(f"bandwidth {text!r}: must be at least 8bit (1 byte/s)")
    return rate
