"""fastft under Hugging Face (the ``hf`` extra): ``from fastft.hf import Trainer`` in place
of ``transformers.Trainer`` trains under ``fastft run`` (docs/huggingface.md)."""

from __future__ import annotations

from typing import Any

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    if name != "Trainer":
        raise AttributeError(f"module 'fastft.hf' has no attribute {name!r}")
    try:
        import transformers  # noqa: F401
    except ImportError as e:  # pragma: no cover - the extra's absence
        raise ImportError(
            "fastft.hf.Trainer needs transformers: pip install 'fastft[hf]' "
            "(transformers 5, accelerate 1)"
        ) from e
    from fastft.hf.trainer import Trainer

    return Trainer
