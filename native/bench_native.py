"""Micro-benchmark of the native hot path (``foretoken_native``), printing one JSON object.

``python native/bench_native.py [--quick]`` (after ``maturin develop --release`` or
``pip install ./native`` into the interpreter that runs it). Each section runs in a fresh
subprocess, one after the other (never in parallel):

* ``hash``: the own content hash of a 32k-token prompt (block size 16) from packed bytes,
  out as bytes (``chain_bytes``) and as a numpy array (``chain``), and from a numpy uint32
  array; CPU µs per call (median of repeated loops, ``time.process_time``).
* ``ingest``: 16 workers, engine batches of 1–3 BlockStored of 16–64 blocks (40 on
  average) of 16 tokens, chains continued 70% of the time, and once an engine is full a
  BlockRemoved evicting its oldest blocks (FIFO). Phase ``fill`` grows the index to
  ``entries`` (10 M; 1 M with ``--quick``); phase ``steady`` then measures stores +
  removals at that size. Stored blocks per CPU-second of ``apply_batch`` alone (events
  built beforehand, as the ingest service would hand them over). The steady phase also
  runs with token ids as tuples of ints and hashes as lists (the conversion's cost) and
  through ``apply`` with msgspec structs. RSS per entry at the end (including the
  recently removed blocks of the cross-tier rule).
* ``lookup``: 64 workers, 8 documents of 128k tokens, each worker holding a random prefix
  of each (mostly GPU, its tail in CPU); p50/p99 of ``lookup`` for 32k-token prompts
  from packed bytes (CPU of this thread and wall), also 4k and 128k, and from own hashes.
* ``memory``: bytes per (block, worker) entry at ``entries`` (RSS delta of a fresh process
  that stores 32-block chains on 64 workers), each block on 1 worker and on 4; with 1, the
  time and size of ``snapshot()`` and the time of ``restore()``.
"""

from __future__ import annotations

import argparse
import array
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections import deque

import numpy as np

MODEL = "bench-model"
BLOCK = 16
VOCAB = 150_000


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pool(rng: random.Random, size: int = 4096) -> list[bytes]:
    """Blocks of 16 random token ids, packed."""
    return [array.array("I", [rng.randrange(VOCAB) for _ in range(BLOCK)]).tobytes()
            for _ in range(size)]  # fmt: skip


# --------------------------------------------------------------------------- hash


def bench_hash(quick: bool) -> dict[str, object]:
    import foretoken_native as fn

    rng = np.random.default_rng(3)
    ids = rng.integers(0, VOCAB, 32_768, dtype=np.uint32)
    packed = ids.tobytes()
    seed = fn.root_seed(b"", MODEL, BLOCK, None)
    loops = 200 if quick else 2000

    def per_call_us(f) -> float:
        runs = []
        for _ in range(7):
            t0 = time.process_time()
            for _ in range(loops):
                f()
            runs.append((time.process_time() - t0) / loops * 1e6)
        return round(statistics.median(runs), 2)

    ids_list = ids.tolist()
    return {
        "hash_32k_us": per_call_us(lambda: fn.chain_bytes(seed, packed, BLOCK)),
        "hash_32k_numpy_out_us": per_call_us(lambda: fn.chain(seed, packed, BLOCK)),
        "hash_32k_from_numpy_uint32_us": per_call_us(lambda: fn.chain_bytes(seed, ids, BLOCK)),
        "hash_32k_from_list_us": per_call_us(lambda: fn.chain_bytes(seed, ids_list, BLOCK)),
    }


# --------------------------------------------------------------------------- ingest


class Engine:
    """One worker's batches: chains of stored blocks, FIFO eviction when full."""

    def __init__(self, worker_id: str, rng: random.Random, pool: list[bytes], capacity: int):
        self.worker_id = worker_id
        self.rng = rng
        self.pool = pool
        self.capacity = capacity
        self.resident: deque[bytes] = deque()  # packed u64 hashes, oldest first
        self.held = 0
        self.tails: list[int] = []
        self.seq = 0

    def _stored(self) -> tuple:
        rng = self.rng
        n = rng.randint(16, 64)
        parent = (
            self.tails.pop(rng.randrange(len(self.tails)))
            if self.tails and rng.random() < 0.7
            else None
        )
        pool = self.pool
        tokens = b"".join([pool[rng.randrange(4096)] for _ in range(n)])
        hashes = rng.randbytes(8 * n)
        self.resident.append(hashes)
        self.held += n
        self.tails.append(int.from_bytes(hashes[-8:], "little"))
        del self.tails[:-8]
        return ("stored", hashes, parent, tokens, BLOCK)

    def batch(self) -> list[tuple]:
        events = [self._stored() for _ in range(self.rng.randint(1, 3))]
        excess = self.held - self.capacity
        if excess > 0:
            gone = []
            while excess > 0:
                chunk = self.resident.popleft()
                take = min(excess, len(chunk) // 8)
                gone.append(chunk[: take * 8])
                if take * 8 < len(chunk):
                    self.resident.appendleft(chunk[take * 8 :])
                excess -= take
                self.held -= take
            events.append(("removed", b"".join(gone)))
        self.seq += 1
        return events


def _stored_in(batches: list[tuple[str, int, list[tuple]]]) -> int:
    return sum(len(e[1]) // 8 for _, _, evs in batches for e in evs if e[0] == "stored")


def _as_ints(events: list[tuple]) -> list[tuple]:
    """The same events with token ids as tuples of ints and hashes as lists of ints."""
    out = []
    for e in events:
        hashes = array.array("Q", e[1]).tolist()
        if e[0] == "stored":
            out.append(("stored", hashes, e[2], tuple(array.array("I", e[3])), e[4]))
        else:
            out.append(("removed", hashes))
    return out


def bench_ingest(entries: int) -> dict[str, object]:
    import foretoken_native as fn
    import msgspec

    class BlockStored(msgspec.Struct, kw_only=True, frozen=True, tag="stored"):
        block_hashes: tuple[int, ...]
        parent_block_hash: int | None = None
        token_ids: tuple[int, ...] = ()
        block_size: int
        lora_name: str | None = None
        medium: str = "GPU"
        group_idx: int = 0
        full_attention: bool = True
        extra_keys: tuple[str, ...] = ()

    class BlockRemoved(msgspec.Struct, kw_only=True, frozen=True, tag="removed"):
        block_hashes: tuple[int, ...]
        medium: str = "GPU"
        group_idx: int = 0

    class KvEventBatch(msgspec.Struct, kw_only=True, frozen=True):
        worker_id: str
        model: str
        seq: int
        ts: float
        dp_rank: int = 0
        events: tuple[object, ...]

    rng = random.Random(7)
    pool = _pool(rng)
    workers = 16
    capacity = entries // workers
    engines = [Engine(f"w{i}", rng, pool, capacity) for i in range(workers)]
    index = fn.NativeIndex()
    for e in engines:
        index.register_worker(e.worker_id, MODEL, BLOCK)
    gc.collect()
    rss0 = _rss_bytes()

    def make(n_batches: int) -> list[tuple[str, int, list[tuple]]]:
        return [
            (e.worker_id, e.seq, e.batch()) for _ in range(n_batches // workers) for e in engines
        ]

    def apply_all(batches, via=None) -> float:
        t0 = time.process_time()
        if via is None:
            for wid, seq, events in batches:
                index.apply_batch(wid, MODEL, seq, 0, events, 1.0)
        else:
            via(batches)
        return time.process_time() - t0

    # fill: grow to `entries` (stores only until the engines are full)
    fill_cpu, fill_blocks, t_fill = 0.0, 0, time.perf_counter()
    while sum(e.held for e in engines) < entries:
        batches = make(1600)
        fill_blocks += _stored_in(batches)
        fill_cpu += apply_all(batches)
    fill_wall = time.perf_counter() - t_fill
    # steady: stores + removals at full size; two untimed segments first (the recently
    # removed caches are allocated and paged in then), then timed segments (median rate)
    for _ in range(2):
        apply_all(make(3200))
    seg_rates, steady_blocks, removed = [], 0, 0
    for _ in range(5):
        batches = make(3200)
        n = _stored_in(batches)
        removed += sum(len(e[1]) // 8 for _, _, evs in batches for e in evs if e[0] == "removed")
        steady_blocks += n
        seg_rates.append(n / apply_all(batches))
    counters = index.totals
    # the same steady batches with ints instead of packed bytes, and as msgspec structs
    batches = make(1600)
    as_ints = [(w, s, _as_ints(evs)) for w, s, evs in batches]
    ints_rate = _stored_in(batches) / apply_all(as_ints)
    batches = make(1600)
    structs = []
    for wid, seq, evs in batches:
        out = []
        for e in evs:
            hashes = tuple(array.array("Q", e[1]).tolist())
            if e[0] == "stored":
                out.append(
                    BlockStored(
                        block_hashes=hashes,
                        parent_block_hash=e[2],
                        token_ids=tuple(array.array("I", e[3])),
                        block_size=BLOCK,
                    )
                )
            else:
                out.append(BlockRemoved(block_hashes=hashes))
        structs.append(KvEventBatch(worker_id=wid, model=MODEL, seq=seq, ts=0.0, events=tuple(out)))

    def via_structs(_: object) -> None:
        for b in structs:  # noqa: F821 (called before the del below)
            index.apply(b, 1.0)

    structs_rate = _stored_in(batches) / apply_all(None, via_structs)
    del batches, as_ints, structs
    gc.collect()
    stats = index.stats()
    held = sum(sum(w["blocks"].values()) for w in stats["workers"].values())
    native = index.native_stats()
    recent = sum(native["recently_removed"].values())
    recent_slots = sum(native["recent_capacity"].values())
    peak = sum(native["peak_engine_hashes"].values())
    heap = native["heap_bytes_estimate"]
    return {
        "workers": workers,
        "entries_target": entries,
        "entries_held": held,
        "recently_removed_held": recent,
        "recently_removed_slots": recent_slots,
        "peak_engine_hashes": peak,
        "blocks_per_stored_event": 40,
        "fill_stored_blocks": fill_blocks,
        "fill_stored_blocks_per_cpu_s": round(fill_blocks / fill_cpu),
        "fill_wall_s_including_event_generation": round(fill_wall, 1),
        "steady_stored_blocks": steady_blocks,
        "steady_removed_blocks": removed,
        "steady_stored_blocks_per_cpu_s": round(statistics.median(seg_rates)),
        "steady_segment_rates": [round(r) for r in seg_rates],
        "steady_ints_stored_blocks_per_cpu_s": round(ints_rate),
        "steady_msgspec_apply_stored_blocks_per_cpu_s": round(structs_rate),
        "heap_bytes_per_held_entry_estimate": {k: round(v / held, 1) for k, v in heap.items()},
        "heap_bytes_per_held_entry_estimate_total": round(sum(heap.values()) / held, 1),
        "rss_growth_per_held_entry_incl_harness": round((_rss_bytes() - rss0) / held, 1),
        "counters": {k: v for k, v in counters.items() if v},
    }


# --------------------------------------------------------------------------- lookup


def bench_lookup(quick: bool) -> dict[str, object]:
    import foretoken_native as fn

    rng = random.Random(11)
    pool = _pool(rng)
    n_docs = 3 if quick else 8
    docs = [b"".join(pool[rng.randrange(4096)] for _ in range(131_072 // BLOCK))
            for _ in range(n_docs)]  # fmt: skip
    workers = 64
    index = fn.NativeIndex()
    for w in range(workers):
        wid = f"w{w}"
        index.register_worker(wid, MODEL, BLOCK)
        for doc in docs:
            total = len(doc) // (4 * BLOCK)
            held = int(total * rng.random() ** 0.5)
            gpu = int(held * rng.uniform(0.5, 1.0))
            events, parent = [], None
            for lo in range(0, held, 64):
                hi = min(held, lo + 64)
                hashes = rng.randbytes(8 * (hi - lo))
                medium = "GPU" if hi <= gpu else "CPU"
                if lo < gpu < hi:  # split the event at the GPU/CPU boundary
                    cut = (gpu - lo) * 8
                    events.append(("stored", hashes[:cut], parent,
                                   doc[lo * 64 : gpu * 64], BLOCK, None, "GPU"))  # fmt: skip
                    parent = int.from_bytes(hashes[cut - 8 : cut], "little")
                    events.append(("stored", hashes[cut:], parent,
                                   doc[gpu * 64 : hi * 64], BLOCK, None, "CPU"))  # fmt: skip
                else:
                    events.append(("stored", hashes, parent, doc[lo * 64 : hi * 64], BLOCK,
                                   None, medium))  # fmt: skip
                parent = int.from_bytes(hashes[-8:], "little")
            index.apply_batch(wid, MODEL, 0, 0, events, 0.0)
    queries = 100 if quick else 1000
    out: dict[str, object] = {"workers": workers, "docs": n_docs}
    entries = sum(sum(w["blocks"].values()) for w in index.stats()["workers"].values())
    out["entries"] = entries
    for tokens in (4_096, 32_768, 131_072):
        prompts = [docs[i % n_docs][: tokens * 4] for i in range(queries)]
        own = [{BLOCK: index.hash_prompt(MODEL, BLOCK, p)} for p in prompts]
        row = {
            "from_packed_tokens": _latencies(
                lambda i, ps=prompts: index.lookup(MODEL, ps[i]), queries
            ),
            "from_own_hashes": _latencies(
                lambda i, hs=own: index.lookup(MODEL, own_hashes=hs[i]), queries
            ),
        }
        hits = index.lookup(MODEL, prompts[0])
        row["workers_with_a_hit"] = sum(1 for h in hits.values() if h[1])
        row["mean_hit_tokens"] = round(sum(h[1] for h in hits.values()) / len(hits))
        out[f"{tokens // 1024}k_tokens"] = row
    return out


def _latencies(fn, queries: int) -> dict[str, float]:
    for i in range(min(20, queries)):
        fn(i)  # warm
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


# --------------------------------------------------------------------------- memory


def measure_memory(entries: int, sharing: int) -> dict[str, object]:
    import foretoken_native as fn

    rng = random.Random(5)
    pool = _pool(rng)
    workers = 64
    index = fn.NativeIndex()
    ids = [f"w{i}" for i in range(workers)]
    for wid in ids:
        index.register_worker(wid, MODEL, BLOCK)
    groups = [ids[i : i + sharing] for i in range(0, workers, sharing)]
    tails: dict[str, int | None] = dict.fromkeys(ids)
    gc.collect()
    before = _rss_bytes()
    done, t0 = 0, time.perf_counter()
    while done < entries:
        for group in groups:
            tokens = b"".join([pool[rng.randrange(4096)] for _ in range(32)])
            for wid in group:
                hashes = rng.randbytes(8 * 32)
                index.apply_batch(
                    wid, MODEL, 0, 0, [("stored", hashes, tails[wid], tokens, BLOCK)], 0.0
                )
                tails[wid] = int.from_bytes(hashes[-8:], "little")
                done += 32
    elapsed = time.perf_counter() - t0
    gc.collect()
    after = _rss_bytes()
    out: dict[str, object] = {
        "entries": done,
        "bytes_per_entry": round((after - before) / done, 1),
        "build_s": round(elapsed, 1),
    }
    if sharing == 1:  # snapshot cost at this size
        t = time.perf_counter()
        data = index.snapshot()
        out["snapshot_s"] = round(time.perf_counter() - t, 2)
        out["snapshot_bytes_per_entry"] = round(len(data) / done, 1)
        t = time.perf_counter()
        fn.NativeIndex.restore(data)
        out["restore_s"] = round(time.perf_counter() - t, 2)
    return out


def bench_memory(entries: int) -> dict[str, object]:
    return {
        f"each_block_on_{sharing}_workers": _in_subprocess(
            "memory", entries=entries, sharing=sharing
        )
        for sharing in (1, 4)
    }


# --------------------------------------------------------------------------- driver


def _in_subprocess(section: str, **kw: object) -> dict[str, object]:
    args = [sys.executable, __file__, "--section", section]
    for k, v in kw.items():
        args += [f"--{k}", str(v)]
    proc = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def calibration_us() -> float:
    """A fixed interpreter loop (CPU µs, median of 9): compare runs on a loaded machine."""
    runs = []
    for _ in range(9):
        t0 = time.process_time()
        total = 0
        for i in range(100_000):
            total += i
        runs.append((time.process_time() - t0) * 1e6)
    return round(statistics.median(runs), 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--section", choices=["hash", "ingest", "lookup", "memory"])
    parser.add_argument("--entries", type=int)
    parser.add_argument("--sharing", type=int, default=1)
    args = parser.parse_args()
    entries = args.entries or (1_000_000 if args.quick else 10_000_000)
    if args.section == "hash":
        print(json.dumps(bench_hash(args.quick)))
        return
    if args.section == "ingest":
        print(json.dumps(bench_ingest(entries)))
        return
    if args.section == "lookup":
        print(json.dumps(bench_lookup(args.quick)))
        return
    if args.section == "memory":
        print(json.dumps(measure_memory(entries, args.sharing)))
        return
    t0 = time.perf_counter()
    quick = ["--quick"] if args.quick else []
    result: dict[str, object] = {
        "bench": "native",
        "quick": args.quick,
        "python": platform.python_version(),
        "load_average_start": os.getloadavg(),
        "calibration_loop_us_start": calibration_us(),
        "hash": _in_subprocess_flags("hash", quick),
        "ingest": _in_subprocess("ingest", entries=entries),
        "ingest_1m": _in_subprocess("ingest", entries=1_000_000) if not args.quick else None,
        "lookup": _in_subprocess_flags("lookup", quick),
        "memory": bench_memory(entries),
    }
    result["load_average_end"] = os.getloadavg()
    result["calibration_loop_us_end"] = calibration_us()
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    lookup32 = result["lookup"]["32k_tokens"]["from_packed_tokens"]  # type: ignore[index]
    result["summary"] = {
        "hash_32k_us": result["hash"]["hash_32k_us"],  # type: ignore[index]
        "ingest_steady_stored_blocks_per_cpu_s": result["ingest"]["steady_stored_blocks_per_cpu_s"],  # type: ignore[index]
        "ingest_fill_stored_blocks_per_cpu_s": result["ingest"]["fill_stored_blocks_per_cpu_s"],  # type: ignore[index]
        "ingest_entries": entries,
        "lookup_32k_64w_cpu_p50_ms": lookup32["cpu_p50_ms"],
        "lookup_32k_64w_cpu_p99_ms": lookup32["cpu_p99_ms"],
        "lookup_32k_64w_wall_p99_ms": lookup32["wall_p99_ms"],
        "bytes_per_entry_1_worker": result["memory"]["each_block_on_1_workers"]["bytes_per_entry"],  # type: ignore[index]
        "bytes_per_entry_4_workers": result["memory"]["each_block_on_4_workers"]["bytes_per_entry"],  # type: ignore[index]
    }
    print(json.dumps(result))


def _in_subprocess_flags(section: str, flags: list[str]) -> dict[str, object]:
    args = [sys.executable, __file__, "--section", section, *flags]
    proc = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


if __name__ == "__main__":
    main()
