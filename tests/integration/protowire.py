"""Raw protobuf wire bytes for the fuzz tests: fields a message class would refuse to
serialize (invalid UTF-8 in a string), appended to a serialized message."""

from __future__ import annotations


def length_delimited(field: int, payload: bytes) -> bytes:
    """One protobuf field of wire type 2 (the length as a varint)."""
    out = bytearray([field << 3 | 2])
    n = len(payload)
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out) + payload
