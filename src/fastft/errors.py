"""The one exception root of fastft.

Errors are *values* inside a step (a fault is latched and voted on) and exceptions at the
boundary. Subclasses are named after what the caller should do:

* :class:`ConfigError` -- fix the configuration (flag, environment variable, argument).
* :class:`ProtocolError` -- a message on the wire is not ours or is damaged; log and drop it.
* :class:`BusClosed` -- the bus was closed; stop using it.
* :class:`StoreUnreachable` -- the coordination store cannot be reached; check HOST:PORT.
* :class:`StoreTimeout` -- a store call's wait (a key, a queue) ran out; try again or give up.
* :class:`ControlPlaneError` -- the store holds what no member of the job wrote (a value
  without the job secret's tag); it is not applied.

Asynchronous interruption of a blocked rank is *not* a ``FastFTError``: it is
:class:`fastft.interrupt.StepInterrupted`, a ``BaseException`` so that a user's
``except Exception`` block cannot swallow it.
"""

from __future__ import annotations

__all__ = [
    "FastFTError",
    "ConfigError",
    "ProtocolError",
    "BusClosed",
    "StoreUnreachable",
    "StoreTimeout",
    "RelayUnreachable",
    "ControlPlaneError",
    "RayJobError",
]


class FastFTError(Exception):
    """Root of every error fastft raises on purpose."""


class ConfigError(FastFTError, ValueError):
    """Bad configuration: the message says which setting and what to change it to."""


class ProtocolError(FastFTError, ValueError):
    """Bytes that are not a valid fastft message for this job (truncated, foreign, bad
    version, wrong job, bad field). Receivers log and count it; it is never fatal."""


class BusClosed(FastFTError, RuntimeError):
    """The error bus endpoint was closed."""


class StoreUnreachable(FastFTError, ConnectionError):
    """The coordination store (TCPStore) at the given address did not answer."""


class StoreTimeout(FastFTError, TimeoutError):
    """A wait on the store (a key that does not exist yet, an empty queue) ran out. Raised
    by the torch-free clients; torch's own raise ``DistStoreError`` ("timeout")."""


class RelayUnreachable(FastFTError, ConnectionError):
    """The node's bus relay (its agent, :mod:`fastft.bus.relay`) did not answer or refused
    the connection."""


class ControlPlaneError(FastFTError, RuntimeError):
    """The control plane holds a value no member of the job wrote (it lacks the job
    secret's tag): something else writes to the job's store. The value is not applied."""


class RayJobError(FastFTError, RuntimeError):
    """``fastft ray run``: the job cannot start on this Ray cluster; the message says why
    and what to change."""
