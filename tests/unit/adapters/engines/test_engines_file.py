"""The engines file a person writes: every mistake is a one-line error naming the file, the
engine and the key, at load (before: a block_size of 0 crashed ingest later with a
115-line traceback, a misspelled scheduler key silently kept the default, an http:// KV
events URL made ingest restart its listener for ever)."""

from __future__ import annotations

from pathlib import Path

import pytest

from foretoken.adapters.engines.engines_file import (
    EngineConfig,
    EnginesConfigError,
    load_engines,
)

GOOD = '[[engines]]\nworker_id = "w0"\nmodel = "m"\nhttp_url = "http://127.0.0.1:8000"\n'


def _load(tmp_path: Path, text: str | bytes) -> list[EngineConfig]:
    path = tmp_path / "engines.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return load_engines(path)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (GOOD + "block_size = 0\n", "block_size"),
        (GOOD + "gpu_blocks = -5\n", "gpu_blocks"),
        (GOOD + "max_model_len = -1\n", "max_model_len"),
        (GOOD + "[engines.scheduler]\nmax_num_batched_token = 99\n", "max_num_batched_token"),
        (GOOD + 'kv_events_url = "http://127.0.0.1:5557"\n', "kv_events_url must start with"),
        (GOOD.replace("http://127.0.0.1:8000", "127.0.0.1:8000"), "http_url must start with"),
        (GOOD.replace("http://127.0.0.1:8000", "http://"), "needs a host and a valid port"),
        (GOOD.replace("127.0.0.1:8000", "127.0.0.1:99999"), "needs a host and a valid port"),
        (GOOD.replace("127.0.0.1:8000", "exa mple.com"), "needs a host and a valid port"),
        (GOOD + 'kv_events_url = "tcp://127.0.0.1"\n', "needs a host and a valid port"),
        (GOOD + 'tokenizer = "/no/such/tokenizer.json"\n', "tokenizer"),
        (GOOD + 'tokenizer = "/proc"\n', "nor a directory holding tokenizer.json"),
        (GOOD + 'chat_template = "/no/such/template.jinja"\n', "chat_template"),
        (GOOD.replace('"w0"', '""'), "worker_id must not be empty"),
        (GOOD + 'lora_adapters = ["a", "a"]\n', "lora_adapters must be distinct"),
        (GOOD + 'lora_adapters = [" "]\n', "lora_adapters must be distinct"),
        (GOOD + 'lora_adapters = [" ada"]\n', "lora_adapters must be distinct"),
        (GOOD + 'lora_adapters = ["a\\u0007"]\n', "lora_adapters must be distinct"),
        (GOOD + 'lora_adapters = ["m"]\n', "also a base model's name"),
        (
            GOOD
            + 'lora_adapters = ["a"]\n'
            + GOOD.replace('"w0"', '"w1"').replace('"m"', '"m2"')
            + 'lora_adapters = ["a"]\n',
            "served on two base models",
        ),
        (GOOD + '[[engine]]\nworker_id = "w1"\n', "engine"),
        ("engines = []\n", "no engines"),
        (GOOD + GOOD, "duplicate worker_id"),
        (b"\xff\xfe[[engines]]", "engines file"),
    ],
)
def test_a_mistake_is_one_line_naming_the_file_and_the_key(
    tmp_path: Path, text: str | bytes, says: str
) -> None:
    with pytest.raises(EnginesConfigError) as info:
        _load(tmp_path, text)
    message = str(info.value)
    assert message.startswith(f"engines file {tmp_path / 'engines.toml'}") and says in message
    assert "\n" not in message


def test_lora_adapters_reach_the_registration(tmp_path: Path) -> None:
    (engine,) = _load(tmp_path, GOOD + 'lora_adapters = ["ada", "bda"]\n')
    assert engine.registration(ts=0.0).lora_adapters == ("ada", "bda")


def test_a_model_directory_is_a_tokenizer(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    (engine,) = _load(tmp_path, GOOD + f'tokenizer = "{model}"\n')
    assert engine.tokenizer == str(model)


def test_a_good_file_loads(tmp_path: Path) -> None:
    (engine,) = _load(tmp_path, GOOD + 'kv_events_url = "tcp://127.0.0.1:5557"\n')
    assert engine.worker_id == "w0" and engine.kv_events_url == "tcp://127.0.0.1:5557"
