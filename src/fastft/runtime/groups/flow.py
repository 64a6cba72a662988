"""Pipeline stages in data-flow order, with a staleness bound (the seed's items b and c).

Each stage of a pipeline is its own fastft job (its own replicas, epochs and commits,
``fastft run --stage I/S``); the stages share a *flow store* (``--flow HOST:PORT``), where
each stage publishes how many steps it has committed and sends its activations:

- **Data-flow order (b).** Stage ``I+1`` receives the activations of step ``t`` only once
  stage ``I`` has committed ``t`` (:meth:`Flow.recv`), so a later stage's committed step
  never exceeds an earlier one's.
- **Staleness bound (c).** Stage ``I`` enters step ``t`` only once stage ``I+1`` has
  committed ``t + 1 - max_ahead`` steps (:meth:`Flow.hold`): its committed step never
  exceeds the downstream's by more than ``max_ahead``. The hold, and a receive, wait in
  polls ``POLL_S`` apart and give up as soon as the stage learns of a fault of its own
  (it then rolls back as usual), so a fault reaches a held stage at once.

A sent activation stays in the flow store until the downstream can no longer need it
(``max_ahead + 1`` steps later), so a downstream step that rolls back, or a restarted
member, receives it again. Stages must be deterministic per step (fastft reseeds every
attempt), so the attempt of a step that rolls back sends what its retry sends.

Every value is tagged with the job secret (both stages are started with the same
``--job-secret-file``); a value without a valid tag is logged, counted and ignored.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Callable

import torch

from fastft.bus import connect_store
from fastft.errors import ConfigError
from fastft.protocol.auth import JobSecret
from fastft.runtime.contract import RuntimeConfig, check_stage

__all__ = ["Flow", "POLL_S", "entry_needs", "flow_of"]

log = logging.getLogger(__name__)

POLL_S = 0.005
"""The slices a hold or a receive waits in: the most a fault is noticed late there."""
_TAG = 16


def entry_needs(step: int, max_ahead: int) -> int:
    """How many steps the downstream stage must have committed before this stage may
    enter ``step``: committing it makes this stage's count ``step + 1``."""
    return max(0, step + 1 - max_ahead)


class Flow:
    """This stage's end of the flow store (I/O). ``name``: the pipeline's name (its keys)."""

    def __init__(
        self,
        address: str,
        name: str,
        stage: int,
        stages: int,
        max_ahead: int,
        secret: JobSecret | None,
        world: int,
    ) -> None:
        """``secret``: None with FASTFT_INSECURE_NO_AUTH (values then carry a fixed tag)."""
        self.store = connect_store(address, wait_s=30.0)
        self.prefix = f"fastft/flow/{name}/"
        self.stage, self.stages, self.max_ahead = stage, stages, max_ahead
        self._key = secret.key("flow") if secret is not None else b"insecure"
        self.forged = 0
        self.world = world
        self._set(f"{stage}/world", str(world).encode())

    @property
    def upstream(self) -> int | None:
        return self.stage - 1 if self.stage > 0 else None

    @property
    def downstream(self) -> int | None:
        return self.stage + 1 if self.stage + 1 < self.stages else None

    # --- commits and the bound -------------------------------------------------------------
    def committed(self, count: int) -> None:
        """This stage has committed ``count`` steps (after its commit event is written).
        The mark of ``count - max_ahead - 1`` goes: by the bound and the data-flow order,
        neither neighbour can still wait for it."""
        self._set(f"{self.stage}/c/{count}", b"1")
        old = count - self.max_ahead - 1
        if old >= 1:
            self.store.delete_key(self.prefix + f"{self.stage}/c/{old}")

    def hold(self, step: int, cancelled: Callable[[], bool]) -> float | None:
        """Wait until this stage may enter ``step`` (the staleness bound); returns the
        seconds held, or None if ``cancelled`` (a fault) came first."""
        if self.downstream is None:
            return 0.0
        need = entry_needs(step, self.max_ahead)
        if need == 0:
            return 0.0
        t0 = time.monotonic()
        if self._wait(f"{self.downstream}/c/{need}", cancelled) is None:
            return None
        return time.monotonic() - t0

    # --- activations -----------------------------------------------------------------------
    def send(self, step: int, rank: int, tensor: torch.Tensor) -> None:
        """This member's output of ``step`` for the member of the same rank downstream."""
        if self.downstream is None:
            raise RuntimeError("tx.send(): this is the last stage of the pipeline")
        t = tensor.detach().cpu().contiguous()
        head = json.dumps({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)})
        body = head.encode() + b"\n" + t.reshape(-1).view(torch.uint8).numpy().tobytes()
        self._set(f"{self.stage}/a/{step}/{rank}", body)
        old = step - self.max_ahead - 1  # the downstream has committed it: nobody needs it
        if old >= 0:
            self.store.delete_key(self.prefix + f"{self.stage}/a/{old}/{rank}")

    def recv(self, step: int, rank: int, check: Callable[[], None]) -> torch.Tensor:
        """The upstream member's output of ``step``, once the upstream has committed it.
        ``check`` raises to give up (an interrupt)."""
        up = self.upstream
        if up is None:
            raise RuntimeError("tx.recv(): this is the first stage of the pipeline")
        world = self._wait(f"{up}/world", _raising(check))
        if world is not None and int(world) != self.world:
            raise ConfigError(
                f"stage {up} has {int(world)} members and stage {self.stage} {self.world}: "
                "member r of a stage receives from member r of the stage before; start "
                "every stage with the same --nproc"
            )
        self._wait(f"{up}/c/{step + 1}", _raising(check))
        body = self._wait(f"{up}/a/{step}/{rank}", _raising(check))
        assert body is not None
        head, _, data = body.partition(b"\n")
        meta = json.loads(head)
        dtype = getattr(torch, meta["dtype"])
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return flat.view(dtype).reshape(meta["shape"]).clone()

    # --- the store -------------------------------------------------------------------------
    def _set(self, key: str, value: bytes) -> None:
        full = self.prefix + key
        self.store.set(full, self._tag(full, value) + value)

    def _wait(self, key: str, cancelled: Callable[[], bool]) -> bytes | None:
        """The value of ``key`` once it exists with a valid tag; None if cancelled."""
        full = self.prefix + key
        while True:
            if cancelled():
                return None
            if not self.store.check([full]):  # (a store's wait with a timeout logs a
                time.sleep(POLL_S)  # warning each time it runs out)
                continue
            raw = bytes(self.store.get(full))
            tag, value = raw[:_TAG], raw[_TAG:]
            if hmac.compare_digest(tag, self._tag(full, value)):
                return value
            self.forged += 1
            if self.forged == 1:
                log.error("flow store: %s holds a value without the job's tag; ignored", full)
            time.sleep(POLL_S)

    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.digest(self._key, key.encode() + b"\0" + value, "sha256")[:_TAG]


def _raising(check: Callable[[], None]) -> Callable[[], bool]:
    def cancelled() -> bool:
        check()
        return False

    return cancelled


def flow_of(config: RuntimeConfig, secret: JobSecret | None) -> Flow | None:
    """The flow store's end for a pipeline stage (``--stage I/S``), None for other jobs."""
    if config.stage is None:
        return None
    i, n = check_stage(
        config.stage, config.flow, config.max_ahead, config.elastic, config.shard_size
    )
    if n == 1:
        return None
    assert config.flow is not None
    return Flow(config.flow, config.flow_name, i, n, config.max_ahead, secret, config.world_size)
