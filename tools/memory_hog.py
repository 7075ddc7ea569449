"""Another program wanting memory: allocate GB gigabytes (every page written, so it is really
taken), hold them SECONDS seconds, then exit and give them back.

    python tools/memory_hog.py GB SECONDS [--rate GB_PER_S]

It allocates in 64 MiB pieces at --rate GB/s (default 1.5: a program filling memory fast, but not
in one instant, as real programs do), printing a timestamped line on stderr when it starts, when
it holds everything, and when it lets go. Used to show that a streamed deltafin gives its RAM
caches back under pressure and takes them again afterwards.
"""
from __future__ import annotations

import argparse
import sys
import time

PIECE = 64 * 2**20


def say(msg: str) -> None:
    print(f"memory_hog {time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d}: {msg}",
          file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gb", type=float, help="gigabytes (1e9 bytes) to take")
    ap.add_argument("seconds", type=float, help="how long to hold them")
    ap.add_argument("--rate", type=float, default=1.5, help="GB/s to allocate at (default 1.5)")
    a = ap.parse_args()
    if not (0 < a.gb < 1e6 and 0 <= a.seconds < 1e7 and a.rate > 0):
        ap.error("GB must be above 0, SECONDS at least 0, --rate above 0")
    want = int(a.gb * 1e9)
    say(f"taking {a.gb:g} GB at {a.rate:g} GB/s")
    held: list[bytearray] = []
    t0 = time.monotonic()
    got = 0
    while got < want:
        n = min(PIECE, want - got)
        held.append(bytearray(b"\x01") * n)  # written, not just reserved
        got += n
        ahead = t0 + got / (a.rate * 1e9) - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
    say(f"holding {got / 1e9:.2f} GB for {a.seconds:g} s")
    time.sleep(a.seconds)
    held.clear()
    say("released")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
