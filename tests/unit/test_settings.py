from __future__ import annotations

from pathlib import Path

import pytest

from foretoken.settings import ENV_VARS, Settings, SettingsError, load_settings


def test_defaults_work_on_a_laptop() -> None:
    s = load_settings(env={})
    assert s.kafka.bootstrap_servers == "127.0.0.1:9092"
    assert not s.kafka.external
    assert s.topic("kv_events") == "kv-events"
    assert set(s.all_topics()) == {
        "workers", "kv_events", "grants", "outcomes", "graded", "dead_letter", "controls",
    }  # fmt: skip


def test_environment_overrides_file(tmp_path: Path) -> None:
    f = tmp_path / "s.toml"
    f.write_text('topic_prefix = "file-"\n[worker]\nweb_port = 7000\napp_id = "from-file"\n')
    env = {"FORETOKEN_WEB_PORT": "7100", "KAFKA_BOOTSTRAP_SERVERS": "kafka:9092"}
    s = load_settings(f, env=env)
    assert s.worker.web_port == 7100  # env wins
    assert s.worker.app_id == "from-file"  # file beats default
    assert s.topic("grants") == "file-grants"
    assert s.kafka.bootstrap_servers == "kafka:9092"
    assert s.kafka.external  # a given broker is never managed locally


def test_bad_values_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="web_port"):
        load_settings(env={"FORETOKEN_WEB_PORT": "not-a-port"})
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(tmp_path / "missing.toml", env={})
    with pytest.raises(SettingsError, match="wire_format"):
        load_settings(env={"FORETOKEN_WIRE_FORMAT": "pickle"})


def test_every_env_var_maps_to_a_real_setting() -> None:
    for var, dotted in ENV_VARS.items():
        node: object = Settings()
        for part in dotted.split("."):
            assert hasattr(node, part), f"{var} -> {dotted}"
            node = getattr(node, part)
