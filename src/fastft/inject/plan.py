"""The fault catalogue and the one fault plan shared by tests, the demo and the CLI.

A :class:`FaultPlan` is a list of :class:`FaultSpec` and serialises to JSON::

    {"faults": [{"kind": "sigkill", "rank": 1, "at_step": 40},
                {"kind": "exception", "rank": 0, "at_step": 10, "life": 0}]}

``at_step``: fire when the target starts that step (None: at once, for live injection).
``life``: fire only in that life of the rank (0 = first start, 1 = after one restart, ...);
so a restarted worker that heals back to the same step does not fire the fault again.
``arg``: the kind's parameter (``exit``: exit code; ``gil_hang``: seconds; ``sigstop``:
nothing; ``slow``: the factor its steps' compute is slowed by; ``hang``-like kinds never
return on their own). ``steps``: ``slow``'s duration in steps (0: the rest of the life).
``point``: ``step`` (default), ``commit`` (between the COMMIT decision of ``at_step`` and
its application), ``heal`` (while healing to step ``at_step``, before the transfer),
``collective`` (as the step's gradient collective starts: its peers are inside it),
``rollback`` (just before it requests the rollback of step ``at_step``: its peers are
collecting the requests) or ``formation`` (once it arrived, as a survivor, for the next
epoch at step ``at_step``).
``delay_s``: wait that many seconds at the point, then fire (with ``collective``: the
peers are already waiting inside the collective, so they have finished their own part of
the step when the fault hits).
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from fastft.errors import ConfigError

__all__ = ["FaultKind", "FaultSpec", "FaultPlan", "FAULT_SEVERITY"]


class FaultKind(str, enum.Enum):
    """The catalogue (NVRx's ``inject_fault`` kinds plus Fault1-without-dying)."""

    EXCEPTION = "exception"
    """A Python exception in the step (Fault2)."""
    SIGKILL = "sigkill"
    """The process is killed (Fault1)."""
    SIGTERM = "sigterm"
    """The process is asked to terminate. Under the runtime it is a preemption notice: the
    worker drains (leaves after its next commit, nothing rolled back) and its agent starts
    it again in a fixed world; without the runtime, the process ends (Fault1)."""
    SIGSTOP = "sigstop"
    """The process is stopped: a hang its parent can see (Fault1 once killed)."""
    GIL_HANG = "gil_hang"
    """A hang that holds the GIL: no Python thread of the process runs (Fault1)."""
    SEGFAULT = "segfault"
    """A segmentation fault (Fault1)."""
    EXIT = "exit"
    """``os._exit(arg)`` (Fault1)."""
    STATE_LOST = "state_lost"
    """The worker's state is declared lost without dying: it must heal (Fault1)."""
    BITFLIP = "bitflip"
    """Silent data corruption: bit ``arg`` (0-31, of the float32's bits) of the first
    element of the registered model's first parameter (``target: optimizer``: of the first
    float32 tensor of its optimizer's state) flips at the start of ``at_step``, with
    nothing raised. The in-band replica check (``--compare-every``) finds it."""
    SLOW = "slow"
    """A straggler: from ``at_step`` on, for ``steps`` steps (0: the rest of its life),
    each step of the worker computes ``arg`` times as long (a factor > 1: it sleeps that
    share of the step's own compute before the gradient collective). No fault of the
    step: its peers wait for it (a throttled GPU, a noisy neighbour)."""


_GRAY = (FaultKind.SLOW, FaultKind.BITFLIP)
FAULT_SEVERITY = {k: (2 if k is FaultKind.EXCEPTION else 0 if k in _GRAY else 1) for k in FaultKind}
"""Severity (1 = Fault1, 2 = Fault2; 0: no fault of the step, a gray failure) of each kind."""


POINTS = ("step", "commit", "heal", "collective", "reduced", "rollback", "formation")
"""Where a scheduled fault fires: at the start of the step (``step``); after the step was
decided COMMIT and before this worker applied it (``commit``); while healing to the step,
before the state transfer (``heal``); as its gradient collective starts (``collective``);
once it returned (``reduced``: the step's vote rode it, the others may commit); just before this worker requests the step's rollback (``rollback``); once it has arrived
for the next epoch's formation at the step, as a survivor (``formation``)."""


ARG_MAX = 1e6
"""A fault's ``arg`` (an exit status, a hang's seconds) is a finite number up to this."""


TARGETS = ("parameter", "optimizer")
"""What a ``bitflip`` flips a bit of (:attr:`FaultSpec.target`)."""


@dataclass(frozen=True)
class FaultSpec:
    kind: FaultKind
    rank: int
    at_step: int | None = None
    life: int = 0
    arg: float = 0.0
    point: str = "step"
    delay_s: float = 0.0
    steps: int = 0
    target: str = "parameter"
    """``bitflip``: what the bit flips in, ``parameter`` (the registered model's first
    float32 parameter) or ``optimizer`` (the first float32 tensor of its state: Adam's
    moments)."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FaultKind):
            try:
                object.__setattr__(self, "kind", FaultKind(self.kind))
            except ValueError:
                kinds = ", ".join(k.value for k in FaultKind)
                raise ConfigError(
                    f"unknown fault kind {self.kind!r}; use one of: {kinds}"
                ) from None
        for name in ("rank", "life", "steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"fault {name}={v!r}: use an integer >= 0")
        if self.at_step is not None and (
            isinstance(self.at_step, bool) or not isinstance(self.at_step, int) or self.at_step < 0
        ):
            raise ConfigError(f"fault at_step={self.at_step!r}: use an integer >= 0 or null")
        a = self.arg
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not abs(a) <= ARG_MAX:
            # (NaN and infinities fail the comparison: an exit status, a hang's seconds)
            raise ConfigError(f"fault arg={a!r}: use a finite number (at most {ARG_MAX:g})")
        object.__setattr__(self, "arg", float(self.arg))
        d = self.delay_s
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 3600:
            raise ConfigError(f"fault delay_s={d!r}: use seconds in 0..3600")
        object.__setattr__(self, "delay_s", float(d))
        if self.kind is FaultKind.BITFLIP and self.arg not in range(32):
            raise ConfigError(f"fault bitflip arg={self.arg!r}: use the bit to flip, 0..31")
        if self.target not in TARGETS:
            raise ConfigError(f"fault target={self.target!r}: use one of {', '.join(TARGETS)}")
        if self.kind is FaultKind.SLOW and not 1 < self.arg <= 100:
            raise ConfigError(
                f"fault slow arg={self.arg!r}: use the factor its steps are slowed by, "
                "above 1 (1.5: a step computes 50 % longer) and at most 100"
            )
        if self.point not in POINTS:
            raise ConfigError(f"fault point={self.point!r}: use one of {', '.join(POINTS)}")
        if self.point != "step":
            if self.at_step is None:
                raise ConfigError(f"fault point={self.point!r} needs an at_step")
            if self.kind in (FaultKind.STATE_LOST, FaultKind.SLOW, FaultKind.BITFLIP) or (
                self.kind is FaultKind.EXCEPTION and self.point not in ("collective", "reduced")
            ):
                raise ConfigError(
                    f"fault {self.kind.value} at point={self.point!r}: only process faults "
                    "(sigkill, sigterm, sigstop, gil_hang, segfault, exit) fire there"
                )

    @property
    def severity(self) -> int:
        return FAULT_SEVERITY[self.kind]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind.value
        return d


def planned(path: str | Path | None) -> list[dict[str, Any]] | None:
    """The faults of the plan at ``path`` as dicts (what the agent's ``agent_start`` event
    records, for the faults that never fire), or None without one."""
    return None if path is None else [f.to_dict() for f in FaultPlan.load(path).faults]


@dataclass(frozen=True)
class FaultPlan:
    faults: tuple[FaultSpec, ...] = field(default_factory=tuple)

    def for_rank(self, rank: int, life: int) -> tuple[FaultSpec, ...]:
        return tuple(f for f in self.faults if f.rank == rank and f.life == life)

    def to_json(self) -> str:
        return json.dumps({"faults": [f.to_dict() for f in self.faults]}, indent=2)

    @classmethod
    def from_json(cls, text: str, *, source: str = "fault plan") -> FaultPlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{source}: not valid JSON ({e})") from e
        except RecursionError:
            raise ConfigError(f"{source}: nested too deeply to be a fault plan") from None
        if not isinstance(data, dict) or not isinstance(data.get("faults"), list):
            raise ConfigError(f'{source}: expected {{"faults": [...]}}')
        specs = []
        allowed = {f.name for f in fields(FaultSpec)}
        for i, item in enumerate(data["faults"]):
            if not isinstance(item, dict):
                raise ConfigError(f"{source}: faults[{i}] must be an object")
            extra = set(item) - allowed
            if extra or "kind" not in item or "rank" not in item:
                raise ConfigError(
                    f"{source}: faults[{i}] needs 'kind' and 'rank' and may have "
                    f"{sorted(allowed)}; got {sorted(item)}"
                )
            try:
                specs.append(FaultSpec(**item))
            except ConfigError as e:
                raise ConfigError(f"{source}: faults[{i}]: {e}") from None
        return cls(tuple(specs))

    @classmethod
    def load(cls, path: str | Path) -> FaultPlan:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"fault plan {p}: cannot read ({e.strerror})") from e
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"fault plan {p}: not UTF-8 text ({e.reason} at byte {e.start})"
            ) from e
        return cls.from_json(text, source=str(p))
