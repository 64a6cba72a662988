"""NATS key escapes (``fastft.bus.nats.escape_key``): the plain keys' fast path writes
what the escape of each character writes, and every escape reads back."""

from __future__ import annotations

import random

from fastft.bus.nats import escape_by_character, escape_key
from fastft.bus.natswatch import unescape_key
from fastft.protocol.keys import JobKeys


def test_every_key_escapes_as_character_by_character_and_reads_back():
    rng = random.Random(0)
    keys = JobKeys("job-1")
    some = [keys.epoch_arrival(3, 17), keys.joiner(5), keys.bus_members, "a//b", "/a/", ""]
    some += ["".join(rng.choice("ab/_-.=é Z9") for _ in range(rng.randint(0, 9))) for _ in range(20000)]  # fmt: skip
    for k in some:
        assert escape_key(k) == escape_by_character(k), k
        assert not k or unescape_key(escape_key(k)) == k, k  # (the empty key is "=00")
    assert escape_key(keys.epoch_arrival(3, 17)) == "fastft.job-1.ep.3.arrived.17"
