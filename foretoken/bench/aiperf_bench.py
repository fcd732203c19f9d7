"""A real benchmark tool through the router, offline: ``foretoken bench aiperf``.

NVIDIA's ``aiperf`` (from PyPI, in a venv of its own — ``make aiperf``: its pins, e.g. a newer
click, clash with faust's) drives streaming ``/v1/completions`` through the router at a fixed
rate, with ``--tokenizer`` the directory ``hf_tokenizer.py`` writes (it counts tokens as the
built-in tokenizer does: no hub, no network). The stack is the router bench's
(``router_stack.py``: route service, ingest, router) on the engine stub, or on a simulated
fleet (``--fleet small``). The report puts aiperf's own TTFT next to the router's own (its
``first_token`` outcomes on Kafka: handler entry → first content token from the engine), and
aiperf's input lengths next to the prompt tokens the router counted (its grants).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foretoken.bench.hf_tokenizer import write_dir
from foretoken.bench.router_stack import start_stack
from foretoken.bench.router_stats import KafkaView, _ms, pct, read_records
from foretoken.settings import Settings

AIPERF_ENV = "FORETOKEN_AIPERF"
AIPERF_VENV = Path(__file__).resolve().parents[2] / ".venv-aiperf"  # `make aiperf`
EXPORT = "profile_export_aiperf.json"
QUANTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class Load:
    """What aiperf sends: ``count`` requests at ``rate_rps``, prompts and outputs in tokens."""

    rate_rps: float = 20.0
    count: int = 200
    prompt_tokens: int = 300
    output_tokens: int = 4
    timeout_s: float = 300.0


# `make test` installs aiperf in the background under this lock (Makefile: aiperf-background).
INSTALL_LOCK = AIPERF_VENV.parent / ".run" / "aiperf-install.lock"


def wait_for_install(timeout_s: float = 1800.0, poll_s: float = 2.0) -> None:
    """Wait while a background install holds :data:`INSTALL_LOCK` (no lock file: return)."""
    if not INSTALL_LOCK.exists():
        return
    deadline = time.monotonic() + timeout_s
    with INSTALL_LOCK.open("a") as fh:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                if time.monotonic() > deadline:
                    msg = f"aiperf's install held {INSTALL_LOCK} > {timeout_s} s"
                    raise TimeoutError(msg) from exc
                time.sleep(poll_s)
                continue
            fcntl.flock(fh, fcntl.LOCK_UN)
            return


def aiperf_binary() -> str:
    """``$FORETOKEN_AIPERF``, else the project's ``.venv-aiperf``, else ``aiperf`` on PATH
    (after any background install of it has finished)."""
    wait_for_install()
    for candidate in (os.environ.get(AIPERF_ENV), str(AIPERF_VENV / "bin" / "aiperf"),
                      shutil.which("aiperf")):  # fmt: skip
        if candidate and Path(candidate).is_file():
            return candidate
    raise FileNotFoundError(f"aiperf not found: run `make aiperf` (or set {AIPERF_ENV})")


def run_aiperf(url: str, model: str, load: Load, out_dir: Path) -> dict[str, Any]:
    """One aiperf profile run against ``url``; its JSON export. Raises when aiperf fails."""
    tokenizer = write_dir(out_dir / "tokenizer")
    cmd = [
        aiperf_binary(), "profile", "--model", model, "--url", url,
        "--endpoint-type", "completions", "--streaming", "--use-legacy-max-tokens",
        "--tokenizer", str(tokenizer.resolve()), "--request-rate", f"{load.rate_rps:g}",
        "--request-count", str(load.count),
        "--prompt-input-tokens-mean", str(load.prompt_tokens),
        "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(load.output_tokens),
        "--prompt-output-tokens-stddev", "0",
        "--random-seed", "1", "--output-artifact-dir", str(out_dir / "aiperf"),
        "--no-server-metrics", "--no-gpu-telemetry", "--ui-type", "none",
        "--request-timeout-seconds", "60",
    ]  # fmt: skip
    # No hub look-ups: the tokenizer is a local directory, and there is no network here.
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}
    log = out_dir / "aiperf.log"
    with log.open("wb") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                              timeout=load.timeout_s, check=False)  # fmt: skip
    export = out_dir / "aiperf" / EXPORT
    if done.returncode != 0 or not export.exists():
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"aiperf exited {done.returncode}:\n{tail}")
    doc: dict[str, Any] = json.loads(export.read_text())
    return doc


async def router_records(settings: Settings, grants: int) -> KafkaView:
    """Every grant and outcome on this run's topics, until ``grants`` grants and as many
    completions have come, or a timeout."""

    def complete(view: KafkaView) -> bool:
        return len(view.grants) >= grants and sum(view.done.values()) >= grants

    return await read_records(settings, "aiperf-bench", complete, settle_s=0.0)


def _aiperf_ms(doc: dict[str, Any], metric: str) -> dict[str, Any]:
    m = doc.get(metric) or {}
    out = {f"p{q}": None if m.get(f"p{q}") is None else round(m[f"p{q}"], 3) for q in QUANTILES}
    return out | {"count": m.get("count")}


def compare(doc: dict[str, Any], view: KafkaView) -> dict[str, Any]:
    """aiperf's figures next to the router's own."""
    ttft = list(view.router_ttft_s.values())
    prompts = list(view.prompt_tokens.values())
    aiperf_ttft, router_ttft = _aiperf_ms(doc, "time_to_first_token"), {
        f"p{q}": _ms(pct(ttft, q)) for q in QUANTILES
    } | {"count": len(ttft)}  # fmt: skip
    isl = doc.get("input_sequence_length") or {}
    return {
        "aiperf_ttft_ms": aiperf_ttft,
        "router_ttft_ms": router_ttft,
        # What the client sees beyond the router's own clock (the HTTP hop, parsing, relaying).
        "client_minus_router_ttft_ms": {
            k: None
            if aiperf_ttft[k] is None or router_ttft[k] is None
            else round(aiperf_ttft[k] - router_ttft[k], 3)
            for k in router_ttft
            if k != "count"
        },
        "aiperf_requests": (doc.get("request_count") or {}).get("avg"),
        "aiperf_errors": doc.get("error_summary") or [],
        "aiperf_output_tokens_p50": (doc.get("output_sequence_length") or {}).get("p50"),
        "aiperf_input_tokens_p50": isl.get("p50"),
        "router_prompt_tokens_p50": pct(prompts, 50),
        "router_grants": len(view.grants),
        "router_completions": sum(view.done.values()),
    }


def run(quick: bool, fleet: str | None = None, load: Load | None = None) -> dict[str, Any]:
    load = load or (Load(count=60) if quick else Load())
    tmp = Path(tempfile.mkdtemp(prefix="aiperf-bench-"))
    load_start = [round(x, 2) for x in os.getloadavg()]
    stack = start_stack(tmp, route_timeout_s=0.25, fleet=fleet)
    try:
        doc = run_aiperf(stack.router_url, stack.engines[0].model, load, tmp)
        view = asyncio.run(router_records(stack.settings, load.count))
    except BaseException:
        print(stack.log_tails(), file=sys.stderr)
        raise
    finally:
        stack.close()
    result = compare(doc, view)
    shutil.rmtree(tmp, ignore_errors=True)
    summary = {
        "aiperf_ttft_p50_ms": result["aiperf_ttft_ms"]["p50"],
        "aiperf_ttft_p99_ms": result["aiperf_ttft_ms"]["p99"],
        "router_ttft_p50_ms": result["router_ttft_ms"]["p50"],
        "router_ttft_p99_ms": result["router_ttft_ms"]["p99"],
        "requests": result["aiperf_requests"], "errors": len(result["aiperf_errors"]),
        "loadavg_start_1m": load_start[0],
    }  # fmt: skip
    return {"summary": summary, "engines": fleet or "stub (engine_stub.py)",
            "load": {"rate_rps": load.rate_rps, "count": load.count,
                     "prompt_tokens": load.prompt_tokens, "output_tokens": load.output_tokens},
            "loadavg_start": load_start, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            **result}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 requests instead of 200")
    parser.add_argument("--fleet", default=None, help="a simulated fleet, not the stub")
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--count", type=int, default=0)
    args = parser.parse_args()
    count = args.count or (60 if args.quick else 200)
    out = run(args.quick, args.fleet, Load(rate_rps=args.rate, count=count))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
