"""Benchmark of the cache index: the native backend against the Python reference, in the
same run, through the :class:`~foretoken.core.index.protocol.Index` protocol (issue 17).

``foretoken bench index [--quick]`` (or ``python -m foretoken.bench.index_bench``) prints one
JSON object; ``summary`` is flat, each figure beside the reference's
(``summary.reference.*``) and their ratio (``summary.ratio.*``, > 1: native better):

* ``ingest_stored_blocks_per_cpu_s``: 16 workers, engine batches of 1–3 BlockStored of
  16–64 blocks (40 on average) of 16 tokens, chains continued 70% of the time, and once an
  engine is full a BlockRemoved evicting its oldest blocks. The index is first filled to
  ``entries`` (10 M; 1 M with ``--quick``), then stores + removals are timed at that size
  (CPU time of ``apply`` alone, on :class:`~foretoken.wire.records.KvEventBatch` records as
  the ingest service hands them over: token ids packed, ``BlockStored.packed_token_ids``;
  median of 5 segments). ``ingest_int_ids_stored_blocks_per_cpu_s``: the same records
  with their token ids as tuples of ints (a producer that does not pack them; the crate
  reads each int). ``ingest_packed_stored_blocks_per_cpu_s``: the same native steady
  phase with the hashes packed too (``foretoken_native.NativeIndex.apply_batch``: the
  crate alone, no struct to read). ``ingest_decode_apply_{json,msgpack}_…`` and
  ``ingest_decode_apply_int_ids_{json,msgpack}_…``: the worker's whole path, the records
  encoded as on the ``kv-events`` topic, decoded (:func:`foretoken.wire.codec.decode`)
  and applied, with the ids packed and as ints.
* ``lookup_64w_32k_p99_ms``: CPU p99 of ``lookup`` of a 32k-token prompt (a numpy uint32
  array, as the route path has it) over 64 workers, each holding a random prefix of each of
  the 128k-token documents, mostly in GPU, its tail in CPU (hashing included).
* ``hash_32k_us``: ``hash_prompt`` of a 32k-token prompt (block size 16), CPU µs (best of
  repeated calls).
* ``bytes_per_entry``: RSS growth per (block, worker) entry of a fresh process that stores
  ``entries`` entries as 32-block chains on 64 workers, each block on one worker.

Each backend's ingest and memory run in a fresh process, one after the other. ``--callgrind``
(on in the full run) adds instruction counts (``valgrind --tool=callgrind``, repeatable on a
shared machine) of one lookup, one hash and one stored block, native against reference: a
process that sets up and runs k operations minus one that sets up and runs none, over k
(k large enough that a process start's variation, ~2 M instructions, stays below 0.5%).
"""

from __future__ import annotations

import argparse
import array
import gc
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from foretoken.bench.index_ingest import (  # bench_ingest: run by name in a subprocess
    BLOCK,
    MODEL,
    VOCAB,
    Engine,
    bench_ingest,
    stored_blocks,
    token_pool,
)
from foretoken.core.index.protocol import Index, make_index
from foretoken.core.types import EngineBlockHash, WorkerId
from foretoken.wire.records import BlockStored, KvEventBatch, Tier

BACKENDS = ("native", "python")  # the python backend is the reference
TARGETS = {
    "ingest_stored_blocks_per_cpu_s": 3_000_000,
    "lookup_64w_32k_p99_ms": 0.25,
    "hash_32k_us": 30.0,
    "bytes_per_entry": 64.0,
}
# (figure, True when higher is better)
FIGURES = (
    ("ingest_stored_blocks_per_cpu_s", True),
    ("lookup_64w_32k_p99_ms", False),
    ("hash_32k_us", False),
    ("bytes_per_entry", False),
)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --------------------------------------------------------------------------- lookup


def _documents(rng: random.Random, n_docs: int, pool: list[tuple[int, ...]]) -> list[np.ndarray]:
    blocks = 131_072 // BLOCK
    return [
        np.array([t for _ in range(blocks) for t in pool[rng.randrange(len(pool))]], np.uint32)
        for _ in range(n_docs)
    ]


def _chain(
    doc: np.ndarray, start: int, stop: int, parent: EngineBlockHash | None,
    rng: random.Random, medium: Tier,
) -> list[BlockStored]:  # fmt: skip
    out = []
    for lo in range(start, stop, 64):
        hi = min(stop, lo + 64)
        hashes = tuple(EngineBlockHash(h) for h in array.array("Q", rng.randbytes(8 * (hi - lo))))
        out.append(BlockStored(block_hashes=hashes, parent_block_hash=parent,
                               token_ids=tuple(doc[lo * BLOCK : hi * BLOCK].tolist()),
                               block_size=BLOCK, medium=medium))  # fmt: skip
        parent = hashes[-1]
    return out


def load_fleet(backend: str, workers: int, docs: list[np.ndarray], seed: int) -> Index:
    """Each worker holds, of each document, a random prefix: mostly GPU, its tail in CPU."""
    rng = random.Random(seed)
    index = make_index(backend)  # type: ignore[arg-type]
    for w in range(workers):
        worker_id = WorkerId(f"w{w}")
        index.register_worker(worker_id, MODEL, BLOCK)
        events: list[BlockStored] = []
        for doc in docs:
            held = int(len(doc) // BLOCK * rng.random() ** 0.5)
            gpu = int(held * rng.uniform(0.5, 1.0))
            stored = _chain(doc, 0, gpu, None, rng, "GPU")
            parent = stored[-1].block_hashes[-1] if stored else None
            events += stored + _chain(doc, gpu, held, parent, rng, "CPU")
        batch = KvEventBatch(worker_id=worker_id, model=MODEL, seq=0, ts=0.0, events=tuple(events))
        index.apply(batch, 0.0)
    return index


def _latencies(fn: Callable[[int], object], queries: int) -> dict[str, float]:
    """p50/p99 of one call: CPU time of this thread (the machine is shared) and wall."""
    for i in range(min(10, queries)):
        fn(i)
    cpu, wall = [], []
    for i in range(queries):
        c0, w0 = time.thread_time(), time.perf_counter()
        fn(i)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    c, w = np.array(cpu) * 1e3, np.array(wall) * 1e3
    return {
        "cpu_p50_ms": round(float(np.percentile(c, 50)), 4),
        "cpu_p99_ms": round(float(np.percentile(c, 99)), 4),
        "wall_p50_ms": round(float(np.percentile(w, 50)), 4),
        "wall_p99_ms": round(float(np.percentile(w, 99)), 4),
    }


def _lookups(index: Index, prompts: list[np.ndarray]) -> Callable[[int], object]:
    def lookup(i: int) -> object:
        return index.lookup(MODEL, prompts[i])

    return lookup


def _hashes(index: Index, ids: np.ndarray) -> Callable[[], object]:
    def hash_prompt() -> object:
        return index.hash_prompt(MODEL, BLOCK, ids)

    return hash_prompt


def bench_lookup(quick: bool) -> dict[str, object]:
    rng = random.Random(11)
    pool = token_pool(rng)
    n_docs = 3 if quick else 8
    docs = _documents(rng, n_docs, pool)
    queries = {"native": 200 if quick else 1000, "python": 30 if quick else 200}
    out: dict[str, object] = {"docs": n_docs}
    for workers in (16, 64):
        for backend in BACKENDS:
            index = load_fleet(backend, workers, docs, seed=workers)
            row: dict[str, object] = {}
            for tokens in (4_096, 32_768, 131_072):
                q = queries[backend] if tokens <= 32_768 else max(10, queries[backend] // 4)
                prompts = [docs[i % n_docs][:tokens] for i in range(q)]
                row[f"{tokens // 1024}k_tokens"] = _latencies(_lookups(index, prompts), q)
            hits = index.lookup(MODEL, docs[0][:32_768]).values()
            row["32k_mean_hit_tokens"] = round(sum(h.tokens for h in hits) / workers)
            out[f"{workers}_workers_{backend}"] = row
            del index
            gc.collect()
    return out


# --------------------------------------------------------------------------- hash


def _best_cpu_us(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return round(best * 1e6, 2)


def bench_hash(quick: bool) -> dict[str, object]:
    """``hash_prompt`` of a 32k-token prompt (numpy uint32, block 16), CPU µs."""
    ids = np.random.default_rng(3).integers(0, VOCAB, 32_768, dtype=np.uint32)
    reps = {"native": 300 if quick else 3000, "python": 30 if quick else 300}
    out: dict[str, object] = {}
    for backend in BACKENDS:
        index = make_index(backend)  # type: ignore[arg-type]
        out[f"{backend}_32k_us"] = _best_cpu_us(_hashes(index, ids), reps[backend])
    return out


# --------------------------------------------------------------------------- memory


def measure_memory(backend: str, entries: int, sharing: int = 1) -> dict[str, object]:
    """Run in a fresh process: RSS growth per (block, worker) entry after storing
    ``entries`` entries as 32-block chains on 64 workers (each block on ``sharing``)."""
    rng = random.Random(5)
    pool = token_pool(rng)
    workers = 64
    index = make_index(backend)  # type: ignore[arg-type]
    ids = [WorkerId(f"w{i}") for i in range(workers)]
    for worker_id in ids:
        index.register_worker(worker_id, MODEL, BLOCK)
    groups = [ids[i : i + sharing] for i in range(0, workers, sharing)]
    tails: dict[WorkerId, EngineBlockHash | None] = dict.fromkeys(ids)
    gc.collect()
    before = _rss_bytes()
    done, t0 = 0, time.perf_counter()
    while done < entries:
        for group in groups:
            tokens = tuple(t for _ in range(32) for t in pool[rng.randrange(len(pool))])
            for worker_id in group:
                hashes = tuple(EngineBlockHash(h) for h in array.array("Q", rng.randbytes(256)))
                stored = BlockStored(block_hashes=hashes, parent_block_hash=tails[worker_id],
                                     token_ids=tokens, block_size=BLOCK)  # fmt: skip
                tails[worker_id] = hashes[-1]
                index.apply(KvEventBatch(worker_id=worker_id, model=MODEL, seq=0, ts=0.0,
                                         events=(stored,)), 0.0)  # fmt: skip
                done += 32
    elapsed = time.perf_counter() - t0
    del stored, hashes, tokens
    gc.collect()
    return {
        "backend": backend,
        "entries": done,
        "bytes_per_entry": round((_rss_bytes() - before) / done, 1),
        "build_s": round(elapsed, 1),
    }


# --------------------------------------------------------------------------- callgrind

CALLGRIND_OPS = ("lookup", "hash", "ingest")
# Operations per measured process: a Python process's start varies by ~2 M instructions from
# run to run, so k is chosen to make the operations ~0.5–1 G instructions (noise < 0.5%).
CALLGRIND_K = {
    ("lookup", "native"): 1000, ("lookup", "python"): 60,
    ("hash", "native"): 2000, ("hash", "python"): 200,
    ("ingest", "native"): 2000, ("ingest", "python"): 1000,
}  # fmt: skip


def callgrind_op(op: str, backend: str, k: int) -> None:
    """The operation run under callgrind: a small setup, then ``k`` operations."""
    rng = random.Random(1)
    pool = token_pool(rng, 512)
    if op == "ingest":
        engines = [Engine(f"w{i}", rng, pool, 20_000) for i in range(16)]
        index = make_index(backend)  # type: ignore[arg-type]
        for e in engines:
            index.register_worker(e.worker_id, MODEL, BLOCK)
        warm = [e.batch() for _ in range(40) for e in engines]  # full: removals too
        timed = [engines[i % 16].batch() for i in range(CALLGRIND_K["ingest", backend])]
        for b in warm:
            index.apply(b, 1.0)
        for b in timed[:k]:
            index.apply(b, 1.0)
        print(json.dumps({"stored_blocks": stored_blocks(timed[:k])}))
        return
    docs = _documents(rng, 1, pool)
    if op == "hash":
        index = make_index(backend)  # type: ignore[arg-type]
        prompt = docs[0][:32_768]
        for _ in range(k):
            index.hash_prompt(MODEL, BLOCK, prompt)
        return
    index = load_fleet(backend, 64, [d[:32_768] for d in docs], seed=2)
    prompt = docs[0][:32_768]
    for _ in range(k):
        index.lookup(MODEL, prompt)


def _callgrind_instructions(op: str, backend: str, k: int) -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        code = (
            "from foretoken.bench.index_bench import callgrind_op; "
            f"callgrind_op({op!r}, {backend!r}, {k})"
        )
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
             sys.executable, "-c", code],
            capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )  # fmt: skip
        for line in out.read_text().splitlines():
            if line.startswith("totals:") or line.startswith("summary:"):
                return int(line.split()[1]), proc.stdout
    raise RuntimeError("no totals in the callgrind output")


def bench_callgrind() -> dict[str, object]:
    """Instructions per operation, native and reference: (Ir(k) − Ir(0)) / k."""
    if shutil.which("valgrind") is None:
        return {"skipped": "valgrind is not installed"}
    out: dict[str, object] = {}
    for op in CALLGRIND_OPS:
        row: dict[str, object] = {}
        for backend in BACKENDS:
            k = CALLGRIND_K[op, backend]
            base, _ = _callgrind_instructions(op, backend, 0)
            total, stdout = _callgrind_instructions(op, backend, k)
            per = (total - base) / k
            if op == "ingest":  # per stored block
                per = (total - base) / json.loads(stdout)["stored_blocks"]
            row[backend] = round(per)
        row["ratio"] = round(int(row["python"]) / max(int(row["native"]), 1), 1)  # type: ignore[call-overload]
        unit = {"lookup": "32k tokens, 64 workers", "hash": "32k tokens",
                "ingest": "stored block, 40-block events"}[op]  # fmt: skip
        out[f"{op}_instructions_per_op"] = {**row, "op": unit}
    return out


# --------------------------------------------------------------------------- driver


def machine() -> dict[str, object]:
    """What the numbers were measured on: the calibration loop is pure interpreter work (a
    recent desktop core runs it in ~8–10 µs), to compare runs on a loaded machine."""
    runs = []
    for _ in range(200):
        t0 = time.thread_time()
        sum(range(1000))
        runs.append(time.thread_time() - t0)
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "calibration_sum_range_1000_us": round(min(runs) * 1e6, 1),
    }


__all__ = ["bench_ingest", "measure_memory", "run"]


def _in_subprocess(call: str) -> dict[str, object]:
    code = f"import json; from foretoken.bench import index_bench as b; print(json.dumps(b.{call}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result: dict[str, object] = json.loads(proc.stdout.splitlines()[-1])
    return result


def summarize(result: dict[str, Any]) -> dict[str, object]:
    """The flat figures (native), the reference's beside them, their ratios."""
    ingest, lookup, memory = result["ingest"], result["lookup"], result["memory"]
    figures: dict[str, dict[str, float]] = {}
    for backend in BACKENDS:
        figures[backend] = {
            "ingest_stored_blocks_per_cpu_s": ingest[backend]["steady_stored_blocks_per_cpu_s"],
            "lookup_64w_32k_p99_ms": lookup[f"64_workers_{backend}"]["32k_tokens"]["cpu_p99_ms"],
            "hash_32k_us": result["hash"][f"{backend}_32k_us"],
            "bytes_per_entry": memory[backend]["bytes_per_entry"],
        }
    native, reference = figures["native"], figures["python"]
    summary: dict[str, object] = dict(native)
    summary["ingest_packed_stored_blocks_per_cpu_s"] = ingest["native"].get(
        "steady_packed_stored_blocks_per_cpu_s"
    )
    for name in ("int_ids", "decode_apply_json", "decode_apply_msgpack",
                 "decode_apply_int_ids_json", "decode_apply_int_ids_msgpack"):  # fmt: skip
        summary[f"ingest_{name}_stored_blocks_per_cpu_s"] = ingest["native"].get(
            f"steady_{name}_stored_blocks_per_cpu_s"
        )
    summary["lookup_64w_32k_p50_ms"] = lookup["64_workers_native"]["32k_tokens"]["cpu_p50_ms"]
    summary["lookup_64w_32k_wall_p99_ms"] = lookup["64_workers_native"]["32k_tokens"]["wall_p99_ms"]
    summary["entries"] = ingest["native"]["entries"]
    summary["reference"] = reference
    summary["ratio"] = {
        name: round(native[name] / reference[name] if higher else reference[name] / native[name], 2)
        for name, higher in FIGURES
    }
    summary["target"] = TARGETS
    summary["met"] = {
        name: bool(native[name] >= TARGETS[name] if higher else native[name] <= TARGETS[name])
        for name, higher in FIGURES
    }
    calls = result.get("callgrind")
    if isinstance(calls, dict) and "skipped" not in calls:
        summary["instructions"] = {
            op: {"native": row["native"], "reference": row["python"], "ratio": row["ratio"]}
            for op, row in calls.items()
        }
    return summary


def run(quick: bool, entries: int | None = None, callgrind: bool | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    entries = entries or (1_000_000 if quick else 10_000_000)
    result: dict[str, Any] = {"mode": "quick" if quick else "full", "machine": machine()}
    result["hash"] = bench_hash(quick)
    result["ingest"] = {b: _in_subprocess(f"bench_ingest({b!r}, {entries})") for b in BACKENDS}
    result["lookup"] = bench_lookup(quick)
    result["memory"] = {b: _in_subprocess(f"measure_memory({b!r}, {entries})") for b in BACKENDS}
    if callgrind if callgrind is not None else not quick:
        result["callgrind"] = bench_callgrind()
    result["machine_end"] = machine()
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    result["summary"] = summarize(result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="Benchmark the cache index (JSON on stdout).")
    parser.add_argument("--quick", action="store_true", help="1 M entries, fewer queries")
    parser.add_argument("--entries", type=int, help="entries for ingest and memory")
    parser.add_argument("--callgrind", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args()
    print(json.dumps(run(args.quick, args.entries, args.callgrind)))


if __name__ == "__main__":
    main()
