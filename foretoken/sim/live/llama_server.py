"""Real llama.cpp engines on loopback: ``foretoken llama run``.

Each engine is ``python -m llama_cpp.server`` (llama-cpp-python, built from PyPI by
``ops/llama_wheel.py``) serving the tiny generated GGUF of :mod:`foretoken.sim.live.gguf_model`. The
server holds one context: requests run one at a time, each prompt prefilled whole before its
tokens are generated (a serial engine, no chunking), and a prompt that shares a prefix with
the previous one reuses that part of the KV cache. It publishes no KV events and reports no
cached tokens. Started with ``--interrupt_requests false`` (by default a new request would
cut off the one that is streaming).

:func:`engine_config` writes what foretoken knows about such an engine: type ``llamacpp``,
no KV-event endpoint, and scheduler settings that make the queue replay model it through
its settings (one sequence at a time, whole-prompt prefill) — nothing llama-specific in the
predictor. Nothing of the engine's cost is in the engines file: the predictor learns it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from foretoken.adapters.engines.engines_file import EngineConfig, dump_engines
from foretoken.adapters.ports import free_port
from foretoken.adapters.processes import get_json, spawn, stop
from foretoken.settings import load_settings
from foretoken.sim.live.gguf_model import TinyLlamaSpec, ensure_model
from foretoken.wire.records import SchedulerSettings

DEFAULT_N_CTX = 17408  # a 16k-token prompt plus its output
DEFAULT_MODEL_NAME = "tiny-llama"
START_TIMEOUT_S = 120.0
ENGINE_VERSION_UNKNOWN = "unknown"
# The index's block granularity for these engines (llama.cpp reuses a prefix of any length).
BLOCK_SIZE = 16


class LlamaUnavailable(RuntimeError):
    """llama-cpp-python (with its server extra) is not installed in this environment."""


def llama_cpp_installed() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("llama_cpp", "uvicorn", "gguf"))


def llama_cpp_version() -> str:
    try:
        from importlib.metadata import version

        return version("llama_cpp_python")
    except Exception:  # not installed, or metadata missing
        return ENGINE_VERSION_UNKNOWN


@dataclass(frozen=True, slots=True)
class LlamaServerConfig:
    n_ctx: int = DEFAULT_N_CTX
    # One thread per engine: llama.cpp's OpenMP threads spin at barriers, and on a small
    # shared machine two of them make a prefill 3-8x slower and erratic (measured).
    n_threads: int | None = 1
    n_batch: int = 512
    host: str = "127.0.0.1"


def server_args(
    model: Path, port: int, cfg: LlamaServerConfig = LlamaServerConfig(),
    alias: str = DEFAULT_MODEL_NAME,
) -> list[str]:  # fmt: skip
    args = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(model),
        "--model_alias", alias, "--host", cfg.host, "--port", str(port),
        "--n_ctx", str(cfg.n_ctx),
        "--n_batch", str(cfg.n_batch), "--n_ubatch", str(cfg.n_batch),
        "--interrupt_requests", "false", "--logits_all", "false", "--verbose", "false",
    ]  # fmt: skip
    if cfg.n_threads is not None:
        args += ["--n_threads", str(cfg.n_threads), "--n_threads_batch", str(cfg.n_threads)]
    return args


def engine_config(
    worker_id: str, model_name: str, http_url: str, *, n_ctx: int = DEFAULT_N_CTX,
    tokenizer: str | None = None, version: str | None = None,
) -> EngineConfig:  # fmt: skip
    """What foretoken is told about one llama.cpp engine: a serial engine (max one sequence,
    the whole prompt in one step), no KV events, no cached-token reports."""
    return EngineConfig(
        worker_id=worker_id,
        model=model_name,
        engine="llamacpp",
        engine_version=version or llama_cpp_version(),
        block_size=BLOCK_SIZE,
        http_url=http_url,
        kv_events=False,
        reports_cached_tokens=False,
        request_id_header=False,  # its server refuses ids that are not UUIDs
        tokenizer=tokenizer,
        gpu_blocks=n_ctx // BLOCK_SIZE,  # its KV cache holds n_ctx tokens
        scheduler=SchedulerSettings(
            max_num_batched_tokens=n_ctx, max_num_seqs=1, chunked_prefill=False
        ),
    )


@dataclass
class RunningLlama:
    worker_id: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"llama.cpp server exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(OSError, ValueError):
            if get_json(f"{url}/v1/models").get("data"):
                return
        time.sleep(0.3)
    raise TimeoutError(f"llama.cpp server at {url} not ready within {timeout_s} s")


def start_servers(
    count: int, ports: list[int], run_dir: Path, *, spec: TinyLlamaSpec = TinyLlamaSpec(),
    cfg: LlamaServerConfig = LlamaServerConfig(), model_dir: Path | None = None,
    worker_prefix: str = "llama", model_name: str = DEFAULT_MODEL_NAME,
    timeout_s: float = START_TIMEOUT_S,
) -> tuple[list[RunningLlama], list[EngineConfig]]:  # fmt: skip
    """Write the model once, start ``count`` servers, wait until each serves; return them
    with their engines-file entries. Stops what it started if any fails to come up."""
    if not llama_cpp_installed():
        raise LlamaUnavailable(
            "llama-cpp-python is not installed: run `python ops/llama_wheel.py` "
            "(builds the wheel once into the cache, then installs it)"
        )
    if spec.context_length < cfg.n_ctx:
        raise ValueError(f"model context {spec.context_length} < n_ctx {cfg.n_ctx}")
    model_dir = model_dir or Path("~/.cache/foretoken/models").expanduser()
    gguf_path, tok_path = ensure_model(model_dir, spec)
    run_dir.mkdir(parents=True, exist_ok=True)
    running: list[RunningLlama] = []
    try:
        for i, port in enumerate(ports[:count]):
            log = run_dir / f"llama-{i}.log"
            proc = spawn(server_args(gguf_path, port, cfg, model_name), {}, log)
            running.append(RunningLlama(f"{worker_prefix}{i}", f"http://{cfg.host}:{port}",
                                        proc, log))  # fmt: skip
        for r in running:
            wait_ready(r.url, r.proc, r.log, timeout_s)
    except BaseException:
        for r in running:
            stop(r.proc)
        raise
    configs = [
        engine_config(r.worker_id, model_name, r.url, n_ctx=cfg.n_ctx, tokenizer=str(tok_path))
        for r in running
    ]
    return running, configs


def main(argv: list[str] | None = None) -> int:
    """``foretoken llama run``: start llama.cpp engines, write the engines file, wait."""
    parser = argparse.ArgumentParser(prog="foretoken llama run")
    parser.add_argument("--count", type=int, default=2)
    parser.add_argument("--base-port", type=int, default=0, help="0: free ports")
    parser.add_argument("--n-ctx", type=int, default=DEFAULT_N_CTX)
    parser.add_argument("--threads", type=int, default=1, help="threads per engine")
    state = load_settings().state_path
    parser.add_argument("--engines-out", default=str(state / "engines.toml"))
    parser.add_argument("--run-dir", default=str(state / "llama"))
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count must be >= 1")
    ports = [args.base_port + i if args.base_port else free_port() for i in range(args.count)]
    cfg = LlamaServerConfig(n_ctx=args.n_ctx, n_threads=args.threads)
    spec = TinyLlamaSpec(context_length=max(TinyLlamaSpec().context_length, args.n_ctx))
    try:
        running, configs = start_servers(args.count, ports, Path(args.run_dir), spec=spec,
                                         cfg=cfg)  # fmt: skip
    except (LlamaUnavailable, RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.engines_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(dump_engines(configs))
    tmp.replace(out)
    print(f"{len(running)} llama.cpp engines up; engines file {out}", flush=True)
    stopping = {"now": False}

    def _stop(_sig: int, _frame: object) -> None:
        stopping["now"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while not stopping["now"] and all(r.proc.poll() is None for r in running):
            time.sleep(0.5)
    finally:
        for r in running:
            stop(r.proc)
    return 0 if stopping["now"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
