"""Which TCP ports a set of processes listens on, and on which address, from /proc/net/tcp
and /proc/net/tcp6 (what `ss -ltnp` reads), for the bind-address tests."""

from __future__ import annotations

import ipaddress
import os
import struct
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"
WILDCARDS = ("0.0.0.0", "::")


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    pid: int

    @property
    def wildcard(self) -> bool:
        return self.address in WILDCARDS or self.address.startswith("::ffff:0.0.0.0")


def descendants(roots: set[int]) -> set[int]:
    """``roots`` and every process below them."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found = set(roots)
    grew = True
    while grew:
        more = {pid for pid, ppid in parent.items() if ppid in found and pid not in found}
        found |= more
        grew = bool(more)
    return found


def _socket_inodes(pids: set[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                out[int(target[8:-1])] = pid
    return out


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(struct.pack("<I", struct.unpack(">I", raw)[0])))
    words = struct.unpack(">4I", raw)
    return str(ipaddress.IPv6Address(b"".join(struct.pack("<I", w) for w in words)))


def listeners(pids: set[int]) -> list[Listener]:
    """Every listening TCP socket held by one of ``pids``."""
    inodes = _socket_inodes(pids)
    found: list[Listener] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            inode = int(fields[9])
            if inode in inodes:
                addr, port = fields[1].split(":")
                found.append(Listener(_address(addr), int(port, 16), inodes[inode]))
    return found


def listening_on_port(port: int) -> list[Listener]:
    """Every listening socket on ``port``, whoever holds it (pid 0: not ours to see)."""
    out: list[Listener] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            addr, hex_port = fields[1].split(":")
            if fields[3] == LISTEN and int(hex_port, 16) == port:
                out.append(Listener(_address(addr), port, 0))
    return out
