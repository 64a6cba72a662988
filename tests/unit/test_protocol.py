"""Wire protocol: round trips, and decode raises ProtocolError and nothing else."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastft.protocol import (
    MESSAGE_TYPES,
    NO_STEP,
    DrainAck,
    DrainRequest,
    Fault,
    HangSuspected,
    Inject,
    ProcessExited,
    ProtocolError,
    Role,
    Severity,
    decode,
    encode,
)
from fastft.protocol.codec import HEADER, MAGIC
from fastft.protocol.messages import body_fields

JOB = "job-1"

headers = st.fixed_dictionaries(
    {
        "job": st.text(st.characters(codec="utf-8"), min_size=1, max_size=40),
        "epoch": st.integers(0, 2**32 - 1),
        "rank": st.integers(-1, 2**31 - 1),
        "incarnation": st.integers(0, 2**64 - 1),
        "step": st.integers(-1, 2**63 - 1),
        "seq": st.integers(0, 2**64 - 1),
        "wall_time": st.floats(allow_nan=False, allow_infinity=False),
        "role": st.sampled_from(Role),
    }
)
text = st.text(max_size=200)
ranks = st.integers(0, 2**31 - 1)
incs = st.integers(0, 2**64 - 1)
bodies = {
    Fault: st.fixed_dictionaries(
        {
            "severity": st.sampled_from(Severity),
            "cause": text,
            "faulty_rank": ranks,
            "faulty_incarnation": incs,
            "detail": text,
        }
    ),
    ProcessExited: st.one_of(
        st.fixed_dictionaries(
            {
                "exited_rank": ranks,
                "exited_incarnation": incs,
                "exit_code": st.integers(-(2**31) + 1, 2**31 - 1),
                "signal": st.none(),
            }
        ),
        st.fixed_dictionaries(
            {
                "exited_rank": ranks,
                "exited_incarnation": incs,
                "exit_code": st.none(),
                "signal": st.integers(1, 255),
            }
        ),
    ),
    HangSuspected: st.fixed_dictionaries(
        {
            "hung_rank": ranks,
            "hung_incarnation": incs,
            "silent_for_s": st.floats(0, 1e9),
            "stopped": st.booleans(),
        }
    ),
    Inject: st.fixed_dictionaries(
        {
            "target_rank": ranks,
            "fault_kind": text.filter(bool),
            "at_step": st.integers(-1, 2**63 - 1),
            "arg": st.floats(allow_nan=False, allow_infinity=False),
        }
    ),
    DrainAck: st.fixed_dictionaries({"drained_rank": ranks}),
    DrainRequest: st.one_of(
        st.fixed_dictionaries({"target_rank": ranks, "reason": text}),
        st.fixed_dictionaries({"target_node": ranks, "reason": text}),
    ),
}


def _message_strategy():
    options = []
    for cls in MESSAGE_TYPES.values():
        body = bodies.get(cls)
        if body is None:
            assert not body_fields(cls) or set(body_fields(cls)) == {"reason"}
            body = st.fixed_dictionaries({"reason": text} if body_fields(cls) else {})
        options.append(st.builds(lambda h, b, cls=cls: cls(**h, **b), headers, body))
    return st.one_of(options)


messages = _message_strategy()


@given(messages)
@settings(max_examples=400)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg
    assert decode(encode(msg), job=msg.job) == msg


@given(st.binary(max_size=400))
@settings(max_examples=500)
def test_random_bytes_raise_only_protocol_error(data):
    try:
        decode(data, job=JOB)
    except ProtocolError:
        pass


@given(messages, st.data())
@settings(max_examples=300)
def test_truncated_raises_protocol_error(msg, data):
    raw = encode(msg)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(ProtocolError):
        decode(raw[:cut])


@given(messages, st.data())
@settings(max_examples=300)
def test_corrupted_bytes_never_raise_anything_else(msg, data):
    raw = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    try:
        out = decode(bytes(raw))
    except ProtocolError:
        return
    assert type(out) in MESSAGE_TYPES.values()  # a flip that still decodes is a valid message


@given(messages, st.integers(0, 255).filter(lambda v: v != 1))
def test_wrong_version_is_rejected(msg, version):
    raw = bytearray(encode(msg))
    raw[2] = version
    with pytest.raises(ProtocolError, match="version"):
        decode(bytes(raw))


@given(messages)
def test_wrong_job_is_rejected(msg):
    with pytest.raises(ProtocolError, match="job"):
        decode(encode(msg), job=msg.job + "-other")


def _fault(**kw):
    base = dict(
        job=JOB,
        epoch=1,
        rank=2,
        incarnation=7,
        step=9,
        severity=Severity.FAULT2,
        cause="boom",
        faulty_rank=2,
    )
    base.update(kw)
    return Fault(**base)


def test_encoding_is_compact_and_stable():
    raw = encode(_fault())
    assert raw[:2] == MAGIC and raw[2] == 1 and raw[3] == Fault.KIND
    assert len(raw) < 160
    # the byte layout of the header is part of the contract
    assert HEADER.format == ">2sBBIiQqQdBH"
    assert struct.unpack_from(">I", raw, 4)[0] == 1


@pytest.mark.parametrize(
    "kw",
    [
        {"job": ""},
        {"epoch": -1},
        {"rank": -2},
        {"step": -5},
        {"severity": 3},
        {"severity": True},
        {"cause": 5},
        {"faulty_rank": -1},
        {"wall_time": float("nan")},
        {"cause": "x" * 70_000},
    ],
)
def test_invalid_fields_raise_protocol_error(kw):
    with pytest.raises(ProtocolError):
        _fault(**kw)


def test_body_with_extra_or_missing_fields_is_rejected():
    raw = encode(_fault())
    head_len = HEADER.size + len(JOB)
    for body in (
        b'{"cause":"x"}',
        b"[]",
        b'{"cause":"x","detail":"","faulty_incarnation":0,"faulty_rank":2,"severity":2,"extra":1}',
        b"\xff\xfe",
    ):
        with pytest.raises(ProtocolError):
            decode(raw[:head_len] + body)


def test_process_exited_needs_exactly_one_of_code_and_signal():
    kw = dict(job=JOB, epoch=0, rank=-1, incarnation=1, exited_rank=0, exited_incarnation=3)
    with pytest.raises(ProtocolError):
        ProcessExited(**kw)
    with pytest.raises(ProtocolError):
        ProcessExited(**kw, exit_code=1, signal=9)
    assert ProcessExited(**kw, signal=9).severity is Severity.FAULT1


def test_inject_defaults():
    m = Inject(job=JOB, epoch=0, rank=-1, incarnation=1, target_rank=3, fault_kind="sigkill")
    assert m.at_step == NO_STEP and decode(encode(m)) == m
