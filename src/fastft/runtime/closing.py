"""How a worker's :class:`~fastft.runtime.api.Runtime` ends: :func:`close` (the job's end,
or this worker leaving on its own) and :func:`stop_threads` (the interpreter's exit without
a close). ``rt``: the :class:`~fastft.runtime.api.Runtime` (typed ``Any``: it imports this
module), as :func:`fastft.runtime.endcheck.end_check` takes it."""

from __future__ import annotations

import logging
from typing import Any

from fastft.runtime.endcheck import end_check

log = logging.getLogger(__name__)


def stop_threads(rt: Any) -> None:
    """At interpreter exit without :meth:`close` (an exception, ``sys.exit``, a job that
    cannot go on): stop the threads that block in torch (the bus listener's store
    waits, the key collector) while the interpreter can still run them. One that
    returned from C++ during finalization could not take the GIL and would abort the
    process ("terminate called without an active exception") instead of letting it end
    with its status."""
    x = rt.engine
    if x.closing:
        return
    x.closing = True
    for stop in (x.membership.collector.close, rt.bus.close, rt.heartbeat.close):
        try:
            stop()
        except Exception:
            log.debug("stopping %s at exit failed", stop, exc_info=True)
    if x.durable is not None:
        x.durable.close(timeout_s=10.0)


def close(rt: Any, *, finished: bool = True) -> None:
    """Leave the job. Idempotent. ``finished=False``: this worker leaves on its own
    (a failed health check); a member's close otherwise tells joiners the job ended."""
    x = rt.engine
    if x.closing:
        return
    x.closing = True
    view = x.view
    if (
        finished
        and x.state.may_end_the_job
        and view is not None
        and view.has(rt.rank, rt.incarnation)
    ):
        try:  # a member ends after a committed step: joiners need not wait any more
            rt.control.set(rt.keys.finished, str(x.state.step))
        except Exception:
            log.debug("could not mark the job finished", exc_info=True)
        with rt.heartbeat.blocked:  # (it waits for the others' sums)
            end_check(rt, rt.control)  # (ReplicasDiverged: exit 94, closed by it)
    x.shutdown("closed")
    st = rt.bus.stats
    rt.events.emit(
        "worker_stop",
        step=x.state.step,
        commits=x.commits,
        rollbacks=x.rollbacks,
        rejected={  # what was not acted on: frames without the secret, replays, forgeries
            "malformed": st.malformed,
            "forged": st.forged,
            "replayed": st.replayed,
            "by_sender": dict(st.rejected_by),
            "forged_values": getattr(rt.control, "forged", None) and rt.control.forged.total,
            "forged_flow": rt.flow.forged if rt.flow is not None else 0,
        },
    )
    if x.durable is not None:
        with rt.heartbeat.blocked:  # alive while it waits (the agent must not kill it as hung)
            x.settle()  # (the last commit's, after the script's post-commit code)
            x.checkpoints.last(x.state.step, x.view, x.me)
            x.durable.close()  # a checkpoint being written is finished: the last counts
    x.membership.collector.close()
    rt.bus.close()
    rt.interrupter.close()
    rt.heartbeat.close()
    rt.events.close()
