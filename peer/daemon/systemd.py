"""systemd integration: sd_notify READY / WATCHDOG / STOPPING / STATUS (Type=notify services)."""

from __future__ import annotations

import os


class SystemdNotifier:
    """sd_notify READY / WATCHDOG / STOPPING / STATUS when run under systemd (Type=notify); no-op otherwise."""

    def __init__(self) -> None:
        self._notifier = None
        if os.environ.get("NOTIFY_SOCKET"):
            import sdnotify
            self._notifier = sdnotify.SystemdNotifier()

    def _send(self, text: str) -> None:
        if self._notifier is not None:
            self._notifier.notify(text)

    def ready(self, status: str) -> None:
        self._send(f"READY=1\nSTATUS={status}")

    def watchdog(self, status: str) -> None:
        self._send(f"WATCHDOG=1\nSTATUS={status}")

    def stopping(self) -> None:
        self._send("STOPPING=1")

    def watchdog_interval_s(self) -> float | None:
        """Half of systemd's WatchdogSec (from WATCHDOG_USEC), or None when no watchdog is armed."""
        usec = os.environ.get("WATCHDOG_USEC")
        if self._notifier is None or not usec or not usec.isdigit():
            return None
        return int(usec) / 2e6
