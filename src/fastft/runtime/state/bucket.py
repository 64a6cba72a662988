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

    def of(
        self, params: list[torch.Tensor], carry: list[torch.Tensor] | None
    ) -> torch.Tensor | None:
        """The bucket of ``params`` (copying any gradients that exist into a new one); None
        if they do not share a dtype and device. ``carry``: tensors of the same dtype that
        ride the allreduce, in a tail of their total size plus one; None: the tail the
        bucket has (a rollback's rebuild)."""
        if not params or len({(p.dtype, p.device) for p in params}) != 1:
            return None
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
            and self.extra == extra
        ):
            return flat
        flat = torch.zeros(
            sum(p.numel() for p in params) + extra, dtype=params[0].dtype, device=params[0].device
        )
        self.extra = extra
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
        return self.flat[-self.extra :]

    def drop(self) -> torch.Tensor | None:
        """Forget the bucket (an allreduce abandoned on a dead peer may still write into
        it); returns it. The tail's size stays for the rebuild."""
        old, self.flat, self._ptrs = self.flat, None, []
        return old
