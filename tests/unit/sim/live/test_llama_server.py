"""llama.cpp as an engine type, without the engine: the generated GGUF and its tokenizer,
the engines-file entry, and the queue replay of a serial engine through its settings."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from foretoken.adapters.engines.engines_file import EngineConfig, dump_engines, load_engines
from foretoken.adapters.engines.ingest import Ingest
from foretoken.adapters.http.tokenizers import HFTokenizer
from foretoken.core.queue.scheduler import CurveStepCost, NewRequest
from foretoken.core.queue.worker_queue import WorkerQueue
from foretoken.core.types import RequestId
from foretoken.ops.llama_stack import fit_quadratic, random_text
from foretoken.sim.live.gguf_model import (
    BOS_ID,
    EOS_ID,
    VOCAB_SIZE,
    TinyLlamaSpec,
    byte_to_unicode,
    ensure_model,
    write_gguf,
)
from foretoken.sim.live.llama_server import engine_config, server_args

SMALL = TinyLlamaSpec(n_embd=32, n_layer=1, n_head=2, n_head_kv=2, n_ff=64, context_length=4096)


def test_byte_alphabet_is_a_bijection_of_printable_characters() -> None:
    chars = byte_to_unicode()
    assert sorted(chars) == list(range(256))
    assert len(set(chars.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in chars.values())


def test_gguf_is_a_llama_model_with_the_spec_shape(tmp_path: Path) -> None:
    import gguf

    path = write_gguf(tmp_path / "m.gguf", SMALL)
    reader = gguf.GGUFReader(str(path))
    fields = reader.fields

    def scalar(name: str) -> object:
        f = fields[name]
        return f.parts[f.data[0]][0]

    assert bytes(fields["general.architecture"].parts[-1]).decode() == "llama"
    assert scalar("llama.context_length") == SMALL.context_length
    assert scalar("llama.embedding_length") == SMALL.n_embd
    assert scalar("llama.block_count") == SMALL.n_layer
    assert scalar("tokenizer.ggml.bos_token_id") == BOS_ID
    assert scalar("tokenizer.ggml.eos_token_id") == EOS_ID
    assert not scalar("tokenizer.ggml.add_bos_token")
    assert len(fields["tokenizer.ggml.tokens"].data) == VOCAB_SIZE
    tensors = {t.name: t for t in reader.tensors}
    expected = 3 + 9 * SMALL.n_layer
    assert len(tensors) == expected
    embd = tensors["token_embd.weight"]
    assert sorted(int(x) for x in embd.shape) == sorted([VOCAB_SIZE, SMALL.n_embd])
    # The layers never write the steering dimension (so the head can read it).
    down = np.asarray(tensors["blk.0.ffn_down.weight"].data).reshape(SMALL.n_embd, SMALL.n_ff)
    assert not down[0].any() and down[1:].any()


def test_tokenizer_json_counts_utf8_bytes_like_the_engine(tmp_path: Path) -> None:
    _gguf, tok_path = ensure_model(tmp_path, SMALL)
    tok = HFTokenizer(tok_path)
    rng = random.Random(0)
    for text in ["hello world", "déjà vu — ünïcode ✓", random_text(rng, 500), " a\n\tb "]:
        assert tok.encode(text) == list(text.encode())


def test_engine_config_is_a_serial_engine_without_events_or_cache_reports() -> None:
    cfg = engine_config("llama0", "tiny", "http://127.0.0.1:1", n_ctx=8192, tokenizer="/t.json")
    reg = cfg.registration(ts=0.0)
    assert reg.engine == "llamacpp" and not reg.has_kv_events
    assert not cfg.reports_cached_tokens and not cfg.kv_events
    assert reg.scheduler.max_num_seqs == 1 and not reg.scheduler.chunked_prefill
    assert reg.scheduler.max_num_batched_tokens == 8192
    assert reg.gpu_blocks is not None and reg.gpu_blocks * reg.block_size == 8192


def test_engines_file_round_trip_keeps_the_flags(tmp_path: Path) -> None:
    tokenizer = tmp_path / "t.json"
    tokenizer.write_text("{}")  # load_engines checks that it is there
    cfg = engine_config("llama0", "tiny", "http://127.0.0.1:1", tokenizer=str(tokenizer))
    path = tmp_path / "engines.toml"
    path.write_text(dump_engines([cfg]))
    (back,) = load_engines(path)
    assert back == cfg


def test_kv_events_false_means_no_subscription_even_with_a_url() -> None:
    from foretoken.settings import load_settings

    listening = EngineConfig(worker_id="v", model="m", http_url="http://x",
                             kv_events_url="tcp://127.0.0.1:1")  # fmt: skip
    silent = EngineConfig(worker_id="l", model="m", http_url="http://y",
                          kv_events_url="tcp://127.0.0.1:2", kv_events=False)  # fmt: skip
    ingest = Ingest(load_settings(env={}), [listening, silent])
    try:
        assert [e.worker_id for e in ingest.engines] == ["v"]
        assert [e.worker_id for e in ingest.all_engines] == ["v", "l"]  # both registered
        assert not silent.registration(ts=0.0).has_kv_events
    finally:
        ingest.ctx.term()


def test_server_args_never_interrupt_a_streaming_request() -> None:
    args = server_args(Path("/m.gguf"), 1234)
    assert args[args.index("--interrupt_requests") + 1] == "false"
    assert "llama_cpp.server" in args


def test_queue_replay_serializes_requests_on_a_serial_engine() -> None:
    """From the registered settings alone: a request behind another waits for its whole
    prefill and its decode; on a batching engine it would not wait for the decode."""
    cost = CurveStepCost(lambda n: 1e-4 * n + 1e-8 * n * n, 0.0, 0.01)
    serial = WorkerQueue(engine_config("l", "m", "http://x", n_ctx=16384).registration().scheduler)
    serial.add(RequestId("a"), 0.0, 4000, 0, 50)
    alone = WorkerQueue(serial.settings).predict(NewRequest(4000), 0.0, cost)
    behind = serial.predict(NewRequest(4000), 0.0, cost)
    first_prefill = cost.prefill_s(4000)
    assert behind.ttft_s == pytest.approx(alone.ttft_s + first_prefill + 49 * 0.01, rel=0.02)
    batching = WorkerQueue(EngineConfig(worker_id="v", model="m", http_url="x").scheduler)
    batching.add(RequestId("a"), 0.0, 4000, 0, 50)
    assert batching.predict(NewRequest(4000), 0.0, cost).ttft_s < behind.ttft_s - 0.3


def test_fit_quadratic_recovers_a_curve() -> None:
    rng = np.random.default_rng(0)
    a, b = 2e-4, 3e-8
    points = [(n, (a * n + b * n * n) * float(rng.uniform(0.98, 1.02)))
              for n in (512, 1024, 2048, 4096, 8192, 16384)]  # fmt: skip
    fa, fb = fit_quadratic(points)
    assert fa == pytest.approx(a, rel=0.15) and fb == pytest.approx(b, rel=0.15)
