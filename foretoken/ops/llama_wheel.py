"""Build llama-cpp-python's wheel from PyPI once, cache it, install it (the ``llama`` extra).

llama-cpp-python ships as an sdist that compiles llama.cpp (minutes on a small machine), so
the wheel is built once into ``$FORETOKEN_CACHE_DIR/wheels/llama-cpp-python-<version>-<key>``
(default cache dir ``~/.cache/foretoken``), keyed by the version and the build flags, and
every later install takes it from there. Flags shorten the build: no examples, tests or
tools; ``GGML_NATIVE=OFF`` keeps the wheel valid on any x86-64 machine with AVX2.

    python ops/llama_wheel.py               # build if not cached, install into this Python
    python ops/llama_wheel.py --background  # the same, detached (log: .run/llama-wheel.log)
    python ops/llama_wheel.py --background --build-only  # only the wheel, detached
    python ops/llama_wheel.py --check       # exit 0 iff installed at the pinned version
    python ops/llama_wheel.py --build-only

One build at a time: a file lock in the cache directory; :func:`ensure_installed` (the
integration test's fixture) waits for a build in progress — e.g. the one ``make test``
starts in the background so that it overlaps the unit suite — then installs if needed.

Run it with the project's venv Python (``make llama`` does): it installs into
``sys.executable``'s environment.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# Keep in step with the ``llama`` extra in pyproject.toml.
VERSION = "0.3.16"
GGUF_VERSION = "0.17.1"
# No multimodal library (LLAVA_BUILD: mtmd, ~20% of the build's CPU; the server loads it only
# for a chat handler with a vision model, which the engines here never use).
CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAVA_BUILD=OFF"
)
PACKAGE = "llama-cpp-python"
BACKGROUND_LOG = Path(".run/llama-wheel.log")
LOCK_POLL_S = 2.0


def cache_dir() -> Path:
    base = os.environ.get("FORETOKEN_CACHE_DIR") or "~/.cache/foretoken"
    return Path(base).expanduser() / "wheels"


def wheel_dir(version: str = VERSION, cmake_args: str = CMAKE_ARGS) -> Path:
    key = hashlib.sha256(f"{version}|{cmake_args}|{sys.version_info[:2]}".encode()).hexdigest()
    return cache_dir() / f"{PACKAGE}-{version}-{key[:12]}"


def cached_wheel(directory: Path) -> Path | None:
    wheels = sorted(directory.glob("llama_cpp_python-*.whl"))
    return wheels[-1] if wheels else None


def installed_version() -> str | None:
    """llama-cpp-python's version, if it is installed with what its server and our model
    writer need; else None."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("llama_cpp_python")
    except PackageNotFoundError:
        return None
    needed = ("uvicorn", "fastapi", "sse_starlette", "pydantic_settings", "gguf")
    return found if all(importlib.util.find_spec(m) for m in needed) else None


def build(directory: Path) -> Path:
    """``pip wheel`` from the PyPI sdist into a temporary dir, then move into the cache."""
    directory.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "CMAKE_ARGS": CMAKE_ARGS,
        "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2),
    }
    started = time.monotonic()
    print(f"building {PACKAGE}=={VERSION} (CMAKE_ARGS={CMAKE_ARGS}); this takes minutes",
          flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(dir=directory.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-binary", PACKAGE,
               "-w", tmp, f"{PACKAGE}=={VERSION}"]  # fmt: skip
        subprocess.run(cmd, env=env, check=True)
        built = sorted(Path(tmp).glob("llama_cpp_python-*.whl"))
        if not built:
            raise RuntimeError("pip wheel produced no llama_cpp_python wheel")
        target = directory / built[-1].name
        shutil.move(str(built[-1]), target)  # same filesystem: an atomic rename
    print(f"built {target.name} in {time.monotonic() - started:.0f} s", flush=True)
    return target


def install(directory: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--find-links", str(directory),
           "--only-binary", PACKAGE, f"{PACKAGE}[server]=={VERSION}",
           f"gguf=={GGUF_VERSION}"]  # fmt: skip
    subprocess.run(cmd, check=True)


@contextlib.contextmanager
def build_lock(timeout_s: float) -> Iterator[None]:
    """Exclusive lock on the wheel cache (waits for another build, up to ``timeout_s``)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with (cache_dir() / f".{PACKAGE}.lock").open("w") as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as exc:
                if time.monotonic() > deadline:
                    msg = f"another {PACKAGE} build held the lock > {timeout_s} s"
                    raise TimeoutError(msg) from exc
                time.sleep(LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_installed(timeout_s: float = 3600.0) -> str:
    """Build (once, cached) and install the pinned version unless it is installed; waits
    for a build already running. Returns the installed version."""
    with build_lock(timeout_s):
        importlib.invalidate_caches()
        if installed_version() != VERSION:
            directory = wheel_dir()
            if cached_wheel(directory) is None:
                build(directory)
            install(directory)
            importlib.invalidate_caches()
    found = installed_version()
    if found != VERSION:
        raise RuntimeError(f"{PACKAGE} {VERSION} still not importable after install")
    return found


def start_background(build_only: bool = False) -> None:
    """Detach a build+install (if one is needed) and return at once. The build runs at the
    lowest CPU priority: the suites it overlaps have real-time parts (simulated engines whose
    measured TTFTs the fits learn from) that must not be slowed down by a compiler.

    ``build_only``: only the wheel, into the cache (``make test`` starts it before the rest of
    the set-up, whose pip installs into the same venv must not race an install; the install
    comes later, from a second call, after waiting for this build's lock)."""
    if installed_version() == VERSION or (build_only and cached_wheel(wheel_dir())):
        return
    BACKGROUND_LOG.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "foretoken.ops.llama_wheel"]
    cmd += ["--build-only"] if build_only else []
    with BACKGROUND_LOG.open("ab") as log:
        subprocess.Popen(cmd, stdout=log,
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True, preexec_fn=lambda: os.nice(19))  # fmt: skip
    print(f"{PACKAGE}: building in the background (log: {BACKGROUND_LOG})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether it is installed")
    parser.add_argument("--build-only", action="store_true", help="build (or find) the wheel")
    parser.add_argument("--print-dir", action="store_true", help="print the cache directory")
    parser.add_argument("--background", action="store_true", help="detach; log to .run/")
    args = parser.parse_args(argv)
    directory = wheel_dir()
    if args.print_dir:
        print(directory)
        return 0
    if args.check:
        return 0 if installed_version() == VERSION else 1
    if args.background:
        start_background(build_only=args.build_only)
        return 0
    if args.build_only:
        with build_lock(3600.0):
            print(cached_wheel(directory) or build(directory))
        return 0
    print(f"{PACKAGE} {ensure_installed()} installed (wheels: {directory})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
