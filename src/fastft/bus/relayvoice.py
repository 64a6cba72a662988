"""A worker's side of its node's voice (:mod:`fastft.runtime.engine.voice`), over its bus
relay's socket (:class:`~fastft.bus.relayed.RelayedTransport`): the
:class:`~fastft.runtime.engine.voice.VoicePort` its survivors ask.

Requests up the socket and answers down it are JSON:

* ``{"op": "arrive", "epoch": E, "rank": r, "arrival": "..."}``, answered
  ``{"op": "first", "epoch": E, "rank": r, "first": bool}`` once the agent wrote it;
* ``{"op": "wait", "epoch": E, "wait_s": s}``, answered ``{"op": "closed", "epoch": E,
  "change": "..." | null}`` when the epoch closed (its change of the epoch before) or the
  agent's wait ran out (null).

An arrival the agent does not answer within :data:`ANSWER_S` is written by the worker
itself (the counter may then count it twice: the closer reads the keys again when the
count changes, so a count too high costs a read, never a member).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from fastft.bus.relay import VOICE

__all__ = ["ANSWER_S", "RelayVoice", "answer", "request"]

log = logging.getLogger(__name__)

ANSWER_S = 0.5
"""How long a worker waits for its agent to write its arrival."""
_SLICE_S = 0.05


def request(**fields: Any) -> bytes:
    return json.dumps(fields, separators=(",", ":")).encode()


def answer(**fields: Any) -> bytes:
    return VOICE + json.dumps(fields, separators=(",", ":")).encode()


_NOTHING = object()
"""No answer yet."""
_RAN_OUT = object()
"""The agent's wait for the epoch ran out."""


class RelayVoice:
    """The port over ``transport`` (a :class:`~fastft.bus.relayed.RelayedTransport`)."""

    def __init__(self, transport: Any, answer_s: float = ANSWER_S) -> None:
        self.t = transport
        self.answer_s = answer_s
        self._cv = threading.Condition()
        self._first: dict[tuple[int, int], bool] = {}
        self._closed: dict[int, object] = {}
        self.bad = 0
        """Answers that could not be read (logged, counted, not acted on)."""
        transport.on_voice = self._on_answer

    def arrive(self, epoch: int, rank: int, arrival: str) -> bool | None:
        key = (epoch, rank)
        with self._cv:
            self._first.pop(key, None)
        if not self.t.send_up(request(op="arrive", epoch=epoch, rank=rank, arrival=arrival)):
            return None
        got = self._await(lambda: self._first.pop(key, _NOTHING), self.answer_s)
        return None if got is _NOTHING else bool(got)

    def closed(self, epoch: int, timeout_s: float) -> tuple[bool, bytes | None]:
        with self._cv:
            self._closed.pop(epoch, None)
        if not self.t.send_up(request(op="wait", epoch=epoch, wait_s=timeout_s)):
            return False, None
        got = self._await(lambda: self._closed.pop(epoch, _NOTHING), timeout_s + self.answer_s)
        if isinstance(got, str):
            return True, got.encode()
        return got is _RAN_OUT, None  # (no answer, or the agent went away: wait yourself)

    def _await(self, take: Any, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                got = take()
                if got is not _NOTHING:
                    return got
                left = deadline - time.monotonic()
                if left <= 0 or not self.t.is_member():
                    return _NOTHING
                self._cv.wait(min(left, _SLICE_S))

    def _on_answer(self, raw: bytes) -> None:
        try:
            got = json.loads(raw)
            op, epoch = got["op"], int(got["epoch"])
            if op == "first":
                rank, first = int(got["rank"]), bool(got["first"])
            elif op == "closed":
                change = got.get("change")
            else:
                raise ValueError(f"unknown op {op!r}")
        except (ValueError, KeyError, TypeError) as e:
            self.bad += 1
            log.warning("node voice: an answer that does not read (%s): dropped", e)
            return
        with self._cv:
            if op == "first":
                self._first[(epoch, rank)] = first
            else:  # (a change is JSON text; anything else: the agent's wait ran out)
                self._closed[epoch] = change if isinstance(change, str) else _RAN_OUT
            self._cv.notify_all()
