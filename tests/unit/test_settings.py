from __future__ import annotations

from pathlib import Path

import pytest

from foretoken.settings import (
    ENV_VARS,
    Settings,
    SettingsError,
    describe_settings,
    load_settings,
    load_settings_with_sources,
)


def test_defaults_work_on_a_laptop() -> None:
    s = load_settings(env={})
    assert s.kafka.bootstrap_servers == "127.0.0.1:9092"
    assert not s.kafka.external
    assert s.topic("kv_events") == "kv-events"
    assert set(s.all_topics()) == {
        "workers", "kv_events", "grants", "outcomes", "graded", "dead_letter", "controls",
        "members",
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


def test_every_knob_of_the_core_is_a_setting_from_file_and_environment(tmp_path: Path) -> None:
    f = tmp_path / "s.toml"
    f.write_text(
        "[predictor]\nexplore_fraction = 0.1\ntier_load_s_per_token = { CPU = 3e-6 }\n"
        "[fits]\ndefault_a = 2e-4\n[fits.prefill]\nwindow = 128\n"
        "[join]\ntimeout_s = 120.0\n[controls]\nwindow_s = 30.0\n"
    )
    s = load_settings(f, env={"FORETOKEN__JOIN__EXPIRY_INTERVAL_S": "2.5",
                              "FORETOKEN__FITS__STEP__MIN_SAMPLES": "12",
                              "FORETOKEN__PREDICTOR__OVERLOAD_WAIT_S": "60"})  # fmt: skip
    assert s.predictor.explore_fraction == 0.1 and s.predictor.overload_wait_s == 60.0
    assert s.predictor.tier_load_s_per_token == {"CPU": 3e-6}
    assert s.fits.default_a == 2e-4 and s.fits.prefill.window == 128
    assert s.fits.step.min_samples == 12
    assert s.join.timeout_s == 120.0 and s.join.expiry_interval_s == 2.5
    assert s.controls.window_s == 30.0


def test_unknown_keys_and_cross_field_rules_are_errors_that_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"unknown setting 'predictor\.explore_fractoin'"):
        load_settings(env={"FORETOKEN__PREDICTOR__EXPLORE_FRACTOIN": "0.1"})
    f = tmp_path / "typo.toml"
    f.write_text("[fits.prefill]\nwindw = 3\n")
    with pytest.raises(SettingsError, match=r"unknown setting 'fits\.prefill\.windw'"):
        load_settings(f, env={})
    with pytest.raises(SettingsError, match=r"explore_fraction.*FORETOKEN__PREDICTOR"):
        load_settings(env={"FORETOKEN__PREDICTOR__EXPLORE_FRACTION": "2"})
    with pytest.raises(SettingsError, match=r"router.min_queue_wait_s.*router.max_queue_wait_s"):
        load_settings(env={"FORETOKEN__ROUTER__MIN_QUEUE_WAIT_S": "400"})
    with pytest.raises(
        SettingsError, match=r"join.expiry_interval_s.*predictor.outstanding_max_age"
    ):
        load_settings(env={"FORETOKEN__JOIN__EXPIRY_INTERVAL_S": "800",
                           "FORETOKEN__JOIN__TIMEOUT_S": "900",
                           "FORETOKEN__PREDICTOR__OUTSTANDING_MAX_AGE_S": "600"})  # fmt: skip


def test_config_show_names_where_each_value_came_from(tmp_path: Path) -> None:
    f = tmp_path / "s.toml"
    f.write_text('[worker]\napp_id = "file-app"\n')
    settings, sources = load_settings_with_sources(
        f, env={"FORETOKEN_WEB_PORT": "7001", "FORETOKEN__FITS__DEFAULT_B": "1e-9"}
    )
    rows = {key: (value, source) for key, value, source in describe_settings(settings, sources)}
    assert rows["worker.app_id"] == ("file-app", f"file {f}")
    assert rows["worker.web_port"] == (7001, "env FORETOKEN_WEB_PORT")
    assert rows["fits.default_b"] == (1e-9, "env FORETOKEN__FITS__DEFAULT_B")
    assert rows["predictor.explore_fraction"] == (0.02, "default")


def test_scale_out_settings_from_the_environment() -> None:
    s = load_settings(env={
        "FORETOKEN_ROUTE_URLS": "http://a:1, http://b:2/", "FORETOKEN_ROLE": "route",
        "FORETOKEN_INSTANCE_ID": "r1", "FORETOKEN_APP_ID": "app", "FORETOKEN_SHARDING": "model",
    })  # fmt: skip
    assert s.route_urls == ["http://a:1", "http://b:2"]  # a list variable: comma-separated
    assert s.worker.role == "route" and s.sharding == "model"
    assert s.group_id == "app-route"  # shards share one group (Kafka splits the partitions)
    assert s.worker_data_path.name == "app-route-r1"  # each process its own data
    assert s.snapshot_path.name == "app"  # a replica reads the primary's snapshots
    replica = load_settings(env={"FORETOKEN_ROLE": "route", "FORETOKEN_INSTANCE_ID": "r1",
                                 "FORETOKEN_APP_ID": "app"})  # fmt: skip
    assert replica.group_id == "app-route-r1"  # a read replica: a group of its own
    primary = load_settings(env={"FORETOKEN_APP_ID": "app"})
    assert primary.group_id == "app" and primary.route_urls == [primary.route_url]
    assert primary.snapshot_path == primary.worker_data_path
    with pytest.raises(SettingsError, match="role"):
        load_settings(env={"FORETOKEN_ROLE": "secondary"})


def test_loopback_is_told_from_every_other_address() -> None:
    from foretoken.settings import is_loopback

    assert all(map(is_loopback, ["127.0.0.1", "127.5.0.1", "localhost", "::1", "[::1]"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "", "10.0.0.3", "worker", "192.168.1.1"]))
    assert load_settings(env={}).binds_loopback_only
    assert not load_settings(env={"FORETOKEN_WEB_HOST": "0.0.0.0"}).binds_loopback_only


def test_edge_limits_are_settings_with_their_rules() -> None:
    s = load_settings(env={"FORETOKEN_ROUTE_TOKEN": "t0k", "FORETOKEN_INGEST_PORT": "7001",
                           "FORETOKEN__INGEST__MAX_MESSAGE_BYTES": "1024",
                           "FORETOKEN__ROUTE__MAX_PROMPT_TOKENS": "1000",
                           "FORETOKEN__ROUTER__MAX_PROMPT_TOKENS": "1000"})  # fmt: skip
    assert s.route.token == "t0k" and s.ingest.port == 7001
    assert s.ingest.max_message_bytes == 1024
    assert s.route.body_limit >= 4 * 1000 * 4 // 3  # a whole prompt, base64 in JSON
    with pytest.raises(SettingsError, match=r"ingest\.max_record_bytes"):
        load_settings(env={"FORETOKEN__INGEST__MAX_RECORD_BYTES": "1048576"})
    with pytest.raises(SettingsError, match=r"route\.max_prompt_tokens .* router\.max_prompt"):
        load_settings(env={"FORETOKEN__ROUTE__MAX_PROMPT_TOKENS": "1000"})  # router's: 2M
    with pytest.raises(SettingsError, match=r"route\.max_body_bytes"):
        load_settings(env={"FORETOKEN__ROUTE__MAX_BODY_BYTES": "1000"})
    with pytest.raises(SettingsError, match="pending_horizon"):
        load_settings(env={"FORETOKEN__CONTROLS__PENDING_HORIZON_MIN_S": "1000"})


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"FORETOKEN_SNAPSHOT_INTERVAL_S": "0"}, "worker.snapshot_interval_s"),  # spun a timer
        ({"FORETOKEN_SNAPSHOT_INTERVAL_S": "nan"}, "worker.snapshot_interval_s"),
        ({"FORETOKEN_LAKE_COMPACT_INTERVAL_S": "0"}, "lake.compact_interval_s"),
        ({"FORETOKEN_LAKE_BATCH_RECORDS": "0"}, "lake.batch_records"),  # the worker died later
        ({"FORETOKEN_WEB_PORT": "70000"}, "worker.web_port"),  # a 176-line traceback
        ({"FORETOKEN__ROUTE__READ_TIMEOUT_S": "inf"}, "route.read_timeout_s"),  # no 408 then
        ({"FORETOKEN__ROUTER__ENGINE_TIMEOUT_S": "-1"}, "router.engine_timeout_s"),
        ({"FORETOKEN__LAYOUT__RETENTION_MS": "-2"}, "layout.retention_ms"),
        # A minus sign the core's knobs took: no fit iterated, no stage was ever held.
        ({"FORETOKEN__FITS__PREFILL__HUBER_ITERATIONS": "-1"}, "fits.prefill.huber_iterations"),
        ({"FORETOKEN__PREDICTOR__WAIT_SCALE_WINDOW": "-1"}, "predictor.wait_scale_window"),
        ({"FORETOKEN__CONTROLS__BREACH_S": "-1"}, "controls.breach_s"),
        ({"FORETOKEN__FITS__DEFAULT_A": "nan"}, "fits.default_a"),
    ],
)
def test_numbers_out_of_range_are_refused_naming_the_key(env: dict[str, str], key: str) -> None:
    with pytest.raises(SettingsError, match=key.replace(".", r"\.")):
        load_settings(env=env)


def test_a_route_token_no_caller_could_send_is_refused() -> None:
    """HTTP strips a header value's surrounding whitespace: every call got a 401 and the
    router quietly decided every request alone."""
    with pytest.raises(SettingsError, match=r"route\.token"):
        load_settings(env={"FORETOKEN__ROUTE__TOKEN": " secret "})
    assert load_settings(env={"FORETOKEN__ROUTE__TOKEN": "secret"}).route.token == "secret"


def test_every_number_of_the_core_refuses_a_minus_sign_but_the_signed_ones() -> None:
    """Each numeric setting of predictor, fits and controls is checked (the signed ones
    are the few that say "off" or a rank below -1)."""
    import json

    from foretoken.settings import describe_settings, load_settings_with_sources

    settings, sources = load_settings_with_sources(env={})
    signed = {"controls.classes.default.priority", "lake.compact_after_s",
              "layout.retention_ms", "worker.freeze_heap_after_s"}  # fmt: skip
    for key, value, _ in describe_settings(settings, sources):
        if isinstance(value, bool) or not isinstance(value, int | float) or key in signed:
            continue
        var = "FORETOKEN__" + key.upper().replace(".", "__")
        with pytest.raises(SettingsError):
            load_settings(env={var: json.dumps(-1)})


def test_a_byte_order_mark_is_no_error(tmp_path: Path) -> None:
    """Editors on Windows write one; tomllib refused the file without saying why."""
    file = tmp_path / "s.toml"
    file.write_bytes(b"\xef\xbb\xbf[ingest]\nport = 7001\n")
    assert load_settings(file, env={}).ingest.port == 7001
