"""House rule 7's file-size limit, checked by ``make lint``: no git-tracked source file
(``*.py``, ``*.rs``, ``*.sql``, ``*.sh``) over 600 lines.

    python -m foretoken.ops.check_sizes              # the repository of the working directory
    python -m foretoken.ops.check_sizes --root DIR   # the tracked files under DIR

Prints every file over the limit with its line count and exits 1; prints nothing and exits
0 when all fit. A file is split by role when it grows past the limit (docs/CONVENTIONS.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

MAX_LINES = 600
# git pathspecs: a "*" also matches "/", so each one matches at any depth.
PATTERNS = ("*.py", "*.rs", "*.sql", "*.sh")


def tracked_sources(root: Path) -> list[str]:
    """The git-tracked files under ``root`` that match :data:`PATTERNS`, relative to it."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", *PATTERNS],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout
    return [name for name in listed.decode().split("\0") if name]


def line_count(path: Path) -> int:
    """Lines as ``wc -l`` counts them, plus a last line that lacks its newline."""
    data = path.read_bytes()
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def oversized(root: Path, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(path, lines) of each tracked source under ``root`` over ``limit`` lines, by path."""
    found = []
    for name in tracked_sources(root):
        path = root / name
        if not path.is_file():  # tracked but deleted in the working tree: nothing to measure
            continue
        lines = line_count(path)
        if lines > limit:
            found.append((name, lines))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="where to look (a checkout)")
    args = parser.parse_args(argv)
    found = oversized(args.root)
    if not found:
        return 0
    print(f"files over {MAX_LINES} lines (house rule 7: split them by role):")
    for name, lines in found:
        print(f"  {name}: {lines} lines")
    return 1


if __name__ == "__main__":
    sys.exit(main())
