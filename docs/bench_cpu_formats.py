"""Our weight formats on this CPU: fp32 (as loaded), ``int4`` and ``int4-bf16``, one thread.

The 4-bit kernels and ``int4-bf16``'s dense copy compute in bf16, which only some CPUs
multiply natively (oneDNN's bf16: AVX-512 or AMX); on an AVX2-only CPU it is emulated.
This prints which kind of CPU this is (``native_bf16_matmul``) and, per format, three
forwards through a paged engine (fp16 pool, the engine's own attention): one decode
step at 1,000 tokens of context (uncompiled), a 20-token turn after 1,000 cached
tokens, and a 1,024-token prefill from scratch. The formats alternate each round;
medians of ``--rounds``, and each format's time as a ratio to fp32's.

The format is asked for as the user would ask, so on a CPU without native bf16
``int4-bf16`` keeps no dense copy (models/quantization.py) and its row reads as
``int4``'s; ``--force-dense`` keeps the copy anyway, to show what it would cost.

Run: ``python docs/bench_cpu_formats.py [--rounds 3] [--force-dense]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import warnings

import torch

from clm_middleware.cache.paged import PagedCache
from clm_middleware.cli.setup import build_engine
from clm_middleware.models import quantization

FORMATS = (None, "int4", "int4-bf16")
CASES = {
    "decode step at 1,000 (ms)": (1000, 1),
    "20-token turn after 1,000 (ms)": (1000, 20),
    "1,024 from scratch (ms)": (0, 1024),
}


def forward_ms(engine, ids: list[int], context: int, new: int) -> float:
    """One forward of ``new`` tokens after ``context`` already in the pool (not timed)."""
    pool = engine.pool
    blocks = pool.allocate(-(-(context + new) // pool.block_size))
    try:
        cache = PagedCache(pool, blocks, num_tokens=0, writable_from=0, attend_in_place=engine.attends_in_place)
        if context:
            engine.forward(ids[:context], cache)
        started = time.perf_counter()
        engine.forward(ids[context : context + new], cache)
        return (time.perf_counter() - started) * 1000
    finally:
        pool.release(blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--force-dense", action="store_true", help="int4-bf16 keeps its bf16 copy on any CPU")
    args = parser.parse_args()
    torch.set_num_threads(1)
    native = quantization.native_bf16_matmul()
    if args.force_dense:
        quantization.native_bf16_matmul = lambda: True
    random.seed(0)
    ids = [random.randrange(1000, 20000) for _ in range(1100)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the emulated-bf16 warning: this script's subject
        engines = {fmt: build_engine(None, kv_dtype="fp16", paged_kv=True, quantization=fmt) for fmt in FORMATS}
    times: dict[tuple[str | None, str], list[float]] = {(fmt, case): [] for fmt in FORMATS for case in CASES}
    for round_ in range(args.rounds):
        for fmt in FORMATS if round_ % 2 == 0 else reversed(FORMATS):
            for case, (context, new) in CASES.items():
                times[(fmt, case)].append(forward_ms(engines[fmt], ids, context, new))
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, CPU capability {capability}, native bf16 matmul: {native}")
    dense = "kept (--force-dense)" if args.force_dense else ("kept" if native else "not kept")
    print(f"int4-bf16's dense bf16 copy: {dense}; medians of {args.rounds} rounds, one thread\n")
    print("| forward | fp32 | int4 | int4-bf16 |")
    print("| --- | --- | --- | --- |")
    for case in CASES:
        base = statistics.median(times[(None, case)])
        cells = [f"{base:.0f}"] + [
            f"{statistics.median(times[(fmt, case)]):.0f} ({statistics.median(times[(fmt, case)]) / base:.2f}×)"
            for fmt in FORMATS[1:]
        ]
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
