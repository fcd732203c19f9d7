"""The ``foretoken`` command. Each subcommand is a thin shell over a module that does the work."""

from __future__ import annotations

import asyncio
import sys

import typer
from rich.console import Console

from foretoken.cli_args import existing_dir, fail, lake_call, port, positive, usable_output
from foretoken.cli_args import floats as _floats
from foretoken.cli_args import port as check_port
from foretoken.cli_args import settings_or_exit as _settings
from foretoken.settings import SettingsError

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
kafka_app = typer.Typer(no_args_is_help=True, help="The local Kafka broker (KRaft, from Maven).")
topics_app = typer.Typer(no_args_is_help=True, help="The foretoken topics.")
app.add_typer(kafka_app, name="kafka")
app.add_typer(topics_app, name="topics")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (JSON on stdout).")
app.add_typer(bench_app, name="bench")
fleet_app = typer.Typer(no_args_is_help=True, help="The fleet simulator.")
app.add_typer(fleet_app, name="fleet")
llama_app = typer.Typer(no_args_is_help=True, help="Real llama.cpp engines (llama-cpp-python).")
app.add_typer(llama_app, name="llama")
config_app = typer.Typer(no_args_is_help=True, help="The settings (defaults, file, environment).")
app.add_typer(config_app, name="config")

console = Console(stderr=True)
ConfigOpt = typer.Option(None, "--config", "-c", help="Settings TOML (else $FORETOKEN_CONFIG).")


@config_app.command("show")
def config_show(
    config: str | None = ConfigOpt,
    as_json: bool = typer.Option(False, "--json", help="JSON instead of a table."),
) -> None:
    """Every effective setting, with where its value came from (default, file, env)."""
    import json

    from foretoken.settings import describe_settings, load_settings_with_sources

    try:
        settings, sources = load_settings_with_sources(config)
    except SettingsError as exc:
        raise fail(str(exc)) from exc
    rows = describe_settings(settings, sources)
    if as_json:
        print(json.dumps([{"key": k, "value": v, "source": src} for k, v, src in rows], indent=1))
        return
    width = max(len(k) for k, _, _ in rows)
    for key, value, source in rows:
        print(f"{key:<{width}}  {json.dumps(value):<28}  {source}")


@kafka_app.command("up")
def kafka_up(config: str | None = ConfigOpt) -> None:
    """Start the local broker (fetching its jars once); harmless when one is running."""
    from foretoken.ops.kafka_local import KafkaError, up

    try:
        st, started = up(_settings(config))
    except KafkaError as exc:
        raise fail(str(exc), 1) from exc
    # stdout carries one machine-readable word for scripts (the Makefile): started|running|external
    print("started" if started else ("external" if st.external else "running"))
    console.print(st.describe())


@kafka_app.command("down")
def kafka_down(config: str | None = ConfigOpt) -> None:
    """Stop the local broker cleanly."""
    from foretoken.ops.kafka_local import down

    stopped = down(_settings(config))
    console.print("stopped the local broker" if stopped else "no local broker was running")


@kafka_app.command("status")
def kafka_status(config: str | None = ConfigOpt) -> None:
    """Say whether a broker answers, and whether foretoken started it."""
    from foretoken.ops.kafka_local import status

    st = status(_settings(config))
    print(st.describe())
    raise typer.Exit(0 if st.reachable else 1)


@topics_app.command("create")
def topics_create(config: str | None = ConfigOpt) -> None:
    """Create every topic of PRODUCT.md §2 that does not exist yet."""
    from foretoken.adapters.kafka.topics import ensure_topics, topic_specs

    settings = _settings(config)
    created = asyncio.run(ensure_topics(settings))
    for spec in topic_specs(settings):
        mark = "created" if spec.name in created else "exists"
        policy = "compact" if spec.compacted else "delete"
        print(f"{spec.name:<24} partitions={spec.partitions} cleanup={policy} {mark}")


@app.command()
def worker(
    config: str | None = ConfigOpt,
    role: str | None = typer.Option(
        None,
        help="primary (default: grading, lake, snapshots) or route (a read replica "
        "answering /v1/route); else worker.role / FORETOKEN_ROLE.",
    ),
) -> None:
    """Run the Faust worker (agents over every input topic, /healthz, /metrics)."""
    import msgspec

    from foretoken.adapters.kafka.app import run_worker

    settings = _settings(config)
    if role is not None:
        if role not in ("primary", "route"):
            raise fail(f"--role must be primary or route, not {role!r}")
        worker_settings = msgspec.structs.replace(settings.worker, role=role)
        settings = msgspec.structs.replace(settings, worker=worker_settings)
    sys.argv = [sys.argv[0]]  # Faust's worker reads argv; ours is already parsed
    run_worker(settings)


@app.command()
def ingest(
    engines: str = typer.Option(..., "--engines", "-e", help="Engines config file (TOML)."),
    host: str | None = typer.Option(None, help="Address of /healthz and /metrics (settings)."),
    port: int | None = typer.Option(None, help="Port of /healthz and /metrics; 0: none."),
    config: str | None = ConfigOpt,
) -> None:
    """Engines' ZMQ KV events → normalized batches on kv-events; engines → workers."""
    import msgspec

    from foretoken.adapters.engines.engines_file import EnginesConfigError, load_engines
    from foretoken.adapters.engines.ingest import run_ingest

    settings = _settings(config)
    page = {"host": host or settings.ingest.host}
    if port is not None:
        page["port"] = port  # type: ignore[assignment]
    settings = msgspec.structs.replace(
        settings, ingest=msgspec.structs.replace(settings.ingest, **page)
    )
    try:
        listed = load_engines(engines)
    except EnginesConfigError as exc:
        raise fail(str(exc)) from exc
    run_ingest(settings, listed)


@fleet_app.command("run")
def fleet_run(
    fleet: str = typer.Argument(..., help="Fleet file, or a shipped fleet: small, hetero, demo."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    base_port: int = typer.Option(8100, help="HTTP port of the first engine (0: free ports)."),
    kv_base_port: int = typer.Option(5557, help="First KV-event PUB port (0: free ports)."),
    time_scale: float = typer.Option(1.0, help="Wall seconds per simulated second."),
    engines_out: str | None = typer.Option(
        None, help="Write the engines file here (default: <state_dir>/engines.toml)."
    ),
    register: bool = typer.Option(True, help="Register the engines on the workers topic."),
    advertise_host: str | None = typer.Option(None, help="Host name others reach us by."),
    config: str | None = ConfigOpt,
) -> None:
    """Run every engine of a fleet file: OpenAI HTTP, vLLM-format KV events over ZMQ."""
    import logging
    from pathlib import Path

    from foretoken.sim.live.server import run_fleet
    from foretoken.sim.spec import FleetSpecError, load_fleet

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    try:
        spec = load_fleet(fleet)
    except FleetSpecError as exc:
        raise fail(str(exc)) from exc
    positive(("--time-scale", time_scale))
    settings = _settings(config)
    out = Path(engines_out) if engines_out else settings.state_path / "engines.toml"
    try:
        asyncio.run(run_fleet(spec, host=host, base_port=base_port, kv_base_port=kv_base_port,
                              time_scale=time_scale, engines_out=out,
                              settings=settings if register else None,
                              advertise_host=advertise_host))  # fmt: skip
    except OSError as exc:  # a port another process holds
        raise fail(f"the fleet cannot start: {exc}", 1) from exc


@app.command()
def router(
    engines: str | None = typer.Option(
        None, "--engines", "-e", help="Engines file (default: <state_dir>/engines.toml)."
    ),
    host: str | None = typer.Option(None, help="Listen address (default: settings)."),
    port: int | None = typer.Option(None, help="Listen port (default: settings)."),
    config: str | None = ConfigOpt,
) -> None:
    """The OpenAI-compatible router: route, admit or 429, publish grants and outcomes."""
    from foretoken.adapters.engines.engines_file import EnginesConfigError, load_engines
    from foretoken.adapters.http.router.app import run_router

    if port is not None:
        check_port("--port", port)
    settings = _settings(config)
    try:
        listed = load_engines(engines or settings.state_path / "engines.toml")
    except EnginesConfigError as exc:
        raise fail(str(exc)) from exc
    try:  # a tokenizer or chat template that does not load is one line, not a traceback
        run_router(settings, listed, settings.router.host if host is None else host,
                   settings.router.port if port is None else port)  # fmt: skip
    except ValueError as exc:
        raise fail(f"the router cannot start: {exc}") from exc


def _bench(names: list[str], quick: bool, full: bool = True) -> None:
    """One JSON object per benchmark on stdout (``full=False``: only its flat ``summary``)."""
    import json

    from foretoken.bench.run import run

    for report in run(names, quick):
        if full:
            print(json.dumps(report))
        else:
            summary = report["result"].get("summary")
            print(json.dumps({"benchmark": report["benchmark"], "quick": quick,
                              "summary": summary}))  # fmt: skip


JsonOpt = typer.Option(
    True, "--json/--summary", help="The whole report as JSON (default), or only its summary."
)


@bench_app.command("all")
def bench_all(quick: bool = typer.Option(False, help="Small sizes, for a smoke run.")) -> None:
    """Every benchmark, one JSON object per line."""
    from foretoken.bench.run import BENCHMARKS

    _bench(list(BENCHMARKS), quick)


@bench_app.command("index")
def bench_index(
    quick: bool = typer.Option(False, help="1 M entries instead of 10 M, fewer queries."),
    json_: bool = JsonOpt,
) -> None:
    """Cache index, native against the Python reference: ingest rate, lookup latency, hash
    time, bytes per entry (flat ``summary``; instruction counts in the full run)."""
    _bench(["index"], quick, json_)


@app.command()
def replay(
    trace: str = typer.Option("mooncake", help="mooncake, azure-conv, azure-code, or a file."),
    fleet: str = typer.Option("hetero", help="Fleet file or shipped fleet name."),
    policy: str = typer.Option("round-robin", help="Routing policy (see --help of the docs)."),
    speedup: float | None = typer.Option(None, help="Replay this many times faster."),
    capacity_factor: float | None = typer.Option(
        None, help="Speed up to this multiple of the fleet's estimated capacity."
    ),
    limit: int | None = typer.Option(None, help="Only the first N requests."),
    bounds: str | None = typer.Option(None, help='max_queue_wait_s mix, e.g. "5:0.3,30:0.7".'),
    out: str | None = typer.Option(None, help="Append the graded records to this lake."),
    seed: int = typer.Option(0),
    progress: bool = typer.Option(True),
    controls: str | None = typer.Option(
        None, help="on|off: run the latency controls in virtual time (policy predictor)."
    ),
    classes: str | None = typer.Option(
        None, help='Workload class mix, e.g. "interactive:0.3,batch:0.7" (classes: --config).'
    ),
    config: str | None = ConfigOpt,
) -> None:
    """Replay a trace on a simulated fleet in virtual time; summary as JSON."""
    from foretoken.sim.commands import dumps, replay_command

    positive(("--speedup", speedup), ("--capacity-factor", capacity_factor), ("--limit", limit))
    usable_output(out, "--out", directory=True)
    settings = _settings(config)
    try:
        summary = replay_command(
            trace=trace, fleet=fleet, policy=policy, speedup=speedup,
            capacity_factor=capacity_factor, limit=limit, bounds=bounds, out=out, seed=seed,
            progress=progress, controls=controls, classes=classes,
            control_settings=settings.controls, settings=settings,
        )  # fmt: skip
    except (ValueError, KeyError) as exc:
        raise fail(str(exc)) from exc
    print(dumps(summary))


@app.command()
def load(
    url: str = typer.Option(..., help="OpenAI-compatible base URL (router or engine)."),
    model: str = typer.Option(..., help="Model name to ask for."),
    trace: str = typer.Option("mooncake", help="mooncake, azure-conv, azure-code, or a file."),
    limit: int | None = typer.Option(None, help="Only the first N requests."),
    speedup: float = typer.Option(1.0, help="Replay arrivals this many times faster."),
    bounds: str | None = typer.Option(None, help='max_queue_wait_s mix, e.g. "5:0.3,30:0.7".'),
    concurrency: int = typer.Option(256, help="Most requests in flight."),
    timeout_s: float = typer.Option(600.0, help="Per-request timeout."),
    max_output_tokens: int | None = typer.Option(None, help="Cap output tokens."),
    duration_s: float | None = typer.Option(None, help="Stop sending after this long."),
    out: str | None = typer.Option(None, help="Client-side results to this Parquet file."),
    seed: int = typer.Option(0),
    progress: bool = typer.Option(True),
    config: str | None = ConfigOpt,
) -> None:
    """Replay a trace's arrivals against any OpenAI-compatible endpoint; results as JSON."""
    from foretoken.sim.commands import dumps, load_command

    _settings(config)
    positive(("--speedup", speedup), ("--limit", limit))
    if not url.startswith(("http://", "https://")):
        raise fail(f"--url must start with http:// or https://, got {url!r}")
    usable_output(out, "--out")
    try:
        summary = load_command(
            url=url, model=model, trace=trace, limit=limit, speedup=speedup, bounds=bounds,
            concurrency=concurrency, timeout_s=timeout_s, max_output_tokens=max_output_tokens,
            duration_s=duration_s, out=out, seed=seed, progress=progress,
        )  # fmt: skip
    except ValueError as exc:
        raise fail(str(exc)) from exc
    print(dumps(summary))


@bench_app.command("predict")
def bench_predict(
    quick: bool = typer.Option(False, help="A few hundred requests (with --matrix: ≤ 10 min)."),
    trace: str | None = typer.Option(
        None, help="A shipped or generated trace, or a file (--matrix: a comma-separated list)."
    ),
    fleet: str | None = typer.Option(
        None, help="A shipped fleet, random-SEED, or a file (--matrix: a comma-separated list)."
    ),
    loads: str = typer.Option("0.8,1.0,1.3", help="× the calibrated capacity."),
    load: float | None = typer.Option(None, help="One load (--explain)."),
    limit: int | None = typer.Option(None, help="Requests per cell."),
    seed: int = typer.Option(0, help="Seed of the generated workloads."),
    matrix: bool = typer.Option(False, help="Every trace × fleet × load (issue 15)."),
    jobs: int = typer.Option(2, help="Parallel processes."),
    explain: bool = typer.Option(False, help="Split each prediction's error into its parts."),
    json_path: str | None = typer.Option(None, "--json", help="Write the JSON here."),
    routing: str | None = typer.Option(
        None,
        help="Route by this baseline policy (e.g. least-outstanding-tokens); the "
        "predictor predicts as a read replica: a paired grading of predictor versions.",
    ),
    max_tokens: str = typer.Option(
        "exact", help="What clients send as max_tokens: exact, cap:N, none, loose or mix."
    ),
    config: str | None = ConfigOpt,
) -> None:
    """Prediction accuracy against baselines: the Mooncake benchmark (no options), one
    trace × fleet at several loads (--trace/--fleet), the matrix (--matrix) or the error
    decomposition (--explain)."""
    from foretoken.bench.predict_cli import predict_command

    _settings(config)
    if not (trace or fleet or matrix or explain):
        _bench(["predict"], quick)
        return
    positive(("--limit", limit), ("--jobs", jobs), ("--load", load))
    usable_output(json_path, "--json")
    try:
        predict_command(quick=quick, trace=trace, fleet=fleet, loads=loads, load=load,
                        limit=limit, seed=seed, matrix=matrix, jobs=jobs, explain=explain,
                        json_path=json_path, routing=routing,
                        max_tokens=max_tokens)  # fmt: skip
    except (ValueError, KeyError) as exc:
        raise fail(str(exc)) from exc


@bench_app.command("route")
def bench_route(
    quick: bool = typer.Option(False, help="100 and 500 requests/s, short windows."),
    replicas: int = typer.Option(1, help="2: one route replica against two, side by side."),
    json_: bool = JsonOpt,
) -> None:
    """Route service: CPU per request in process (native and reference), latency over HTTP
    up to 500 requests/s (32k-token prompts, 16 workers); flat ``summary``. ``--replicas 2``:
    one route replica against two, side by side."""
    if replicas == 1:
        _bench(["route"], quick, json_)
        return
    import json

    from foretoken.bench.run import run_one

    report = run_one("route", quick, replicas=replicas)
    summary = {"benchmark": "route", "quick": quick, "summary": report["result"].get("summary")}
    print(json.dumps(report if json_ else summary))


@bench_app.command("lake")
def bench_lake(quick: bool = typer.Option(False, help="1 M rows instead of 10 M.")) -> None:
    """accuracy_by_hour on a generated lake, against the same aggregation in polars."""
    _bench(["lake"], quick)


@bench_app.command("router")
def bench_router(quick: bool = typer.Option(False, help="Short windows, lower rate.")) -> None:
    """Router's added latency vs calling the engines directly, and no grant lost, under load."""
    _bench(["router"], quick)


@bench_app.command("aiperf")
def bench_aiperf(quick: bool = typer.Option(False, help="60 requests instead of 200.")) -> None:
    """NVIDIA aiperf through the router on the engine stub (`make aiperf` installs it): its
    TTFT next to the router's own."""
    _bench(["aiperf"], quick)


@bench_app.command("live-vs-replay")
def bench_live_vs_replay(
    quick: bool = typer.Option(False, help="40 s of trace instead of 120 s."),
) -> None:
    """One Mooncake slice through the live stack (router, worker, real-time fleet) and
    through virtual time: both grades side by side, split where they can differ."""
    _bench(["live-vs-replay"], quick)


@bench_app.command("approx")
def bench_approx(quick: bool = typer.Option(False, help="300 requests instead of 1,500.")) -> None:
    """The predictor with an approximate cache view (no KV events) against event-fed credit."""
    _bench(["approx"], quick)


@bench_app.command("real-engine")
def bench_real_engine(
    quick: bool = typer.Option(False, help="One engine, sizes up to 6k, a short stream."),
) -> None:
    """Real llama.cpp engines behind the router: learned vs measured curve, predicted vs actual."""
    _bench(["real-engine"], quick)


@llama_app.command(
    "run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def llama_run(ctx: typer.Context) -> None:
    """Start llama.cpp engines on the generated tiny GGUF and write their engines file
    (options: --count, --base-port, --n-ctx, --threads, --engines-out, --run-dir)."""
    from foretoken.sim.live.llama_server import main as llama_main

    raise typer.Exit(llama_main(list(ctx.args)))


@bench_app.command("client")
def bench_client(
    url: str = typer.Option(..., help="OpenAI-compatible base URL (router, engine, any)."),
    model: str = typer.Option(..., help="Model name to ask for."),
    concurrency: str | None = typer.Option(None, help='Concurrency steps, e.g. "1,4,16".'),
    rate: str | None = typer.Option(None, help='Rate steps in requests/s, e.g. "2,8".'),
    burstiness: float = typer.Option(1.0, help="Gamma shape of arrival gaps (<1 bursty)."),
    max_concurrency: int = typer.Option(256, help="Most in flight in a rate step."),
    requests: int = typer.Option(50, help="Requests per step."),
    prompts: str = typer.Option(
        "azure-code", help="azure-code, azure-conv, mooncake, or a .jsonl/.json/.txt dataset."
    ),
    max_tokens: int = typer.Option(16, help="Output tokens per request (at most)."),
    p95_target_s: float = typer.Option(2.0, help="P95 TTFT a step must meet."),
    max_429_share: float = typer.Option(0.05, help="Most 429s (share of sent) a step may have."),
    peak_concurrency: int | None = typer.Option(None, help="Expected peak concurrency."),
    peak_rps: float | None = typer.Option(None, help="Expected peak requests/s."),
    workload_class: str | None = typer.Option(None, help="Send x-workload-class."),
    max_queue_wait_s: float | None = typer.Option(None, help="Send x-max-queue-wait-s."),
    timeout_s: float = typer.Option(120.0, help="Per-request timeout."),
    seed: int = typer.Option(0),
) -> None:
    """Client-side P50/P95/P99 TTFT per step (official openai client, no retries), the
    highest step meeting a P95 target, and replica sizing. Table on stderr, JSON on stdout."""
    import json

    from foretoken.bench.client_bench import ClientBenchConfig, render, run_client_bench

    try:
        cfg = ClientBenchConfig(
            url=url, model=model, concurrency=tuple(int(c) for c in _floats(concurrency, "c")),
            rates=_floats(rate, "rate"), burstiness=burstiness, max_concurrency=max_concurrency,
            requests=requests, source=prompts, max_tokens=max_tokens, p95_target_s=p95_target_s,
            max_429_share=max_429_share, peak_concurrency=peak_concurrency, peak_rps=peak_rps,
            timeout_s=timeout_s, workload_class=workload_class,
            max_queue_wait_s=max_queue_wait_s, seed=seed,
        )  # fmt: skip
        report = run_client_bench(cfg)
    except ValueError as exc:
        raise fail(str(exc)) from exc
    render(report, Console(stderr=True, width=max(console.width, 110)))
    print(json.dumps(report, indent=1))


@app.command()
def report(
    lake: str = typer.Option(..., help="The grading lake directory."),
    as_json: bool = typer.Option(False, "--json", help="JSON instead of tables."),
) -> None:
    """The grades of a lake (PRODUCT.md §4): accuracy, bounds, false alarms, cache."""
    import json

    from foretoken.adapters.lake.report import output_console, render
    from foretoken.adapters.lake.report import report as build

    existing_dir(lake, "--lake")
    summary = lake_call(lake, build, lake)
    if as_json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        render(summary, output_console())


@app.command()
def sql(
    query: str | None = typer.Argument(None, help="One query; none: an interactive shell."),
    lake: str | None = typer.Option(
        None, help="The grading lake directory (default: the demo's, <state_dir>/demo/lake)."
    ),
    config: str | None = ConfigOpt,
) -> None:
    """DuckDB with the views of sql/ over the lake attached."""
    from foretoken.adapters.lake.report import sql_shell

    where = lake or str(_settings(config).state_path / "demo" / "lake")
    existing_dir(where, "--lake")
    raise typer.Exit(lake_call(where, sql_shell, where, query))


@app.command()
def dashboard(
    lake: str = typer.Option(..., help="The grading lake directory."),
    port_: int = typer.Option(8501, "--port", help="Port of the dashboard."),
    host: str | None = typer.Option(None, help="Listen address (default: dashboard.host)."),
    refresh_s: float = typer.Option(0.0, help="Auto-refresh every N seconds (0: off)."),
    config: str | None = ConfigOpt,
) -> None:
    """The Streamlit dashboard over a grading lake."""
    import os

    from foretoken.adapters.dashboard import APP_PATH as app_path

    port("--port", port_)
    address = host or _settings(config).dashboard.host  # Streamlit binds every interface else
    args = [sys.executable, "-m", "streamlit", "run", str(app_path), "--server.headless",
            "true", "--server.address", address, "--server.port", str(port_),
            "--browser.gatherUsageStats", "false", "--", "--lake", lake]  # fmt: skip
    if refresh_s:
        args += ["--refresh-s", str(refresh_s)]
    os.execv(sys.executable, args)


@app.command()
def demo(
    config: str | None = ConfigOpt,
    keep: bool = typer.Option(False, help="Leave the broker and worker running afterwards."),
    dashboard: bool = typer.Option(True, help="Leave the dashboard running on the lake."),
    engines: str = typer.Option("sim", help="sim: the simulated fleet; llama: real llama.cpp."),
    quick: bool = typer.Option(False, help="A short slice (the CI smoke run, under 3 min)."),
) -> None:
    """Broker, worker and a sample of every record: shows the pipeline consuming them."""
    if engines == "llama":
        from foretoken.ops.llama_demo import run_llama_demo

        raise typer.Exit(run_llama_demo(_settings(config), keep=keep))
    if engines != "sim":
        raise fail(f"--engines must be sim or llama, not {engines!r}")
    from foretoken.ops.demo import run_demo

    raise typer.Exit(run_demo(_settings(config), keep=keep, dashboard=dashboard, quick=quick))


@app.command()
def version() -> None:
    """Print the version."""
    from foretoken import __version__

    print(__version__)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
