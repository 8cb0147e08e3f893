"""The entry: one chunk of one group saved by one rank, as bytes on disk or in the DRAM pool.

Layout: ``MAGIC`` (8 B) | format version (u32 LE) | header length (u32 LE) | blake2b-128 of the
header (16 B) | header (msgpack :class:`Header`) | payload (the sections back to back). Each
:class:`Section` carries the CRC32 of its bytes and the file's total size follows from the
header, so a truncated, torn or bit-flipped entry fails :func:`decode` with
:class:`CorruptEntry`. CRC32 (zlib, ~4 GB/s here) guards against accidents, not adversaries; the
store directory is local and as trusted as the engine.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

import msgspec
import numpy as np

from kvxferd.store.canonical import FORMAT_VERSION

MAGIC = b"KVXSTORE"
_PREFIX = struct.Struct("<8sII16s")
PREFIX_BYTES = _PREFIX.size


class Section(msgspec.Struct, frozen=True, array_like=True):
    """One (layer, part) over global units ``[unit_start, unit_start + units)``."""

    layer: int
    part: str
    unit_start: int
    units: int
    unit_bytes: int
    crc: int


class Header(msgspec.Struct, frozen=True, kw_only=True):
    """What an entry holds and who wrote it (the writer fields are informational)."""

    key: str
    group_fp: str
    kind: str
    chunk: int
    """Chunk index in the prompt."""
    tokens: int
    """Tokens this chunk covers (attention rows per head; the state's position for mamba)."""
    writer_tp_size: int
    writer_tp_rank: int
    writer_block_size: int
    writer_kernel_block_size: int
    sections: list[Section]


class CorruptEntry(Exception):
    """An entry's bytes do not match its header or checksums (internal; the store counts it)."""


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Header)


def payload_bytes(header: Header) -> int:
    """Bytes of the payload the header describes."""
    return sum(s.units * s.unit_bytes for s in header.sections)


def encode_head(header: Header) -> bytes:
    """The entry's prefix and header; the sections' bytes follow it, in header order."""
    head = _enc.encode(header)
    digest = hashlib.blake2b(head, digest_size=16).digest()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(head), digest) + head


def section(layer: int, part: str, unit_start: int, data: np.ndarray, crc: bool = True) -> Section:
    """The Section of ``data`` (units, ...), with its CRC unless ``crc`` is False (0 then: an
    entry that only lives in DRAM needs none, see :func:`with_crcs`)."""
    units = data.shape[0]
    value = zlib.crc32(memoryview(data).cast("B")) if crc else 0
    return Section(layer, part, unit_start, units, data.nbytes // max(units, 1), value)


def with_crcs(header: Header, views: list[memoryview]) -> Header:
    """The header with every section's CRC computed from its bytes (before a file is written)."""
    secs = [msgspec.structs.replace(s, crc=zlib.crc32(v)) for s, v in zip(header.sections, views,
                                                                         strict=True)]  # fmt: skip
    return msgspec.structs.replace(header, sections=secs)


def read_header(prefix_and_more: bytes | memoryview, size: int) -> tuple[Header, int]:
    """Parse and check the header; (header, payload offset). ``size`` is the entry's length."""
    buf = memoryview(prefix_and_more)
    if len(buf) < PREFIX_BYTES:
        raise CorruptEntry(f"{len(buf)} bytes, shorter than the prefix")
    magic, version, hlen, digest = _PREFIX.unpack_from(buf)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptEntry(f"magic {magic!r} version {version}")
    if len(buf) < PREFIX_BYTES + hlen:
        raise CorruptEntry("header cut short")
    head = buf[PREFIX_BYTES : PREFIX_BYTES + hlen]
    if hashlib.blake2b(head, digest_size=16).digest() != digest:
        raise CorruptEntry("header checksum")
    try:
        header = _dec.decode(head)
    except msgspec.DecodeError as exc:
        raise CorruptEntry(f"header: {exc}") from None
    start = PREFIX_BYTES + hlen
    if size != start + payload_bytes(header):
        raise CorruptEntry(f"{size} bytes, header says {start + payload_bytes(header)}")
    return header, start


def sections(header: Header, payload: memoryview) -> list[memoryview]:
    """Each section's bytes (checked against its CRC; CorruptEntry on a mismatch, naming the
    section by its place: its part name is the file's text, unchecked, and goes into logs)."""
    out, at = [], 0
    for i, s in enumerate(header.sections):
        n = s.units * s.unit_bytes
        view = payload[at : at + n]
        if len(view) != n or zlib.crc32(view) != s.crc:
            raise CorruptEntry(f"section {i} (layer {s.layer}) checksum")
        out.append(view)
        at += n
    return out
