"""The durable tier's on-disk format 3 (one flat tensor file, written directly from the
writer's buffer): every dtype and shape round-trips bitwise by either path, the direct
write falls back to the page cache where the file system refuses it, a format-2 (DCP)
checkpoint of an earlier fastft still loads, and a manifest that places a tensor outside
its file is refused."""

from __future__ import annotations

import errno
import hashlib
import json
import os

import pytest
import torch

from fastft.runtime.durable import disk
from fastft.runtime.durable.checkpoints import Checkpoints
from fastft.runtime.durable.disk import CheckpointError, layout, verify, views, write_flat
from fastft.runtime.durable.writer import SharedBuffer

pytestmark = pytest.mark.timeout(60)


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randn(33, 7, generator=g),
        torch.randn(5, generator=g).to(torch.bfloat16),
        torch.tensor(2.5, dtype=torch.float64),  # 0-dim
        torch.tensor([True, False, True]),
        torch.empty(0, 4),
        torch.randint(-100, 100, (3, 3), generator=g, dtype=torch.int8),
        torch.randn(2, 2, generator=g, dtype=torch.complex64),
    ]


def _state() -> dict:
    return {"step": 12, "t": _tensors(), "note": "kept"}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(-1), y.view(-1))
        for x, y in zip(a, b, strict=True)
    )


def _opens(monkeypatch) -> list[tuple[str, int]]:
    seen: list[tuple[str, int]] = []
    real = os.open

    def recording(path, flags, *a, **k):  # type: ignore[no-untyped-def]
        seen.append((str(path), flags))
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", recording)
    return seen


def test_the_writers_shared_buffer_is_written_directly_and_loads_bitwise(tmp_path, monkeypatch):
    tensors = _tensors()
    entries, nbytes = layout(tensors)
    buf = SharedBuffer(nbytes)
    try:
        assert buf.nbytes % disk.BLOCK == 0 and buf.flat.data_ptr() % disk.BLOCK == 0
        for t, v in zip(tensors, views(buf.flat, entries), strict=True):
            v.copy_(t)
        opens = _opens(monkeypatch)
        structure = json.dumps({"step": 12}).encode()
        path, size = write_flat(tmp_path, 12, 1, structure, entries, buf.flat, nbytes)
    finally:
        buf.unlink()
    direct = getattr(os, "O_DIRECT", 0)
    flags = [f for p, f in opens if p.endswith(disk.TENSORS)]
    assert direct and flags and flags[0] & direct  # tried directly first
    manifest = verify(path)
    assert (path / disk.TENSORS).stat().st_size == nbytes  # the padding cut off
    assert size == nbytes + len(structure)
    loaded = disk.load_tensors(path, manifest)
    assert _same([loaded[i] for i in range(len(tensors))], tensors)


def test_the_in_process_write_round_trips_every_dtype(tmp_path):
    path, _ = disk.write_checkpoint(tmp_path, 12, 1, _state())
    state = Checkpoints.load(path)
    assert state["step"] == 12 and state["note"] == "kept"
    assert _same(state["t"], _tensors())


def test_a_file_system_that_refuses_direct_writes_gets_a_buffered_one(tmp_path, monkeypatch):
    real = os.open
    direct = getattr(os, "O_DIRECT", 0)

    def no_direct(path, flags, *a, **k):  # type: ignore[no-untyped-def]
        if flags & direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", no_direct)
    tensors = _tensors()
    entries, nbytes = layout(tensors)
    buf = SharedBuffer(nbytes)
    try:
        for t, v in zip(tensors, views(buf.flat, entries), strict=True):
            v.copy_(t)
        path, _ = write_flat(tmp_path, 3, 1, b"{}", entries, buf.flat, nbytes)
    finally:
        buf.unlink()
    loaded = disk.load_tensors(path, verify(path))
    assert _same([loaded[i] for i in range(len(tensors))], tensors)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_format_2_checkpoint_of_an_earlier_fastft_still_loads(tmp_path):
    """Format 2: DCP's files, the manifest's ``shapes`` (what fastft wrote until format 3)."""
    import torch.distributed.checkpoint as dcp

    import fastft.runtime.state.tree as tree

    tensors: list[torch.Tensor] = []
    structure = tree.dump(_state(), tensors)
    path = tmp_path / disk.checkpoint_name(12)
    dcp.save({f"t{i}": t for i, t in enumerate(tensors)}, checkpoint_id=path, no_dist=True)
    (path / disk.STRUCTURE).write_bytes(structure)
    files = {
        f.name: (f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest())
        for f in sorted(path.iterdir())
    }
    shapes = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    manifest = {"format": 2, "step": 12, "epoch": 1, "shapes": shapes, "files": files}
    (path / disk.MANIFEST).write_text(json.dumps(manifest))
    state = Checkpoints.load(path)
    assert state["step"] == 12 and _same(state["t"], _tensors())


def test_a_tensor_placed_outside_its_file_is_refused(tmp_path):
    path, _ = disk.write_checkpoint(tmp_path, 12, 1, _state())
    manifest = verify(path)
    manifest["tensors"][0][2] = manifest["files"][disk.TENSORS][0]  # past the end
    with pytest.raises(CheckpointError, match="outside"):
        disk.load_tensors(path, manifest)
    manifest["format"] = 9
    (path / disk.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format 9, this fastft reads"):
        verify(path)
