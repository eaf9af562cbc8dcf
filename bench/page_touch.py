#!/usr/bin/env python3
"""What a page costs the first time it is touched, by memory in use.

    python3 bench/page_touch.py [--gib 18] [--rounds 2]

Maps that much anonymous memory, writes one byte per 4 KiB page (each
write a page fault that takes and zeroes a fresh page), and prints the
time per page for each GiB in turn: the cost of a page with that much
already in use. The mapping is released after each round. No
berth runs here: this measures the machine, so that a launch rate that
falls as instances fill memory can be told apart from a cost of berth's
(BENCHMARKS.md, "Scale"). On bare metal the cost per page hardly depends
on the size; in a VM whose memory the host provides on first touch, it
can grow with it.
"""

import argparse
import mmap
import time

PAGE = 4096


def touch(gib):
    """Seconds per page for each GiB of a mapping of `gib` GiB, in order."""
    size = gib << 30
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    per_gib = []
    try:
        for first in range(0, size, 1 << 30):
            start = time.perf_counter()
            for offset in range(first, first + (1 << 30), PAGE):
                area[offset] = 1
            per_gib.append((time.perf_counter() - start) / ((1 << 30) // PAGE))
        return per_gib
    finally:
        area.close()


def loop_cost(pages=1 << 20):
    """The interpreter's own cost per iteration, on one page touched
    again and again, subtracted from each result."""
    area = mmap.mmap(-1, PAGE)
    area[0] = 1
    start = time.perf_counter()
    for _ in range(pages):
        area[0] = 1
    area.close()
    return (time.perf_counter() - start) / pages


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=int, default=18)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    overhead = loop_cost()
    print(f"loop overhead {overhead * 1e6:.3f} us per page (subtracted)")
    for r in range(args.rounds):
        costs = [f"{(c - overhead) * 1e6:.1f}" for c in touch(args.gib)]
        print(f"round {r + 1}, us per page in each GiB: {' '.join(costs)}")


if __name__ == "__main__":
    main()
