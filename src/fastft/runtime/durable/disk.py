"""The durable tier's on-disk format: one checkpoint is ``DIR/step-<step>/`` with DCP's
tensor files, the state's structure as JSON and a manifest (sizes and SHA-256 of every
file, written last), renamed into place whole; a write in progress is
``DIR/.tmp-step-<step>-<host>-<writer pid>``. Used by the worker
(:mod:`.checkpoints`) and by its writer process (:mod:`.writer`) alike."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import torch

import fastft.runtime.state.tree as tree  # the heal's: the structure as JSON, tensors apart

__all__ = [
    "FORMAT",
    "MANIFEST",
    "STRUCTURE",
    "CheckpointError",
    "checkpoint_name",
    "parse_tmp",
    "tmp_name",
    "verify",
    "write_checkpoint",
]

MANIFEST = "fastft.json"
STRUCTURE = "structure.json"
FORMAT = 2
"""2: the structure is JSON (:mod:`fastft.runtime.state.tree`); 1 was a pickle."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (incomplete, truncated, altered)."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def verify(path: Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint whose every file has its recorded size and
    hash; CheckpointError otherwise."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no readable {MANIFEST} ({e})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT}")
    for name, (size, digest) in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"{path}: {name} has {f.stat().st_size} bytes, not {size}")
        if _sha256(f) != digest:
            raise CheckpointError(f"{path}: {name} does not match its hash")
    return manifest


def write_checkpoint(
    root: str | os.PathLike[str], step: int, epoch: int, state: dict[str, Any]
) -> tuple[Path, int]:
    """Write ``state`` as ``root/step-<step>``: tensors with DCP, the structure, then the
    manifest, then an atomic rename (complete or invisible). Returns (path, bytes)."""
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    if final.exists():
        return final, 0  # written by an earlier life (a replay after a restore)
    tmp = root / tmp_name(step, os.getpid())
    tmp.mkdir(parents=True, exist_ok=True)  # (made by the worker that handed it over)
    for f in tmp.iterdir():
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    tensors: list[torch.Tensor] = []
    structure = tree.dump(state, tensors)
    dcp.save({f"t{i}": t for i, t in enumerate(tensors)}, checkpoint_id=tmp, no_dist=True)
    (tmp / STRUCTURE).write_bytes(structure)
    files: dict[str, tuple[int, str]] = {}
    for f in sorted(tmp.iterdir()):
        files[f.name] = (f.stat().st_size, _sha256(f))
        _fsync(f)
    manifest = {
        "format": FORMAT,
        "step": step,
        "epoch": epoch,
        "time": time.time(),
        "shapes": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors],
        "files": files,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest))  # last: the checkpoint is whole
    _fsync(tmp / MANIFEST)
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        # the same step written meanwhile by an earlier life's writer, which finishes the
        # write it was handed after its worker died: the same committed state (S3)
        shutil.rmtree(tmp, ignore_errors=True)
        return final, 0
    _fsync(root)
    return final, sum(s for s, _ in files.values())


def tmp_name(step: int, pid: int) -> str:
    return f".tmp-{checkpoint_name(step)}-{socket.gethostname()}-{pid}"


def parse_tmp(name: str) -> tuple[int, str, str]:
    """(step, host, pid) of a write in progress (step -1 if ``name`` is not one)."""
    m = re.fullmatch(r"\.tmp-step-(\d+)-(.*)-(\d+)", name)
    return (int(m[1]), m[2], m[3]) if m else (-1, "", "")


def _sha256(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _fsync(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
