"""Nothing from a peer is executed (issue 21): a heal's header and a checkpoint's structure
are JSON around tensors, and no module of fastft unpickles bytes from elsewhere."""

from __future__ import annotations

import json
import os
import pickle
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import fastft
from fastft.runtime.state import tree
from fastft.runtime.state.registry import StateRegistry


class _Data:
    def __init__(self) -> None:
        self.pos = 3
        self.rng = np.random.default_rng(0).bit_generator.state
        self.extra = {1: (b"\x00\xff", torch.float16, torch.Size([2, 3]), np.arange(4))}

    def state_dict(self):
        return {"pos": self.pos, "rng": self.rng, "extra": self.extra}

    def load_state_dict(self, s):
        self.pos, self.rng, self.extra = s["pos"], s["rng"], s["extra"]


def _registry(seed: int) -> StateRegistry:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    reg = StateRegistry()
    reg.register(model, opt, data=_Data())
    return reg


def test_a_heal_round_trips_through_json():
    src, dst = _registry(0), _registry(1)
    src._others["data"].pos = 11
    header, wires = src.pack(7, defer=True)
    meta = json.loads(header)  # plain JSON, nothing else
    assert set(meta) == {"sections", "entries", "buffers", "tail"}
    got = StateRegistry.allocate(header)
    for g, w in zip(got, wires, strict=True):
        g.copy_(w)
    assert dst.load_packed(header, got) == 7
    assert dst.digest(7) == src.digest(7)
    d = dst._others["data"]
    assert d.pos == 11 and d.rng == src._others["data"].rng
    b, dt, size, arr = d.extra[1]
    assert (b, dt, size) == (b"\x00\xff", torch.float16, torch.Size([2, 3]))
    assert np.array_equal(arr, np.arange(4))
    sd = dst.model.state_dict()
    assert isinstance(sd, OrderedDict) and hasattr(sd, "_metadata")


def test_a_pickled_header_is_rejected_with_no_side_effect(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = pickle.dumps({"sections": Evil(), "entries": [], "buffers": [], "tail": 0})
    reg = _registry(0)
    before = reg.digest(0)
    for call in (
        lambda: reg.load_packed(evil, []),
        lambda: StateRegistry.allocate(evil),
        lambda: StateRegistry.tail(evil),
    ):
        with pytest.raises(ValueError, match="heal"):
            call()
    assert not marker.exists()
    assert reg.digest(0) == before


@pytest.mark.parametrize(
    "header",
    [
        {"sections": {}, "entries": [], "buffers": [["disk", 4]], "tail": 0},
        {"sections": {}, "entries": [["model", 0, "load", [1], 0, 0]], "buffers": [["cpu", 4]],
         "tail": 1},
        {"sections": {}, "entries": [["model", 0, "float32", [9], 0, 0]],
         "buffers": [["cpu", 4]], "tail": 1},
        {"sections": {"model": '{"T": 5}'}, "entries": [], "buffers": [], "tail": 0},
        {"sections": {"model": '{"__reduce__": ["os.system", "x"]}'}, "entries": [],
         "buffers": [], "tail": 0},
        {"sections": {}, "entries": [], "buffers": [], "tail": 0, "extra": 1},
    ],
)  # fmt: skip
def test_crafted_json_headers_are_rejected(header):
    reg = _registry(0)
    raw = json.dumps(header).encode()
    wires = [torch.zeros(4, dtype=torch.uint8)] * len(header["buffers"])
    with pytest.raises(ValueError):
        reg.load_packed(raw, wires)


def test_a_state_that_json_cannot_hold_fails_at_the_sender_and_says_where():
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"others\.x\.y is a .*Opaque.*state_dict"):
        tree.dump({"x": {"y": Opaque()}}, [], "others")


def test_tree_rejects_what_it_did_not_write():
    for bad in (b"\x80\x04", b'{"np": ["O", [1], ""]}', b'{"dtype": "load"}', b"[1]"):
        with pytest.raises(ValueError):
            tree.load(bad, {})


_UNPICKLE = re.compile(r"pickle\.loads?\(|Unpickler\b|marshal\.loads?\(|\beval\(|\bexec\(")
_ALLOWED = {
    "runtime/durable/writer.py": "messages on the pipe between a worker and its own writer child",
    "sim/explore.py": "the simulator's copies of its own state, in one process",
    "ray/entry.py": "a Trainer's training function, pickled by the job's own driver and "
    "written into the run directory on each node by the job's agent actor (as the script "
    "itself: the same trust)",
}


def test_no_module_unpickles_bytes_from_elsewhere():
    src = Path(fastft.__file__).parent
    hits = []
    for f in sorted(src.rglob("*.py")):
        rel = f.relative_to(src).as_posix()
        for n, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _UNPICKLE.search(code) and rel not in _ALLOWED:
                hits.append(f"{rel}:{n}: {line.strip()}")
            if "torch.load(" in code and "weights_only=True" not in code:
                hits.append(f"{rel}:{n}: {line.strip()} (torch.load needs weights_only=True)")
    assert not hits, hits
