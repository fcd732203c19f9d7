"""docker-compose.yml cannot run here (no Docker engine): check that it agrees with the
settings module and the CLI instead."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.main import get_command

from foretoken.cli import app
from foretoken.settings import ENV_VARS

ROOT = Path(__file__).resolve().parents[3]
SERVICES = {"kafka", "worker", "router", "fleet", "dashboard"}
SCALED = {"route-a", "route-b", "router-scaled"}  # the `scaled` profile
# Services whose subcommand a later issue adds (dashboard: #7).
PENDING: set[str] = set()


def _compose() -> dict:
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


def test_services_are_all_there_with_healthchecks() -> None:
    services = _compose()["services"]
    assert set(services) == SERVICES | SCALED
    for name, svc in services.items():
        assert "healthcheck" in svc, name


def test_foretoken_services_use_only_known_settings_variables() -> None:
    services = _compose()["services"]
    for name in (SERVICES | SCALED) - {"kafka"}:
        env = services[name]["environment"]
        unknown = set(env) - set(ENV_VARS)
        assert not unknown, f"{name} sets variables the settings module does not read: {unknown}"
        assert env["KAFKA_BOOTSTRAP_SERVERS"].startswith("kafka:")


def test_the_broker_advertises_the_listener_the_services_use() -> None:
    services = _compose()["services"]
    bootstrap = services["worker"]["environment"]["KAFKA_BOOTSTRAP_SERVERS"]
    assert bootstrap in services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]


def test_service_commands_are_real_subcommands() -> None:
    cli = get_command(app)
    known = set(cli.commands)  # type: ignore[attr-defined]
    services = _compose()["services"]
    for name in SERVICES - {"kafka"}:
        command = services[name]["command"]
        assert command[0] == "foretoken"
        if name in PENDING:
            assert command[1] not in known, f"{name} exists now: take it out of PENDING"
        else:
            assert command[1] in known, f"{name}: no `foretoken {command[1]}`"


def test_scaled_profile_two_route_replicas_behind_two_router_processes() -> None:
    services = _compose()["services"]
    assert all(services[name]["profiles"] == ["scaled"] for name in SCALED)
    assert not any("profiles" in services[name] for name in SERVICES)
    primary = services["worker"]["environment"]
    urls = []
    for name in ("route-a", "route-b"):
        svc = services[name]
        env = svc["environment"]
        assert svc["command"][1:] == ["worker", "--role", "route"]
        # the primary's snapshots, read-only, and the primary's consumer-group prefix
        assert env["FORETOKEN_SNAPSHOT_DIR"] == primary["FORETOKEN_WORKER_DATA_DIR"]
        assert f"worker:{env['FORETOKEN_SNAPSHOT_DIR']}:ro" in svc["volumes"]
        assert env["FORETOKEN_APP_ID"] == primary["FORETOKEN_APP_ID"]
        urls.append(env["FORETOKEN_ADVERTISE_URL"])
    assert len(set(urls)) == 2
    router = services["router-scaled"]["environment"]
    assert router["FORETOKEN_ROUTE_URLS"].split(",") == urls
    assert int(router["FORETOKEN_ROUTER_PROCESSES"]) == 2
