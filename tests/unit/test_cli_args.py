"""The command's arguments are checked before any work (a benchmark of minutes used to end
in a traceback when its --json could not be written; --speedup 0 silently ran at 1)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner, Result

from foretoken.cli import app

runner = CliRunner()


def _said(result: Result) -> str:
    return " ".join(result.output.split())  # the console wraps long lines


def test_an_output_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path) -> None:
    result = runner.invoke(app, ["bench", "predict", "--trace", "mooncake", "--fleet", "small",
                                 "--json", str(tmp_path / "no" / "such" / "x.json")])  # fmt: skip
    assert result.exit_code == 2 and "cannot write a file there" in _said(result)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    result = runner.invoke(app, ["replay", "--limit", "5", "--out", str(a_file)])
    assert result.exit_code == 2 and "cannot write a directory there" in _said(result)


def test_a_zero_or_negative_rate_is_refused_not_replaced() -> None:
    for args in (["replay", "--speedup", "0"], ["replay", "--capacity-factor", "-1"],
                 ["replay", "--limit", "0"], ["load", "--url", "http://x", "--model", "m",
                                              "--speedup", "0"]):  # fmt: skip
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "must be > 0" in _said(result), args
    result = runner.invoke(app, ["load", "--url", "notaurl", "--model", "m"])
    assert result.exit_code == 2 and "--url must start with http" in _said(result)


def test_a_lake_that_is_not_there_is_an_error_not_an_empty_report(tmp_path: Path) -> None:
    for args in (["report", "--lake", str(tmp_path / "typo")],
                 ["sql", "select 1", "--lake", str(tmp_path / "typo")]):  # fmt: skip
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "no such directory" in _said(result), args
    result = runner.invoke(app, ["dashboard", "--lake", str(tmp_path), "--port", "99999"])
    assert result.exit_code == 2 and "--port must be within" in _said(result)


def test_a_port_another_process_holds_is_one_line_before_the_service_starts() -> None:
    import socket

    from foretoken.adapters.processes import port_taken

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        said = port_taken("127.0.0.1", port)
        assert said is not None and f"127.0.0.1:{port}" in said and "in use" in said
    assert port_taken("127.0.0.1", port) is None  # free again
    result = runner.invoke(app, ["fleet", "run", "small", "--time-scale", "0"])
    assert result.exit_code == 2 and "--time-scale must be > 0" in _said(result)


def test_bad_trace_files_and_lakes_are_one_error_line(tmp_path: Path) -> None:
    """From an audit of files never shown to us: each was a traceback, a hang or exit 0."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    nan = tmp_path / "nan.csv"
    nan.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00,NaN,3\n")
    odd = tmp_path / "x[/b]" / "t.jsonl"  # rich markup in a path
    cases = [
        (["replay", "--trace", str(empty), "--fleet", "small"], "no request in it"),
        (["replay", "--trace", str(nan), "--fleet", "small"], "ContextTokens nan is not finite"),
        (["replay", "--trace", str(tmp_path), "--fleet", "small"], "unknown trace"),
        (["replay", "--trace", str(odd), "--fleet", "small"], "x[/b]"),
    ]
    lake = tmp_path / "lake" / "graded" / "hour=2026-01-01T00"
    lake.mkdir(parents=True)
    (lake / "part-1.parquet").write_bytes(b"not a parquet file")
    cases += [(["report", "--lake", str(tmp_path / "lake")], "--lake"),
              (["sql", "--lake", str(tmp_path / "lake"), "select 1"], "--lake")]  # fmt: skip
    for args, said in cases:
        result = runner.invoke(app, args)
        assert result.exit_code in (1, 2) and "error:" in result.output, (args, result.output)
        assert said in _said(result) and "Traceback" not in result.output, args
    result = runner.invoke(app, ["router", "-e", str(empty), "--port", "70000"])
    assert result.exit_code == 2 and "--port must be within" in _said(result)


def test_traces_dir_of_a_settings_file_is_where_named_traces_are_read(tmp_path: Path) -> None:
    """It was read from the environment only: the file's setting was shown, then ignored.
    A trace with a byte order mark is read as without it."""
    import os

    from foretoken.sim.traces import MOONCAKE_FILE, TRACES_DIR_ENV

    row = b'{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
    (tmp_path / MOONCAKE_FILE).write_bytes(b"\xef\xbb\xbf" + row)
    config = tmp_path / "s.toml"
    config.write_text(f'traces_dir = "{tmp_path}"\n')
    before = os.environ.pop(TRACES_DIR_ENV, None)
    try:
        args = ["replay", "--trace", "mooncake", "--fleet", "small", "--no-progress"]
        result = runner.invoke(app, [*args, "-c", str(config)])
        assert result.exit_code == 0, result.output
        assert '"requests": 1' in result.stdout
    finally:
        os.environ.pop(TRACES_DIR_ENV, None)
        if before is not None:
            os.environ[TRACES_DIR_ENV] = before
