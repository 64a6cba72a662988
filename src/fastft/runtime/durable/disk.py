"""The durable tier's on-disk format: one checkpoint is ``DIR/step-<step>/`` with the
state's tensors in one file (``tensors.bin``, each at the offset the manifest lists), the
state's structure as JSON and a manifest (sizes and SHA-256 of every file, the tensors'
places; written last), renamed into place whole; a write in progress is
``DIR/.tmp-step-<step>-<host>-<writer pid>``. Used by the worker (:mod:`.checkpoints`) and
by its writer process (:mod:`.writer`) alike.

Why one flat file and not DCP's (format 2, still read): the writer holds the state as one
flat buffer already (the step loop's staging copy), and writes it with ``O_DIRECT`` where
the file system takes it. A buffered write of 48.5 MB cost the writer 117-160 ms of CPU
here (the kernel's copy into the page cache), DCP's save ~135 ms, the direct write ~2 ms;
on a machine with no idle core the writer's CPU is what a checkpoint costs training
(docs/measurements.md, "Durable checkpoints"). Nothing in it is a pickle: reading a
checkpoint runs no code (DCP's ``.metadata`` was one)."""

from __future__ import annotations

import hashlib
import json
import math
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
    "BLOCK",
    "FORMAT",
    "MANIFEST",
    "STRUCTURE",
    "TENSORS",
    "CheckpointError",
    "checkpoint_name",
    "fill",
    "flat_buffer",
    "layout",
    "load_tensors",
    "padded",
    "parse_tmp",
    "staged",
    "tmp_name",
    "verify",
    "views",
    "write_checkpoint",
    "write_flat",
]

MANIFEST = "fastft.json"
STRUCTURE = "structure.json"
TENSORS = "tensors.bin"
FORMAT = 3
"""3: the tensors in one file at the manifest's offsets; 2: DCP's files (read, not
written); 1 was a pickle (neither)."""
_READ = (2, 3)
ALIGN = 64
"""Each tensor's offset in the flat buffer and file (a multiple of every dtype's size)."""
BLOCK = 4096
"""A direct write's unit: its address, length and file offset are multiples of it."""
Entry = tuple[str, list[int], int]
"""A tensor's (dtype, shape, offset) in the flat buffer and in ``tensors.bin``."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (incomplete, truncated, altered)."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def layout(tensors: list[torch.Tensor]) -> tuple[list[Entry], int]:
    """Where each tensor goes in a flat buffer: (dtype, shape, offset) each, and the total."""
    entries, off = [], 0
    for t in tensors:
        off = -(-off // ALIGN) * ALIGN
        entries.append((str(t.dtype).removeprefix("torch."), list(t.shape), off))
        off += t.numel() * t.element_size()
    return entries, off


def views(flat: torch.Tensor, entries: list[Entry]) -> list[torch.Tensor]:
    """The tensors ``layout`` placed in ``flat``."""
    out = []
    for dtype, shape, off in entries:
        dt = getattr(torch, dtype)
        nbytes = math.prod(shape) * dt.itemsize
        out.append(flat[off : off + nbytes].view(dt).view(shape))
    return out


def padded(nbytes: int) -> int:
    """``nbytes`` up to a whole number of :data:`BLOCK` (what a buffer holds for a direct
    write of ``nbytes``)."""
    return max(-(-nbytes // BLOCK) * BLOCK, BLOCK)


def flat_buffer(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[Entry], int]:
    """``tensors`` copied into one fresh flat buffer (the gaps zero): (buffer, entries,
    bytes used). The in-process write's staging; the writer process gets the shared one."""
    entries, nbytes = layout(tensors)
    flat = torch.zeros(padded(nbytes), dtype=torch.uint8)
    fill(flat, entries, tensors)
    return flat, entries, nbytes


def fill(flat: torch.Tensor, entries: list[Entry], tensors: list[torch.Tensor]) -> None:
    """Copy ``tensors`` into ``flat`` where ``entries`` (their :func:`layout`) place them."""
    with torch.no_grad():
        for t, v in zip(tensors, views(flat, entries), strict=True):
            v.copy_(t.detach().to("cpu"))


def verify(path: Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint whose every file has its recorded size and
    hash; CheckpointError otherwise."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no readable {MANIFEST} ({e})") from None
    if manifest.get("format") not in _READ:
        raise CheckpointError(
            f"{path}: format {manifest.get('format')!r}, this fastft reads {list(_READ)}"
        )
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
    """Write ``state`` as ``root/step-<step>`` (in this process); see :func:`write_flat`."""
    return write_flat(root, step, epoch, *staged(state))


def staged(state: dict[str, Any]) -> tuple[bytes, list[Entry], torch.Tensor, int]:
    """``state`` staged for a write in this process: its structure, its tensors' layout, a
    flat copy of them (:func:`flat_buffer`) and the bytes in use; :func:`write_flat`'s."""
    tensors: list[torch.Tensor] = []
    structure = tree.dump(state, tensors)
    flat, entries, nbytes = flat_buffer(tensors)
    return structure, entries, flat, nbytes


def write_flat(
    root: str | os.PathLike[str],
    step: int,
    epoch: int,
    structure: bytes,
    entries: list[Entry],
    flat: torch.Tensor,
    nbytes: int,
) -> tuple[Path, int]:
    """Write a state staged in ``flat`` (its first ``nbytes``; ``entries`` from
    :func:`layout`, ``structure`` from ``tree.dump``) as ``root/step-<step>``: the tensors,
    the structure, then the manifest, then an atomic rename (complete or invisible).
    Returns (path, bytes)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    if final.exists():
        return final, 0  # written by an earlier life (a replay after a restore)
    tmp = root / tmp_name(step, os.getpid())
    tmp.mkdir(parents=True, exist_ok=True)  # (made by the worker that handed it over)
    for f in tmp.iterdir():
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    files = {TENSORS: (nbytes, _write_tensors(tmp / TENSORS, flat, nbytes))}
    (tmp / STRUCTURE).write_bytes(structure)
    _fsync(tmp / STRUCTURE)
    files[STRUCTURE] = (len(structure), hashlib.sha256(structure).hexdigest())
    manifest = {
        "format": FORMAT,
        "step": step,
        "epoch": epoch,
        "time": time.time(),
        "tensors": entries,
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


def _write_tensors(path: Path, flat: torch.Tensor, nbytes: int) -> str:
    """Write ``flat[:nbytes]`` to ``path`` and sync it; its SHA-256 (of the buffer, which
    is what was written: :func:`verify` hashes the file). Direct (no page-cache copy)
    where the buffer is block-aligned and the file system takes ``O_DIRECT``; buffered
    otherwise (tmpfs, some network file systems)."""
    assert flat.dtype == torch.uint8 and flat.is_contiguous() and flat.numel() >= nbytes
    mem = flat.numpy().data.cast("B")
    direct = getattr(os, "O_DIRECT", 0)
    if direct and flat.data_ptr() % BLOCK == 0 and flat.numel() >= padded(nbytes):
        try:
            _write_all(path, mem[: padded(nbytes)], os.O_WRONLY | os.O_CREAT | direct, nbytes)
        except OSError:
            direct = 0  # (EINVAL: not here) written again through the page cache
    else:
        direct = 0
    if not direct:
        _write_all(path, mem[:nbytes], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, nbytes)
    return hashlib.sha256(mem[:nbytes]).hexdigest()


def _write_all(path: Path, data: memoryview, flags: int, size: int) -> None:
    fd = os.open(path, flags, 0o644)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        os.ftruncate(fd, size)  # (a direct write's last block was padded)
        os.fsync(fd)
    finally:
        os.close(fd)


def load_tensors(path: Path, manifest: dict[str, Any]) -> dict[int, torch.Tensor]:
    """The tensors of a verified checkpoint, by their index in its structure."""
    if manifest["format"] == 2:
        import torch.distributed.checkpoint as dcp

        old = {
            f"t{i}": torch.empty(shape, dtype=getattr(torch, dtype))
            for i, (dtype, shape) in enumerate(manifest["shapes"])
        }
        dcp.load(old, checkpoint_id=path, no_dist=True)
        return {int(k[1:]): v for k, v in old.items()}
    size = manifest["files"][TENSORS][0]
    out = {}
    with open(path / TENSORS, "rb", buffering=0) as f:
        for i, (dtype, shape, off) in enumerate(manifest["tensors"]):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            mem = t.reshape(-1).view(torch.uint8).numpy().data.cast("B")
            if off < 0 or off + len(mem) > size:
                raise CheckpointError(f"{path}: tensor {i} lies outside {TENSORS}")
            f.seek(off)
            if f.readinto(mem) != len(mem):
                raise CheckpointError(f"{path}: {TENSORS} ends inside tensor {i}")
            out[i] = t
    return out


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
