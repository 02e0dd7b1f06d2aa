#!/usr/bin/env python3
"""Benchmark the payload checksums: XXH3-64 (what the cache writer uses), XXH64 (caches
written before) and SHA-256 (version 1 caches), through PayloadHasher as the cache's
reader calls it.

For each algorithm it prints GB/s (min / median / max of --reps runs) over a buffer of
--size-mib MiB, two ways:
- hot: one buffer in anonymous memory, touched once before timing (the bytes come from
  DRAM at a size past the last-level cache, but no page is faulted in while timing);
- mapped: a file of the same bytes (in the page cache: written, then read once), mapped
  afresh for each run, as a load from the cache maps a payload into its slot; the time
  includes faulting the mapping's pages in, which is what a first check pays.
With --threads T the buffer is T slices hashed at once by T threads (each its own
digest, as the reader checks T entries at once); the C update releases the GIL.
XXH3 runs the loop of the kernels' ISA (ONNX_PREP_ISA forces one: scalar, avx2, avx512).

Usage: python scripts/bench_checksum.py [--size-mib 512] [--reps 5] [--threads 1]
                                        [--algorithms xxh3,xxh64,sha256] [--dir DIR]
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from onnx_prep.core.cache.payload_digest import ALGORITHMS, PayloadHasher
from onnx_prep.native.isa import active_isa


def hash_slices(buf, algorithm: str, pool: ThreadPoolExecutor, threads: int) -> float:
    """Seconds to digest ``buf`` as ``threads`` slices at once."""
    mv = memoryview(buf).cast("B")
    step = -(-mv.nbytes // threads)

    def one(i: int) -> str:
        h = PayloadHasher(algorithm)
        h.update(mv[i * step:(i + 1) * step])
        return h.digest()

    t0 = time.perf_counter()
    list(pool.map(one, range(threads)))
    return time.perf_counter() - t0


def rates(nbytes: int, seconds: list[float]) -> str:
    gbs = sorted(nbytes / s / 1e9 for s in seconds)
    return f"{gbs[0]:6.2f} / {statistics.median(gbs):6.2f} / {gbs[-1]:6.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--dir", default=None, help="folder for the mapped file (default: the temp folder)")
    args = ap.parse_args()
    algorithms = args.algorithms.split(",")
    nbytes = args.size_mib << 20
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    print(f"{args.size_mib} MiB, {args.threads} thread(s), xxh3 loop: {active_isa()}; "
          f"GB/s min / median / max of {args.reps}")
    with ThreadPoolExecutor(args.threads) as pool, \
            tempfile.NamedTemporaryFile(dir=args.dir, prefix="bench_checksum.") as f:
        f.write(data.tobytes())
        f.flush()
        f.seek(0)
        while f.read(64 << 20):  # into the page cache
            pass
        for algorithm in algorithms:
            hot = [hash_slices(data, algorithm, pool, args.threads) for _ in range(args.reps)]
            mapped = []
            for _ in range(args.reps):
                with mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ) as m:
                    mapped.append(hash_slices(m, algorithm, pool, args.threads))
            print(f"  {algorithm:7s} hot {rates(nbytes, hot)}   mapped {rates(nbytes, mapped)}")


if __name__ == "__main__":
    main()
