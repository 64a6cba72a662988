"""fastft under PyTorch Lightning (the ``lightning`` extra): ``Trainer(strategy=
FastFTStrategy())`` trains an unchanged ``LightningModule`` under ``fastft run``
(docs/lightning.md)."""

from __future__ import annotations

from typing import Any

__all__ = ["FastFTStrategy"]


def __getattr__(name: str) -> Any:
    if name != "FastFTStrategy":
        raise AttributeError(f"module 'fastft.lightning' has no attribute {name!r}")
    try:
        import pytorch_lightning  # noqa: F401
    except ImportError as e:  # pragma: no cover - the extra's absence
        raise ImportError(
            "fastft.lightning.FastFTStrategy needs PyTorch Lightning: pip install "
            "'fastft[lightning]' (pytorch-lightning 2.6)"
        ) from e
    from fastft.lightning.strategy import FastFTStrategy

    return FastFTStrategy
