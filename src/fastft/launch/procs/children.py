"""The agent's children: spawning, reaping, exit traces, stops and kills.

Detection without polling: a thread per child blocks in ``waitid(WEXITED | WSTOPPED)``, so
the kernel tells the agent the moment a worker exits, is killed or is stopped (SIGSTOP),
and a thread traces each worker's exit sentinel, which reports a death before the kernel
has freed the worker's memory (:mod:`fastft.launch.procs.exit_trace`). Every child gets
``PR_SET_PDEATHSIG`` so that none outlives a killed agent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastft.launch.procs.exit_trace import ExitTracer
from fastft.launch.procs.forks import Forked, Zygote
from fastft.launch.procs.output import Output

__all__ = ["Children", "Slot", "await_signal_taken", "die_with_parent"]

_PR_SET_PDEATHSIG = 1


@dataclass
class Slot:
    rank: int
    life: int = 0
    incarnation: int = 0
    proc: subprocess.Popen[bytes] | Forked | None = None
    started: float = 0.0
    heartbeat: str = ""
    done: bool = False
    hung: int = 0
    """The incarnation last reported hung (killed; not reported twice)."""
    stopped: int = 0
    """The incarnation last reported stopped."""
    drains: int = 0
    """Lives that ended with no failure of their own (drained, or fenced: its node was
    declared lost while its link was down): they use up no restart."""
    declared: tuple[int, str] = (0, "")
    """The incarnation last declared dead by a peer or a monitor, and why (killed)."""
    fault_at: float = 0.0
    """CLOCK_MONOTONIC of its last life's failure, until a later life commits (0: none
    pending): the agent's "back" line says how long the slot was out."""
    ending: str | None = None
    """Why its last life ended with a status of fastft's (the worker's record); None: it
    ended otherwise (0, a signal, a status of the script's own)."""
    spare_only: bool = False
    """The next life must be a warm spare (the last one failed its health check, or the
    slot is quarantined: :mod:`fastft.launch.rules.offenders`)."""


ExitCallback = Callable[[Slot, int, "int | None", "int | None", float, str], bool]


class Children:
    """The live children by pid. ``on_exit(slot, pid, code, sig, t, via)`` is called once
    per worker exit (the exit trace usually first, waitid later: the first claims it) and
    returns whether it claimed it; ``after_exit(slot, code, sig)`` then runs for the one
    that claimed it; ``on_stopped(slot, t, via)`` for a stop; ``on_other(info)`` for the
    exit of a child that is not a worker (a spare)."""

    def __init__(
        self,
        *,
        on_stopped: Callable[[Slot, float, str], None],
        claim: ExitCallback,
        after_exit: Callable[[Slot, int | None, int | None], None],
        on_other: Callable[[os.waitid_result], None],
        output: Output,
    ) -> None:
        self.output = output
        self.lock = threading.Lock()
        self.by_pid: dict[int, Slot] = {}
        self.tracer = ExitTracer()
        self._on_stopped = on_stopped
        self._claim = claim
        self._after_exit = after_exit
        self._on_other = on_other
        self.zygote: Zygote | None = None
        """The node's zygote (``--start-method zygote``), set by the agent."""

    def popen(self, slot: Slot, command: list[str], env: dict[str, str]) -> str:
        """Start a worker cold and watch it: a fork of the zygote if there is one that can
        (:mod:`fastft.launch.procs.forks`), else a new process. Returns how ("fork", or
        "spawn" with the reason the zygote could not)."""
        env = self.output.env(env)
        forked = self.zygote.fork(command, env) if self.zygote else "spawn"
        how = "fork" if isinstance(forked, Forked) else forked
        with self.lock:
            if isinstance(forked, Forked):
                slot.proc = forked
            else:
                slot.proc = subprocess.Popen(
                    command, env=env, preexec_fn=die_with_parent, **self.output.popen_kwargs()
                )
            slot.started = time.monotonic()
            self.by_pid[slot.proc.pid] = slot
        self.output.label(slot.proc.pid, slot.rank, slot.life)
        self.output.watch(slot.proc)
        self.reap(slot.proc.pid)
        return how

    def adopt(self, slot: Slot, proc: subprocess.Popen[bytes] | Forked) -> None:
        """A spare became ``slot``'s worker (its reaper and its output's relay run already)."""
        with self.lock:
            slot.proc = proc
            slot.started = time.monotonic()
            self.by_pid[proc.pid] = slot
        self.output.label(proc.pid, slot.rank, slot.life)

    def claim(self, slot: Slot, pid: int) -> bool:
        """True once per pid: the caller reports the exit."""
        with self.lock:
            return self.by_pid.pop(pid, None) is not None

    def trace_exit(self, slot: Slot, pid: int, path: str) -> None:
        """Hear of this worker's death as it starts (:mod:`fastft.launch.procs.exit_trace`)."""
        claimed = [False]

        def report(code: int | None, sig: int | None, t: float) -> None:
            claimed[0] = self._claim(slot, pid, code, sig, t, "exit_trace")

        def after(code: int | None, sig: int | None, t: float) -> None:
            if claimed[0]:
                self._after_exit(slot, code, sig)

        def stopped(t: float) -> None:
            with self.lock:
                mine = self.by_pid.get(pid) is slot
            if mine:
                self._on_stopped(slot, t, "exit_trace")

        self.tracer.watch(pid, path, lambda: pid in self.by_pid, report, after, stopped)

    def reap(self, pid: int) -> None:
        """Start the thread that blocks in ``waitid`` for child ``pid``. One thread per
        child, each waiting for its own pid: a ``waitid(P_ALL)`` would also take the
        exit-trace stops of the traced sentinel threads."""
        threading.Thread(
            target=self._reap_loop, args=(pid,), name=f"fastft-reaper-{pid}", daemon=True
        ).start()

    def _reap_loop(self, pid: int) -> None:
        while True:
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WSTOPPED)
            except ChildProcessError:
                return  # reaped elsewhere (SparePool.stop)
            except InterruptedError:
                continue
            if info is None:
                continue
            t = time.monotonic()
            with self.lock:
                slot = self.by_pid.get(info.si_pid)
            stopped = info.si_code == os.CLD_STOPPED
            if slot is None:  # a spare, or an exit the exit trace already reported
                if stopped:
                    continue
                self._on_other(info)
                return
            if stopped:
                self._on_stopped(slot, t, "waitid")
            elif info.si_code in (os.CLD_EXITED, os.CLD_KILLED, os.CLD_DUMPED):
                code = info.si_status if info.si_code == os.CLD_EXITED else None
                sig = info.si_status if info.si_code != os.CLD_EXITED else None
                if self._claim(slot, info.si_pid, code, sig, t, "waitid"):
                    self._after_exit(slot, code, sig)
            if not stopped:
                return

    def kill(self, slot: Slot, sig: int = signal.SIGKILL, incarnation: int | None = None) -> None:
        with self.lock:
            p = slot.proc
            if p is None or p.returncode is not None or p.pid not in self.by_pid:
                return
            if incarnation is not None and slot.incarnation != incarnation:
                return  # the slot holds a newer life by now
            try:
                os.kill(p.pid, sig)
                if sig != signal.SIGKILL:
                    os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def kill_all(self, slots: list[Slot], sig: int, grace_s: float) -> None:
        """Kill the workers of ``slots``, then end the zygote (its end is not on the
        workers' path: it took ~1 s, a Python with torch finalizing, before they were
        signalled at every job end, Ctrl-C included)."""
        for slot in slots:
            slot.done = True
            self.kill(slot, sig)
        if self.zygote is not None:
            self.zygote.stop()
        deadline = time.monotonic() + grace_s
        while self.by_pid and time.monotonic() < deadline:
            time.sleep(0.02)
        for slot in slots:
            self.kill(slot, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while self.by_pid and time.monotonic() < deadline:
            time.sleep(0.01)


STACKS_MAX_S = 0.05
"""The most a hung worker is given to print its stacks before it is killed."""
STACKS_WRITE_S = 0.003
"""After it took the signal: faulthandler's C handler writes every thread's stack (a few
writes, well under a ms)."""


def await_signal_taken(pid: int, sig: int, max_s: float = STACKS_MAX_S) -> bool:
    """Wait until ``pid`` has taken ``sig`` (it is no longer pending in
    ``/proc/PID/status``), then ``STACKS_WRITE_S`` for its handler to write; at most
    ``max_s`` in all. A fixed wait of ``max_s`` would be on the recovery path of every hang
    in a fixed world (its replacement starts at the hung worker's exit). Returns whether
    it was seen taken."""
    bit = 1 << (sig - 1)
    deadline = time.monotonic() + max_s
    while True:
        try:
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
        except OSError:
            return False  # gone
        pending = 0
        for line in status.splitlines():
            if line.startswith(("SigPnd:", "ShdPnd:")):
                pending |= int(line.split()[1], 16)
        left = deadline - time.monotonic()
        if not pending & bit:
            time.sleep(max(0.0, min(STACKS_WRITE_S, left)))
            return True
        if left <= 0:
            return False
        time.sleep(min(0.0005, left))


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the agent dies (no orphans)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
