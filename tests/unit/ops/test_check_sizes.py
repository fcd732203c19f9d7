"""``make lint``'s file-size check (foretoken/ops/check_sizes.py) on a scratch git repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from foretoken.ops.check_sizes import MAX_LINES, main, oversized


def _write_lines(path: Path, count: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"line {i}\n" for i in range(count)))


def _repository(root: Path, files: dict[str, int]) -> None:
    """A git repository at ``root`` tracking ``files`` (path → line count)."""
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    for name, count in files.items():
        _write_lines(root / name, count)
    subprocess.run(["git", "add", "--", *files], cwd=root, check=True)


def test_only_the_long_file_is_reported(tmp_path: Path) -> None:
    _repository(tmp_path, {"pkg/long.py": MAX_LINES + 1, "native/short.rs": MAX_LINES})
    assert oversized(tmp_path) == [("pkg/long.py", MAX_LINES + 1)]


def test_untracked_files_and_other_kinds_are_not_checked(tmp_path: Path) -> None:
    _repository(tmp_path, {"docs/long.md": 2 * MAX_LINES, "ops/run.sh": 3})
    _write_lines(tmp_path / "scratch.py", 2 * MAX_LINES)  # not tracked
    assert oversized(tmp_path) == []


def test_main_prints_the_offenders_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _repository(tmp_path, {"a.sql": MAX_LINES + 5, "b.sh": 10})
    assert main(["--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"a.sql: {MAX_LINES + 5} lines" in out and "b.sh" not in out
    _write_lines(tmp_path / "a.sql", MAX_LINES)
    assert main(["--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out == ""
