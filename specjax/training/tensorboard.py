"""TensorBoard event files without TensorFlow: scalar summaries in the format TensorBoard reads.

An event file is a sequence of TFRecords, each::

    uint64 length | uint32 masked_crc32c(length bytes) | data[length] | uint32 masked_crc32c(data)

(little endian; ``masked(c) = ((c >> 15 | c << 17) + 0xa282ead8) mod 2³²`` of the CRC-32C
(Castagnoli) checksum). Each ``data`` is a serialized ``tensorflow.Event`` protobuf; the first one
carries ``file_version = "brain.Event:2"``, the others a ``Summary`` of scalars::

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

The few protobuf fields are encoded by hand here, so no protobuf schema or TensorFlow is needed.
:func:`read_events` parses the files back (checking every CRC), for tests and scripts.

A resumed run starts a new file; TensorBoard drops the steps of an older file that a newer file
rewrites (its "orphaned data" purge, keyed on ``file_version``).
"""
from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time
from typing import Mapping, Optional

FILE_VERSION = "brain.Event:2"
_COUNTER = itertools.count()


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # reflected Castagnoli polynomial
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The TFRecord checksum: CRC-32C rotated right by 15 bits plus a constant (mod 2³²)."""
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# protobuf wire format (the few fields used)
# ---------------------------------------------------------------------------------------------
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64: negative values as 10-byte two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _len_field(number: int, payload: bytes) -> bytes:
    return _field(number, 2, _varint(len(payload)) + payload)


def encode_event(wall_time: float, step: int = 0, *, file_version: Optional[str] = None,
                 scalars: Optional[Mapping[str, float]] = None) -> bytes:
    """A serialized ``Event`` with the file version or a summary of scalar values."""
    out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(int(step)))
    if file_version is not None:
        out += _len_field(3, file_version.encode())
    if scalars:
        summary = b"".join(
            _len_field(1, _len_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", float(v))))
            for tag, v in scalars.items())
        out += _len_field(5, summary)
    return out


def frame(record: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, the data's masked CRC."""
    header = struct.pack("<Q", len(record))
    return (header + struct.pack("<I", masked_crc32c(header)) + record
            + struct.pack("<I", masked_crc32c(record)))


class EventWriter:
    """Appends scalar summaries to a new ``events.out.tfevents.*`` file in ``logdir`` (created,
    with its file-version event, at the first write)."""

    def __init__(self, logdir: str):
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_COUNTER)}")
        self.path = os.path.join(logdir, name)
        self._started = False

    def scalars(self, step: int, values: Mapping[str, float],
                wall_time: Optional[float] = None) -> None:
        """Writes ``{tag: value}`` at ``step`` (one event; the file is flushed and closed)."""
        record = encode_event(time.time() if wall_time is None else wall_time, step,
                              scalars=values)
        if not self._started:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "wb") as f:
                f.write(frame(encode_event(time.time(), 0, file_version=FILE_VERSION)))
            self._started = True
        with open(self.path, "ab") as f:
            f.write(frame(record))


# ---------------------------------------------------------------------------------------------
# reading back
# ---------------------------------------------------------------------------------------------
def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, i
        shift += 7


def _fields(buf: bytes):
    """Yields ``(number, value)``: ints for varints, bytes for 64-bit / length / 32-bit fields."""
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = _read_varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, value


def decode_event(data: bytes) -> dict:
    """``{"wall_time", "step", "file_version" (or None), "scalars": {tag: value}}``."""
    event = {"wall_time": 0.0, "step": 0, "file_version": None, "scalars": {}}
    for number, value in _fields(data):
        if number == 1:
            event["wall_time"] = struct.unpack("<d", value)[0]
        elif number == 2:
            event["step"] = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 3:
            event["file_version"] = value.decode()
        elif number == 5:
            for vnum, v in _fields(value):
                if vnum != 1:
                    continue
                tag, simple = None, math.nan
                for n2, x in _fields(v):
                    if n2 == 1:
                        tag = x.decode()
                    elif n2 == 2:
                        simple = struct.unpack("<f", x)[0]
                event["scalars"][tag] = simple
    return event


def read_events(path: str) -> list[dict]:
    """Every event of one file, in order; raises ``ValueError`` on a bad length or CRC."""
    with open(path, "rb") as f:
        buf = f.read()
    out, i = [], 0
    while i < len(buf):
        if len(buf) - i < 12:
            raise ValueError(f"{path}: truncated record header at byte {i}")
        header = buf[i:i + 8]
        (n,) = struct.unpack("<Q", header)
        (crc,) = struct.unpack("<I", buf[i + 8:i + 12])
        if crc != masked_crc32c(header):
            raise ValueError(f"{path}: bad length CRC at byte {i}")
        data = buf[i + 12:i + 12 + n]
        if len(data) != n or len(buf) < i + 16 + n:
            raise ValueError(f"{path}: truncated record at byte {i}")
        (crc,) = struct.unpack("<I", buf[i + 12 + n:i + 16 + n])
        if crc != masked_crc32c(data):
            raise ValueError(f"{path}: bad data CRC at byte {i}")
        out.append(decode_event(data))
        i += 16 + n
    return out


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` over every event file in ``logdir`` (files in name order,
    i.e. creation order)."""
    out: dict[str, list] = {}
    for name in sorted(os.listdir(logdir)):
        if name.startswith("events.out.tfevents."):
            for ev in read_events(os.path.join(logdir, name)):
                for tag, v in ev["scalars"].items():
                    out.setdefault(tag, []).append((ev["step"], v))
    return out
