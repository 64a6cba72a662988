"""The gradient bucket: one flat tensor that every trainable parameter's ``.grad`` is a view
of (as DDP's ``gradient_as_bucket_view``), so that backward accumulates straight into it and
the allreduce runs on it in place, without a flatten and an unflatten copy per step."""

from __future__ import annotations

import torch

__all__ = ["GradBucket"]


class GradBucket:
    """The bucket of one model's gradients, built on first use and rebuilt when something
    replaced a ``.grad``. Its tail carries tensors that ride the same allreduce
    (``--buffers average``)."""

    def __init__(self) -> None:
        self.flat: torch.Tensor | None = None
        self._ptrs: list[int] = []
        self.extra = 0
        """The tail: elements past the gradients (:meth:`of`'s carry)."""
        self.slots_n = 0
        """Elements past the tail: the step's in-band vote (:mod:`fastft.runtime.state.inband`)."""

    def of(
        self,
        params: list[torch.Tensor],
        carry: list[torch.Tensor] | None,
        slots: int | None = None,
    ) -> torch.Tensor | None:
        """The bucket of ``params`` (copying any gradients that exist into a new one); None
        if they do not share a dtype and device. ``carry``: tensors of the same dtype that
        ride the allreduce, in a tail of their total size plus one; ``slots``: elements
        after the tail (the in-band vote's); None for either: what the bucket has (a
        rollback's rebuild)."""
        if not params or len({(p.dtype, p.device) for p in params}) != 1:
            return None
        slots = self.slots_n if slots is None else slots
        if carry is None:
            extra = self.extra
        else:
            like = (params[0].dtype, params[0].device)
            fits = carry and all((c.dtype, c.device) == like for c in carry)
            extra = sum(c.numel() for c in carry) + 1 if fits else 0
        flat = self.flat
        if (
            flat is not None
            and len(params) == len(self._ptrs)
            and all(
                p.grad is not None and p.grad.data_ptr() == ptr
                for p, ptr in zip(params, self._ptrs, strict=True)
            )
            and (self.extra, self.slots_n) == (extra, slots)
        ):
            return flat
        flat = torch.zeros(
            sum(p.numel() for p in params) + extra + slots,
            dtype=params[0].dtype,
            device=params[0].device,
        )
        self.extra, self.slots_n = extra, slots
        off = 0
        for p in params:
            view = flat[off : off + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            off += p.numel()
        self.flat = flat
        self._ptrs = [p.grad.data_ptr() for p in params]  # type: ignore[union-attr]
        return flat

    @property
    def tail(self) -> torch.Tensor | None:
        """The tail (:meth:`of`'s ``carry``), None without one."""
        if self.flat is None or not self.extra:
            return None
        end = self.flat.numel() - self.slots_n
        return self.flat[end - self.extra : end]

    @property
    def reduced(self) -> torch.Tensor | None:
        """The gradients and the tail: what is weighed and averaged (not the slots)."""
        if self.flat is None or not self.slots_n:
            return self.flat
        return self.flat[: self.flat.numel() - self.slots_n]

    @property
    def slots(self) -> torch.Tensor | None:
        """The in-band vote's slots (:meth:`of`'s ``slots``), None without them."""
        if self.flat is None or not self.slots_n:
            return None
        return self.flat[self.flat.numel() - self.slots_n :]

    def drop(self) -> torch.Tensor | None:
        """Forget the bucket (an allreduce abandoned on a dead peer may still write into
        it); returns it. The tail's size stays for the rebuild."""
        old, self.flat, self._ptrs = self.flat, None, []
        return old
