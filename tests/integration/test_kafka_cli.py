"""`foretoken kafka up|down|status` on a second, private broker (own port and state dir)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from foretoken.ops.kafka_local import accepts_connections
from tests.conftest import free_port

pytestmark = pytest.mark.integration


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "foretoken.cli", *args],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip


def _java_processes_using(marker: str) -> list[str]:
    out = subprocess.run(
        ["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True, check=True
    )
    return [line for line in out.stdout.splitlines() if "java" in line and marker in line]


def test_up_twice_is_harmless_and_down_leaves_no_java(tmp_path: Path) -> None:
    port = free_port(count=2)  # the local broker's controller listens on P + 1
    cfg = tmp_path / "kafka.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[kafka]\nbootstrap_servers = "127.0.0.1:{port}"\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    try:
        first = _cli(["kafka", "up", "-c", str(cfg)], env)
        assert first.returncode == 0, first.stderr
        assert first.stdout.strip() == "started"
        assert accepts_connections(f"127.0.0.1:{port}")
        second = _cli(["kafka", "up", "-c", str(cfg)], env)
        assert second.returncode == 0 and second.stdout.strip() == "running"
        assert len(_java_processes_using(str(tmp_path))) == 1
        st = _cli(["kafka", "status", "-c", str(cfg)], env)
        assert st.returncode == 0 and "running" in st.stdout
    finally:
        down = _cli(["kafka", "down", "-c", str(cfg)], env)
    assert down.returncode == 0 and "stopped" in down.stderr
    assert _java_processes_using(str(tmp_path)) == []
    assert not accepts_connections(f"127.0.0.1:{port}")
    st = _cli(["kafka", "status", "-c", str(cfg)], env)
    assert st.returncode == 1 and "no broker" in st.stdout


def test_missing_maven_or_java_says_what_to_install(tmp_path: Path) -> None:
    cfg = tmp_path / "kafka.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "s"}"\ncache_dir = "{tmp_path / "c"}"\n'
        f'[kafka]\nbootstrap_servers = "127.0.0.1:{free_port()}"\n'
    )
    env = {**os.environ, "PATH": str(tmp_path / "empty-bin")}
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    env.pop("FORETOKEN_CACHE_DIR", None)  # the config's cache_dir (empty: maven is needed)
    out = _cli(["kafka", "up", "-c", str(cfg)], env)
    assert out.returncode == 1
    assert "install maven" in out.stderr and "docker compose" in out.stderr
