"""Two writers of one state file at once (the snapshot timer in a thread, the shutdown hook
on the event loop) shared one temporary name: the second rename found nothing, the
shutdown hook raised and the worker hung on SIGTERM."""

from __future__ import annotations

import threading
from pathlib import Path

from foretoken.adapters.files import write_atomically


def test_concurrent_writers_of_one_file_never_fail(tmp_path: Path) -> None:
    path = tmp_path / "fits.snapshot"
    errors: list[BaseException] = []

    def writer(tag: bytes) -> None:
        for _ in range(200):
            try:
                write_atomically(path, tag * 1000)
            except BaseException as exc:
                errors.append(exc)

    threads = [threading.Thread(target=writer, args=(bytes([65 + i]),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    data = path.read_bytes()
    assert len(data) == 1000 and len(set(data)) == 1  # one writer's whole file
    assert [p.name for p in tmp_path.iterdir()] == ["fits.snapshot"]  # no temporary left
