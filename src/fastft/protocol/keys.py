"""Every store key fastft uses, named in one place.

All keys of one job live under ``fastft/{job}/``; the bus under ``.../bus/``. Keeping them
here makes the store's key space auditable: nothing else builds key strings.
"""

from __future__ import annotations

__all__ = ["JobKeys"]


class JobKeys:
    """Key names for one job."""

    def __init__(self, job: str) -> None:
        if not job or "/" in job:
            raise ValueError(f"job id {job!r} must be non-empty and contain no '/'")
        self.job = job
        self.root = f"fastft/{job}"

    # --- error bus -------------------------------------------------------------------------
    @property
    def bus_members(self) -> str:
        """Encoded set of live subscriber ids; updated by compare-and-set."""
        return f"{self.root}/bus/members"

    def bus_queue(self, subscriber: str) -> str:
        """The FIFO queue of one subscriber."""
        return f"{self.root}/bus/q/{subscriber}"

    @property
    def bus_ids(self) -> str:
        """Counter that hands out subscriber ids."""
        return f"{self.root}/bus/next_id"
