"""A connection's clocks, as values: when its preface, the SETTINGS ACK, keepalive and idle timeouts
are due. ``Timers.due`` says what is due at a time; ``machine.Machine.tick`` acts on it."""

from __future__ import annotations

from enum import Enum

from .wire import Limits


class Due(Enum):
    PREFACE_LATE = "preface_timeout"  # no client preface in time: the connection fails
    SETTINGS_LATE = "settings_timeout"  # our SETTINGS not acknowledged in time: fails
    SILENT = "keepalive_timeout"  # silent past keepalive_time + keepalive_timeout: fails
    PING = "ping"  # silent past keepalive_time: a PING
    IDLE = "idle_timeout"  # no stream for idle_timeout: the graceful GOAWAY's first frame
    FINAL_GOAWAY = "final_goaway"  # the graceful GOAWAY's PING went unanswered: its second frame


class Timers:
    __slots__ = ("idle_since", "limits", "opened", "pinged", "reads", "seen_reads", "settings_sent_at", "silent_since")

    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self.opened = self.silent_since = self.idle_since = now
        self.settings_sent_at: float | None = None
        self.pinged = False
        self.reads = 0  # reads of the peer's bytes: its sign of life
        self.seen_reads = 0

    def due(self, now: float, got_settings: bool, idle: bool, goaway_phase: int) -> list[Due]:
        """What is due at ``now``; a failure, if any, alone."""
        limits = self.limits
        if self.reads != self.seen_reads:
            self.seen_reads = self.reads
            self.silent_since = now
            self.pinged = False
        if not got_settings:
            return [Due.PREFACE_LATE] if now - self.opened > limits.preface_timeout else []
        if self.settings_sent_at is not None and now - self.settings_sent_at > limits.settings_timeout:
            return [Due.SETTINGS_LATE]
        silent = now - self.silent_since
        if self.pinged and silent > limits.keepalive_time + limits.keepalive_timeout:
            return [Due.SILENT]
        due = []
        if silent > limits.keepalive_time and not self.pinged:
            self.pinged = True
            due.append(Due.PING)
        if goaway_phase == 1 and now - self.idle_since > limits.idle_timeout + 2:
            due.append(Due.FINAL_GOAWAY)  # the PING's answer did not come: a round trip is long past
        elif not goaway_phase and idle and now - self.idle_since > limits.idle_timeout:
            due.append(Due.IDLE)
        return due
