"""systemd's notify protocol (``Type=notify``), without a C library.

``READY=1`` is sent when ``/ready`` would answer 200, ``STATUS=`` lines
describe loading and draining, ``STOPPING=1`` starts the drain, and
``WATCHDOG=1`` is sent from the trio loop every half watchdog interval, so a
wedged event loop gets the service restarted. Without ``$NOTIFY_SOCKET``
(not under systemd) every call is a no-op.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import trio


def _address() -> str | None:
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return None
    return "\0" + path[1:] if path.startswith("@") else path  # '@': abstract namespace


def notify(*lines: str) -> bool:
    """Send ``lines`` (e.g. "READY=1", "STATUS=warming up") to systemd."""
    address = _address()
    if address is None:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.sendto("\n".join(lines).encode(), address)
        except OSError:
            return False  # systemd went away: nothing useful to do about it
    return True


def watchdog_interval() -> float | None:
    """Half the watchdog timeout systemd asked for, in seconds; None if none."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None


async def watchdog(alive: Callable[[float], bool]) -> None:
    """Ping systemd while ``alive(timeout)`` says the service works (the event
    loop runs this, and the step loop has looped within the timeout)."""
    interval = watchdog_interval()
    if interval is None or _address() is None:
        return
    while True:
        if alive(2 * interval):
            notify("WATCHDOG=1")
        await trio.sleep(interval)
