"""Trace loaders, synthetic sharing, arrivals and bound mixes (fleet/traces.py)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foretoken.sim.clients import BoundMix
from foretoken.sim.traces import (
    AZURE_CODE_FILE,
    AZURE_CONV_FILE,
    MOONCAKE_BLOCK_TOKENS,
    MOONCAKE_FILE,
    TRACES_DIR_ENV,
    LengthDistribution,
    SharingModel,
    TraceFormatError,
    TraceRequest,
    default_trace_path,
    gamma_arrivals,
    load_azure,
    load_mooncake,
    synthetic_requests,
    traces_dir,
)

B = MOONCAKE_BLOCK_TOKENS
# A small Mooncake trace: block 0 is shared by all (a system prompt), block 1 by the
# first two requests (a conversation), the last blocks are partial.
MOONCAKE_ROWS: list[dict[str, Any]] = [
    {"timestamp": 0, "input_length": 2 * B - 24, "output_length": 5, "hash_ids": [0, 1]},
    {"timestamp": 1500, "input_length": 2 * B + 6, "output_length": 7, "hash_ids": [0, 1, 2]},
    {"timestamp": 4000, "input_length": B + 88, "output_length": 3, "hash_ids": [0, 4]},
]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def mooncake_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "mc.jsonl", MOONCAKE_ROWS)


def block(request: TraceRequest, index: int) -> np.ndarray:
    return request.token_ids[index * B : (index + 1) * B]


# ---------------------------------------------------------------------------- paths


def test_traces_dir_defaults_to_the_repositorys_data_and_env_overrides(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(TRACES_DIR_ENV, raising=False)
    repo_root = Path(__file__).resolve().parents[3]
    assert traces_dir() == repo_root / "data" / "traces"
    assert (traces_dir() / MOONCAKE_FILE).is_file()  # shipped in the repository
    monkeypatch.setenv(TRACES_DIR_ENV, str(tmp_path))
    assert default_trace_path(MOONCAKE_FILE) == tmp_path / MOONCAKE_FILE


# ---------------------------------------------------------------------------- Mooncake


def test_mooncake_lengths_and_truncated_last_block(mooncake_file: Path) -> None:
    requests = load_mooncake(mooncake_file)
    for row, request in zip(MOONCAKE_ROWS, requests, strict=True):
        tokens = request.token_ids
        assert tokens.dtype == np.int32
        assert len(tokens) == request.prompt_tokens == row["input_length"]
        assert request.output_tokens == row["output_length"]
    # Block 1 is the last (partial) block of request 0 and a full block of request 1:
    # the partial one is the full one's prefix.
    first, second, _ = requests
    partial = block(first, 1)
    assert len(partial) == MOONCAKE_ROWS[0]["input_length"] - B
    assert np.array_equal(partial, block(second, 1)[: len(partial)])


def test_mooncake_equal_ids_equal_tokens_different_ids_different(mooncake_file: Path) -> None:
    first, second, third = load_mooncake(mooncake_file)
    assert np.array_equal(block(first, 0), block(third, 0))
    assert np.array_equal(block(first, 0), block(second, 0))
    assert not np.array_equal(block(second, 1), block(third, 1)[: len(block(second, 1))])
    assert not np.array_equal(block(second, 2), block(third, 1)[: len(block(second, 2))])


def test_mooncake_is_deterministic_and_seeded(mooncake_file: Path) -> None:
    again = load_mooncake(mooncake_file)
    for a, b in zip(load_mooncake(mooncake_file), again, strict=True):
        assert a == b and np.array_equal(a.token_ids, b.token_ids)
    other = load_mooncake(mooncake_file, seed=1)
    assert not np.array_equal(again[0].token_ids, other[0].token_ids)
    small = load_mooncake(mooncake_file, vocab_size=50)
    assert all(t.token_ids.min() >= 0 and t.token_ids.max() < 50 for t in small)


def test_mooncake_speedup_and_limit(mooncake_file: Path) -> None:
    plain = load_mooncake(mooncake_file)
    fast = load_mooncake(mooncake_file, speedup=4.0, limit=2)
    assert len(fast) == 2
    assert [r.arrival_s for r in plain] == [row["timestamp"] / 1000 for row in MOONCAKE_ROWS]
    assert [r.arrival_s for r in fast] == pytest.approx([r.arrival_s / 4 for r in plain[:2]])
    with pytest.raises(ValueError, match="speedup"):
        load_mooncake(mooncake_file, speedup=0)


def test_mooncake_conversation_skips_the_block_every_request_shares(mooncake_file: Path) -> None:
    first, second, third = load_mooncake(mooncake_file)
    assert first.conversation_id == second.conversation_id != third.conversation_id
    # Fixing the shared prefix at 0 blocks puts everything in one conversation (block 0).
    fixed = load_mooncake(mooncake_file, system_prefix_blocks=0)
    assert len({r.conversation_id for r in fixed}) == 1


@pytest.mark.parametrize(
    "row",
    [
        {"timestamp": 0, "input_length": 2 * B + 1, "output_length": 1, "hash_ids": [0, 1]},
        {"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []},
        {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []},
        {"timestamp": -1, "input_length": 10, "output_length": 1},
    ],
)
def test_mooncake_rejects_malformed_rows(tmp_path: Path, row: dict[str, object]) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [MOONCAKE_ROWS[0], row])
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:2"):
        load_mooncake(path)


def test_shipped_mooncake_file_loads_whole() -> None:
    requests = load_mooncake()
    assert len(requests) == 12031  # the README's request count
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    # Every request shares the trace's first block, so conversations come from later ones.
    assert len({r.conversation_id for r in requests}) > 1
    sample = requests[:: len(requests) // 20]
    assert all(len(r.token_ids) == r.prompt_tokens for r in sample)


# ---------------------------------------------------------------------------- Azure


AZURE_CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.5000000,400,10
2023-11-16 18:17:04.0000000,900,20
2023-11-16 18:17:06.2500000,50,5
"""


def test_azure_arrivals_lengths_and_speedup(tmp_path: Path) -> None:
    path = tmp_path / "az.csv"
    path.write_text(AZURE_CSV)
    requests = load_azure(path, sharing=SharingModel.none())
    assert [r.arrival_s for r in requests] == pytest.approx([0.0, 0.5, 2.75])
    assert [(r.prompt_tokens, r.output_tokens) for r in requests] == [(400, 10), (900, 20), (50, 5)]
    assert all(len(r.token_ids) == r.prompt_tokens for r in requests)
    fast = load_azure(path, speedup=2.0, limit=2)
    assert [r.arrival_s for r in fast] == pytest.approx([0.0, 0.25])


def test_azure_rejects_a_file_without_the_columns(tmp_path: Path) -> None:
    path = tmp_path / "az.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(TraceFormatError):
        load_azure(path)


def shares_prefix(a: np.ndarray, b: np.ndarray, n: int) -> bool:
    return len(a) >= n and len(b) >= n and np.array_equal(a[:n], b[:n])


@pytest.fixture(scope="module")
def azure_conv() -> list[TraceRequest]:
    return load_azure(default_trace_path(AZURE_CONV_FILE), limit=4000)


def test_azure_keeps_trace_lengths_and_is_seeded(azure_conv: list[TraceRequest]) -> None:
    again = load_azure(default_trace_path(AZURE_CONV_FILE), limit=4000)
    assert again == azure_conv
    other = load_azure(
        default_trace_path(AZURE_CONV_FILE), limit=4000, sharing=SharingModel(seed=9)
    )
    assert [r.prompt_tokens for r in other] == [r.prompt_tokens for r in azure_conv]
    assert [r.conversation_id for r in other] != [r.conversation_id for r in azure_conv]


def test_followups_extend_their_previous_prompt(azure_conv: list[TraceRequest]) -> None:
    model = SharingModel()
    previous: dict[str | None, TraceRequest] = {}
    followups = 0
    for request in azure_conv:
        before = previous.get(request.conversation_id)
        if before is not None:
            followups += 1
            assert request.arrival_s - before.arrival_s <= model.session_idle_s
            assert request.prompt_tokens > before.prompt_tokens + before.output_tokens
            assert np.array_equal(request.token_ids[: before.prompt_tokens], before.token_ids)
        previous[request.conversation_id] = request
    # Achieved follow-up rate: some, but at most the configured probability (plus noise).
    rate = followups / len(azure_conv)
    assert 0.05 < rate <= model.followup_probability + 0.03


def test_system_prompts_start_the_chosen_share_of_new_sessions() -> None:
    system_len, fraction = 300, 0.4
    model = SharingModel(
        system_prompt_tokens=(system_len,), system_prompt_fraction=fraction, followup_probability=0
    )
    requests = load_azure(default_trace_path(AZURE_CODE_FILE), sharing=model)
    heads = Counter(
        r.token_ids[:system_len].tobytes() for r in requests if r.prompt_tokens > system_len
    )
    (_, shared), *rest = heads.most_common()
    eligible = sum(r.prompt_tokens > system_len for r in requests)
    assert shared / eligible == pytest.approx(fraction, abs=0.03)
    assert all(count == 1 for _, count in rest)  # everything else is fresh
    # A prompt never consists of the system prompt alone (it must be strictly longer).
    short = [r for r in requests if r.prompt_tokens <= system_len]
    system = np.frombuffer(heads.most_common(1)[0][0], dtype=np.int32)
    assert short and not any(np.array_equal(r.token_ids, system[: r.prompt_tokens]) for r in short)


def test_no_sharing_shares_nothing(azure_conv: list[TraceRequest]) -> None:
    requests = load_azure(
        default_trace_path(AZURE_CONV_FILE), limit=2000, sharing=SharingModel.none()
    )
    heads = {r.token_ids[:16].tobytes() for r in requests}
    assert len(heads) == len(requests)
    assert len({r.conversation_id for r in requests}) == len(requests)


def test_sessions_idle_too_long_are_not_continued() -> None:
    idle = 5.0
    model = SharingModel(followup_probability=1.0, session_idle_s=idle, system_prompt_tokens=())
    requests = load_azure(default_trace_path(AZURE_CODE_FILE), limit=3000, sharing=model)
    last_seen: dict[str | None, float] = {}
    for r in requests:
        if r.conversation_id in last_seen:
            assert r.arrival_s - last_seen[r.conversation_id] <= idle
        last_seen[r.conversation_id] = r.arrival_s


def test_one_open_session_means_only_the_latest_is_continued() -> None:
    model = SharingModel(followup_probability=1.0, max_open_sessions=1)
    requests = load_azure(default_trace_path(AZURE_CODE_FILE), limit=2000, sharing=model)
    seen: set[str | None] = set()
    latest: str | None = None
    for r in requests:
        assert r.conversation_id == latest or r.conversation_id not in seen
        seen.add(r.conversation_id)
        latest = r.conversation_id
    assert len(seen) < len(requests)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"system_prompt_fraction": 1.5},
        {"followup_probability": -0.1},
        {"system_prompt_tokens": (0,)},
        {"system_prompt_weights": (1.0,)},
        {"session_idle_s": 0.0},
        {"max_open_sessions": 0},
    ],
)
def test_sharing_model_validates(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SharingModel(**kwargs)


# ---------------------------------------------------------------------------- arrivals


def test_gamma_arrivals_mean_rate_and_burstiness() -> None:
    rate, n = 8.0, 40_000
    cvs = {}
    for burstiness in (0.25, 1.0, 4.0):
        arrivals = gamma_arrivals(rate, n, burstiness, seed=3)
        assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) >= 0)
        assert (n - 1) / arrivals[-1] == pytest.approx(rate, rel=0.05)
        gaps = np.diff(arrivals)
        cvs[burstiness] = gaps.std() / gaps.mean()
        assert cvs[burstiness] == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)
    assert cvs[0.25] > cvs[1.0] > cvs[4.0]


def test_gamma_arrivals_seeded_and_validated() -> None:
    assert np.array_equal(gamma_arrivals(2.0, 50, seed=1), gamma_arrivals(2.0, 50, seed=1))
    assert not np.array_equal(gamma_arrivals(2.0, 50, seed=1), gamma_arrivals(2.0, 50, seed=2))
    assert np.array_equal(gamma_arrivals(math.inf, 4), np.zeros(4))
    assert len(gamma_arrivals(1.0, 0)) == 0
    for bad in ({"rate_rps": 0.0}, {"burstiness": 0.0}, {"n": -1}):
        args = {"rate_rps": 1.0, "n": 3, "burstiness": 1.0} | bad
        with pytest.raises(ValueError):
            gamma_arrivals(**args)


def test_synthetic_requests_follow_their_distributions() -> None:
    prompt = LengthDistribution(median=800, sigma=1.0, min_tokens=64, max_tokens=4096)
    output = LengthDistribution(median=32)
    requests = synthetic_requests(
        2000, rate_rps=10.0, burstiness=0.5, prompt=prompt, output=output, seed=4
    )
    lengths = np.array([r.prompt_tokens for r in requests])
    assert lengths.min() >= 64 and lengths.max() <= 4096
    assert np.median(lengths) == pytest.approx(800, rel=0.1)
    assert {r.output_tokens for r in requests} == {32}
    assert [r.arrival_s for r in requests] == list(gamma_arrivals(10.0, 2000, 0.5, seed=4))
    again = synthetic_requests(
        2000, rate_rps=10.0, burstiness=0.5, prompt=prompt, output=output, seed=4
    )
    assert again == requests
    assert len({r.token_ids[:16].tobytes() for r in requests}) == len(requests)


# ---------------------------------------------------------------------------- bounds


def test_bound_mix_parses_and_assigns_exact_shares() -> None:
    mix = BoundMix.parse("5:0.2, 30:0.5,NONE:0.3")
    assert mix.bounds == (5.0, 30.0, None)
    drawn = mix.draw(1000, seed=1)
    assert Counter(drawn) == {5.0: 200, 30.0: 500, None: 300}
    assert drawn == mix.draw(1000, seed=1) != mix.draw(1000, seed=2)
    requests = synthetic_requests(
        10, rate_rps=1.0, prompt=LengthDistribution(10), output=LengthDistribution(2)
    )
    bounded = mix.assign(requests, seed=1)
    assert [r.max_queue_wait_s for r in bounded] == mix.draw(10, seed=1)
    assert [r.request_id for r in bounded] == [r.request_id for r in requests]


@pytest.mark.parametrize(
    "text",
    ["", "5", "5:0.5,30", "x:1", "5:abc", "5:0.5,30:0.4", "-5:1", "5:0.5,5:0.5", "none:1.5"],
)
def test_bound_mix_rejects_bad_text(text: str) -> None:
    with pytest.raises(ValueError):
        BoundMix.parse(text)


@settings(max_examples=50, deadline=None)
@given(
    raw=st.lists(st.integers(min_value=0, max_value=100), min_size=1, max_size=5).filter(
        lambda ws: sum(ws) > 0
    ),
    n=st.integers(min_value=0, max_value=500),
)
def test_bound_mix_counts_are_within_one_of_the_share(raw: list[int], n: int) -> None:
    weights = tuple(w / sum(raw) for w in raw)
    bounds = tuple(float(i + 1) for i in range(len(raw)))
    counts = Counter(BoundMix(bounds, weights).draw(n, seed=0))
    assert sum(counts.values()) == n
    for bound, weight in zip(bounds, weights, strict=True):
        assert abs(counts[bound] - weight * n) < 1


@pytest.mark.parametrize("ids", [[-5], [1 << 64], [1 << 40]])
def test_a_mooncake_block_id_out_of_range_is_a_format_error(tmp_path: Path, ids: list[int]) -> None:
    """-5 and 2^64 were OverflowError tracebacks; 2^40 and above aliased another domain."""
    path = tmp_path / "bad.jsonl"
    row = {"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": ids}
    path.write_bytes(msgspec.json.encode(row) + b"\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:1: .*hash_ids"):
        load_mooncake(path)


def test_a_missing_mooncake_trace_is_a_format_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no-such"):
        load_mooncake(tmp_path / "no-such.jsonl")


def test_an_empty_azure_cell_is_a_format_error_naming_the_line(tmp_path: Path) -> None:
    """Was: "cannot convert float NaN to integer", naming nothing."""
    path = tmp_path / "az.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,,19\n")  # fmt: skip
    with pytest.raises(TraceFormatError, match=r"az\.csv:3: an empty ContextTokens cell"):
        load_azure(path)


def test_mooncake_rows_without_hash_ids_share_nothing(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 700, "output_length": 3},
            {"timestamp": 5, "input_length": 700, "output_length": 3}]  # fmt: skip
    a, b = load_mooncake(write_jsonl(tmp_path / "plain.jsonl", rows))
    assert a.prompt_tokens == b.prompt_tokens == 700 and a.arrival_s == 0.0
    assert len(a.token_ids) == 700 and not np.array_equal(a.token_ids[:16], b.token_ids[:16])
    assert a.conversation_id != b.conversation_id


def test_a_mooncake_format_trace_of_another_block_size_is_read_with_it(tmp_path: Path) -> None:
    """Traces written in Mooncake's format with 16-token hash ids (a generator's choice):
    the block size every row agrees on is used, so shared ids still share tokens."""
    rows = [{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1, 2, 3]},
            {"timestamp": 9, "input_length": 33, "output_length": 2,
             "hash_ids": [1, 2, 4]}]  # fmt: skip
    a, b = load_mooncake(write_jsonl(tmp_path / "b16.jsonl", rows))
    assert a.segment_lengths == (16, 16, 8) and b.segment_lengths == (16, 16, 1)
    assert shares_prefix(a.token_ids, b.token_ids, 32)
    assert not shares_prefix(a.token_ids, b.token_ids, 33)


BURSTGPT_CSV = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5.0,ChatGPT,472,18,490,Conversation log
3.5,GPT-4,1020,0,1020,Conversation log
7.25,ChatGPT,300,40,340,API log
"""


@pytest.mark.parametrize(("text", "expected"), [
    (BURSTGPT_CSV, [(0.0, 472, 18), (2.25, 300, 40)]),  # a failed request (0 out) left out
    ("timestamp,input_length,output_length\n1000,10,2\n1500,20,3\n",
     [(0.0, 10, 2), (500.0, 20, 3)]),
    ("arrival_time_ms,prompt_tokens,completion_tokens\n1000,10,2\n1500,20,3\n",
     [(0.0, 10, 2), (0.5, 20, 3)]),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n"  # ISO-8601 with a zone (not Azure 2023's)
     "2024-05-10T00:00:01.500+00:00,10,2\n2024-05-10T00:00:00+00:00,20,3\n",
     [(0.0, 20, 3), (1.5, 10, 2)]),
])  # fmt: skip
def test_other_csv_traces_are_read_by_their_columns(
    tmp_path: Path, text: str, expected: list[tuple[float, int, int]]
) -> None:
    path = tmp_path / "t.csv"
    path.write_text(text)
    got = load_azure(path, sharing=SharingModel.none())
    assert [(round(r.arrival_s, 6), r.prompt_tokens, r.output_tokens) for r in got] == expected


def test_a_csv_time_that_is_not_a_time_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00,1,1\nsoon,1,1\n")
    with pytest.raises(TraceFormatError, match=r"t\.csv:3"):
        load_azure(path)


def test_absolute_mooncake_times_start_at_zero_and_huge_prompts_are_refused(
    tmp_path: Path,
) -> None:
    rows = [{"timestamp": 1_700_000_000_500, "input_length": 600, "output_length": 3},
            {"timestamp": 1_700_000_000_000, "input_length": 600, "output_length": 3}]  # fmt: skip
    a, b = load_mooncake(write_jsonl(tmp_path / "abs.jsonl", rows))
    assert (a.arrival_s, b.arrival_s) == (0.0, 0.5)  # not 54 years of waiting in `load`
    huge = [{"timestamp": 0, "input_length": 10**12, "output_length": 3}]
    with pytest.raises(TraceFormatError, match=r"huge\.jsonl:1"):
        load_mooncake(write_jsonl(tmp_path / "huge.jsonl", huge))


def test_csv_paths_are_files_not_patterns(tmp_path: Path) -> None:
    path = tmp_path / "real[1].csv"
    path.write_text(AZURE_CSV)
    assert len(load_azure(path, sharing=SharingModel.none())) == 3
    with pytest.raises(TraceFormatError, match="directory"):
        load_azure(tmp_path)


@pytest.mark.parametrize(("text", "expected"), [
    ("timestamp,input_length,output_length\n1715299200.25,100,10\n1715299201.75,200,20\n",
     [0.0, 1.5]),  # epoch seconds (was: "1715299200.25 is not finite or past 3.16224e+07")
    ("timestamp_ms,prompt_tokens,completion_tokens\n1715299200250,100,10\n1715299201750,200,20\n",
     [0.0, 1.5]),
])  # fmt: skip
def test_epoch_csv_times_are_read_from_the_first(
    tmp_path: Path, text: str, expected: list[float]
) -> None:
    path = tmp_path / "epoch.csv"
    path.write_text(text)
    got = load_azure(path, sharing=SharingModel.none())
    assert [r.arrival_s for r in got] == pytest.approx(expected)


def test_blank_lines_in_a_csv_are_skipped(tmp_path: Path) -> None:
    """Was: "an empty TIMESTAMP cell" for a blank line (a trailing CRLF CRLF, a gap)."""
    path = tmp_path / "blank.csv"
    path.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
                     b"2023-11-16 18:15:46.6805900,374,44\r\n\r\n"
                     b"2023-11-16 18:15:50.9951690,396,109\r\n\r\n")  # fmt: skip
    got = load_azure(path, sharing=SharingModel.none())
    assert [(round(r.arrival_s, 4), r.prompt_tokens) for r in got] == [(0.0, 374), (4.3146, 396)]


def test_a_csv_column_whose_form_changes_late_is_read(tmp_path: Path) -> None:
    """Integer seconds for 10,000 rows, then a fraction: was polars' multi-line schema
    error (it guessed the column's type from the first 10,000 rows)."""
    path = tmp_path / "late.csv"
    rows = [f"{i if i < 10_002 else i + 0.5},ChatGPT,100,10,110,API log" for i in range(10_004)]
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    + "\n".join(rows) + "\n")  # fmt: skip
    got = load_azure(path, sharing=SharingModel.none())
    assert len(got) == 10_004 and got[-1].arrival_s == pytest.approx(10_003.5)


@pytest.mark.parametrize(("cells", "match"), [
    ("10.7,3", r"t\.csv:3: ContextTokens 10\.7 is not a whole number"),  # was: 10 tokens
    ("-10,3", r"t\.csv:3: ContextTokens -10 is not a whole number"),  # was: left out
    ("n/a,3", r"t\.csv:3: ContextTokens 'n/a' is not a number"),
    ("10,3,extra", r"t\.csv: found more fields"),  # was several lines of polars advice
])  # fmt: skip
def test_bad_csv_cells_are_one_line_errors_naming_the_line(
    tmp_path: Path, cells: str, match: str
) -> None:
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,"
                    f"374,44\n2023-11-16 18:15:47.0,{cells}\n")  # fmt: skip
    with pytest.raises(TraceFormatError, match=match) as info:
        load_azure(path)
    assert "\n" not in str(info.value)


def test_a_csv_limit_counts_requests_not_failed_rows(tmp_path: Path) -> None:
    """BurstGPT logs failures with 0 tokens: --limit 3 was 1 request for this file."""
    path = tmp_path / "burst.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "5,ChatGPT,472,18,490,Conversation log\n6,ChatGPT,0,0,0,API log\n"
                    "7,ChatGPT,10,0,10,API log\n8,GPT-4,417,464,881,Conversation log\n"
                    "9,GPT-4,300,40,340,API log\n10,GPT-4,30,4,34,API log\n")  # fmt: skip
    got = load_azure(path, limit=3, sharing=SharingModel.none())
    assert [(r.arrival_s, r.prompt_tokens) for r in got] == [(0.0, 472), (3.0, 417), (4.0, 300)]


def test_a_splitwise_simulator_trace_is_read(tmp_path: Path) -> None:
    """Splitwise's simulator traces name their columns arrival_timestamp, prompt_size and
    token_size (were refused: no arrival time column)."""
    path = tmp_path / "splitwise.csv"
    header = "request_id,request_type,application_id,arrival_timestamp,batch_size,prompt_size"
    path.write_text(header + ",token_size\n0,2,0,0.5,1,1020,32\n1,2,0,1.25,1,355,9\n")
    got = load_azure(path, sharing=SharingModel.none())
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in got] == [
        (0.0, 1020, 32), (0.75, 355, 9)]  # fmt: skip
