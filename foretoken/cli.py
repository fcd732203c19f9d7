"""The ``foretoken`` command. Each subcommand is a thin shell over a module that does the work."""

from __future__ import annotations

import asyncio
import sys

import typer
from rich.console import Console

from foretoken.settings import Settings, SettingsError, load_settings

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
kafka_app = typer.Typer(no_args_is_help=True, help="The local Kafka broker (KRaft, from Maven).")
topics_app = typer.Typer(no_args_is_help=True, help="The foretoken topics.")
app.add_typer(kafka_app, name="kafka")
app.add_typer(topics_app, name="topics")

console = Console(stderr=True)
ConfigOpt = typer.Option(None, "--config", "-c", help="Settings TOML (else $FORETOKEN_CONFIG).")


def _settings(config: str | None) -> Settings:
    try:
        return load_settings(config)
    except SettingsError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


@kafka_app.command("up")
def kafka_up(config: str | None = ConfigOpt) -> None:
    """Start the local broker (fetching its jars once); harmless when one is running."""
    from ops.kafka_local import KafkaError, up

    try:
        st, started = up(_settings(config))
    except KafkaError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
    # stdout carries one machine-readable word for scripts (the Makefile): started|running|external
    print("started" if started else ("external" if st.external else "running"))
    console.print(st.describe())


@kafka_app.command("down")
def kafka_down(config: str | None = ConfigOpt) -> None:
    """Stop the local broker cleanly."""
    from ops.kafka_local import down

    stopped = down(_settings(config))
    console.print("stopped the local broker" if stopped else "no local broker was running")


@kafka_app.command("status")
def kafka_status(config: str | None = ConfigOpt) -> None:
    """Say whether a broker answers, and whether foretoken started it."""
    from ops.kafka_local import status

    st = status(_settings(config))
    print(st.describe())
    raise typer.Exit(0 if st.reachable else 1)


@topics_app.command("create")
def topics_create(config: str | None = ConfigOpt) -> None:
    """Create every topic of PRODUCT.md §2 that does not exist yet."""
    from streams.topics import ensure_topics, topic_specs

    settings = _settings(config)
    created = asyncio.run(ensure_topics(settings))
    for spec in topic_specs(settings):
        mark = "created" if spec.name in created else "exists"
        policy = "compact" if spec.compacted else "delete"
        print(f"{spec.name:<24} partitions={spec.partitions} cleanup={policy} {mark}")


@app.command()
def worker(config: str | None = ConfigOpt) -> None:
    """Run the Faust worker (agents over every input topic, /healthz, /metrics)."""
    from streams.app import run_worker

    settings = _settings(config)
    sys.argv = [sys.argv[0]]  # Faust's worker reads argv; ours is already parsed
    run_worker(settings)


@app.command()
def demo(
    config: str | None = ConfigOpt,
    keep: bool = typer.Option(False, help="Leave the broker and worker running afterwards."),
) -> None:
    """Broker, worker and a sample of every record: shows the pipeline consuming them."""
    from ops.demo import run_demo

    raise typer.Exit(run_demo(_settings(config), keep=keep))


@app.command()
def version() -> None:
    """Print the version."""
    from foretoken import __version__

    print(__version__)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
