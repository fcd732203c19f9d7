"""Checks of the ``foretoken`` command's arguments made before any work: a run of minutes
used to end in a traceback when its output could not be written, and a 0 that a default
silently replaced ran something else than asked."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from foretoken.settings import Settings, SettingsError, load_settings

T = TypeVar("T")

_console = Console(stderr=True)


def usable_output(path: str | None, option: str, *, directory: bool = False) -> None:
    """Exit 2 with one line unless ``path`` can be written: a file in an existing writable
    directory, or a directory that exists or can be made."""
    if path is None:
        return
    target = Path(path).expanduser()
    if directory:
        try:
            target.mkdir(parents=True, exist_ok=True)
            ok = os.access(target, os.W_OK)
        except OSError:
            ok = False
    else:
        parent = target.parent
        ok = not target.is_dir() and parent.is_dir() and os.access(parent, os.W_OK)
    if not ok:
        kind = "a directory" if directory else "a file"
        _say(f"{option} {path}: cannot write {kind} there")
        raise typer.Exit(2)


def positive(*options: tuple[str, float | None]) -> None:
    """Exit 2 with one line unless every (option, value) given is > 0."""
    for option, value in options:
        if value is not None and not value > 0:
            _say(f"{option} must be > 0, got {value}")
            raise typer.Exit(2)


def existing_dir(path: str, option: str) -> None:
    """Exit 2 with one line unless ``path`` is a directory (a typo used to print an empty
    report with exit 0, as if the lake held no request)."""
    if not Path(path).expanduser().is_dir():
        _say(f"{option} {path}: no such directory")
        raise typer.Exit(2)


def port(option: str, value: int) -> None:
    if not 1 <= value <= 65535:
        _say(f"{option} must be within 1..65535, got {value}")
        raise typer.Exit(2)


def _say(text: str) -> None:
    """One error line; ``text`` as it is (a path may hold rich's markup brackets)."""
    _console.print("[red]error:[/red] " + escape(text))


def fail(message: str, code: int = 2) -> typer.Exit:
    """Say ``message`` as the command's one-line error; the exit to raise."""
    _say(message)
    return typer.Exit(code)


def lake_call(lake: str, call: Callable[..., T], *args: object) -> T:
    """``call(*args)`` on a lake; a file in it DuckDB cannot read (corrupt, foreign
    columns) or a path it cannot take is one error line naming the lake, not a traceback."""
    import duckdb

    try:
        return call(*args)
    except (duckdb.Error, ValueError) as exc:
        raise fail(f"--lake {lake}: {exc}".split("\n")[0][:500]) from exc


def settings_or_exit(config: str | None) -> Settings:
    """The settings, or exit 2 with one line; a ``traces_dir`` set in the file reaches the
    trace loaders too (they read ``$FORETOKEN_TRACES_DIR``)."""
    from foretoken.sim.traces import TRACES_DIR_ENV

    try:
        settings = load_settings(config)
    except SettingsError as exc:
        raise fail(str(exc)) from exc
    if settings.traces_dir:
        os.environ[TRACES_DIR_ENV] = os.path.expanduser(settings.traces_dir)
    return settings


def floats(text: str | None, name: str) -> tuple[float, ...]:
    """Comma-separated numbers (none: empty)."""
    if not text:
        return ()
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise typer.BadParameter(f"{name}: comma-separated numbers, got {text!r}") from exc
