"""Timing several models against each other on a shared CPU (``bench`` and ``rewrite --tune``): the runs go in
rounds. Per round each model runs once untimed (its weights back in cache, the previous model's threads idle
again), then its share of the timed runs in a row; round r starts with model r mod n (A B C, B C A, C A B, ...:
each model in each place in turn), so a slow drift of the machine (other jobs, clocks) reaches every model alike.

Why not single runs A B, B A: each run then starts on caches the other model filled and next to its threads, and on
the 2-core development machine two sessions of the same YOLOv8 graph measured up to 1.16x apart, and ``--tune``
kept FPLUT on that detector as 1.05x faster while rounds measured the kept model 1.18x slower (2026-11-29,
benchmarks/field_cpu.sh). Why not one model after the other: a drift lands on whichever came last (the same FPLUT
model of a PP-OCRv4 recogniser measured 1.22x slower listed first, 1.21x faster listed third).

Why the pause (``settle``, SETTLE_S) before each model's turn: onnxruntime's intra-op threads spin after a run,
and the spinning threads of the model timed before slowed the next one. Without it, two sessions of one model
(ddddocr's OCR recogniser, 2 cores, default session options) measured 10.40 against 7.88 ms, always to the
disadvantage of the first session (so ``--tune``, which times the model before a pass first, kept passes that were
slower: FPLUT on that recogniser measured 1.41x faster, and 0.86-0.92x in its own sessions); a pause of 0 / 2 / 5 /
10 / 20 ms at each switch gave 10.40 / 7.88, 9.21 / 7.82, 7.69 / 7.82, 7.58 / 7.64, 7.73 / 7.72 (2026-11-29).
20 ms was too short for small models: after its last run an onnxruntime session's intra-op threads kept spinning
for 30-35 ms (the process's CPU time in 5 ms slices of sleep: 4-8 ms each for 35 ms, then 0; 2 cores, onnxruntime
1.32). A QuantGRU of 0.33 ms per call whose steps hand over between both cores (H = 128, T = 192) then ran next to
another session's spinning thread: 37 of 500 calls over 2 ms (p99 8.4 ms) with 20 ms pauses, 3 of 500 (p99 0.60 ms)
with 50 ms, and none alone in its process (2026-11-29 22:15 UTC); `bench` had reported that model's p90 1.2-1.3x
slower than the original's."""
from __future__ import annotations

import time

ROUND_RUNS = 5      # timed runs of one model in a row per round (after one untimed run)
SETTLE_S = 0.05     # pause before each model's turn in a round (module doc: onnxruntime spins ~35 ms), seconds
MAX_ROUNDS = 10     # rounds at most; each model's runs spread over them


def rounds_of(runs: int) -> list:
    """Timed runs per round: ``runs`` spread over min(MAX_ROUNDS, runs // ROUND_RUNS) rounds (at least one)."""
    n = max(1, min(MAX_ROUNDS, runs // ROUND_RUNS))
    return [runs // n + (r < runs % n) for r in range(n)]


def timed_rounds(runners, runs: int, clock=time.perf_counter, warmup: int = 0, settle=None) -> list:
    """Per runner (a callable running one model once) its ``runs`` timings in ms, in rounds (module doc), after
    ``warmup`` untimed calls of each (A B, A B, ...). ``settle()`` runs before each model's turn in a round (default:
    a pause of SETTLE_S, so that the previous model's intra-op threads stop spinning)."""
    if settle is None:
        settle = lambda: time.sleep(SETTLE_S)  # noqa: E731
    n = len(runners)
    for _ in range(warmup):
        for run in runners:
            run()
    times = [[] for _ in range(n)]
    for r, k in enumerate(rounds_of(runs)):
        for j in ((r + q) % n for q in range(n)):
            settle()
            runners[j]()
            for _ in range(k):
                t = clock()
                runners[j]()
                times[j].append((clock() - t) * 1e3)
    return times
