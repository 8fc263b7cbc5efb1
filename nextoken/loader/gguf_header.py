"""The header of a GGUF file (metadata and tensor table) in one pass, without per-item objects.

The `gguf` package's ``GGUFReader`` builds a NumPy view for every part of every field, which for
a vocabulary of 150k tokens and merges is most of a cold start. This reader walks the same layout (the GGUF spec, ``docs/gguf.md`` of
ggml, versions 2 and 3, little-endian) with `struct` over a memory map: numeric arrays come out
of one ``numpy.frombuffer`` each, string arrays out of one loop of slices. It returns what
``ReaderField.contents()`` returns (str, int, float, bool, lists), which a test holds equal to
the `gguf` reader's on real and tiny files; the type codes and block sizes are the `gguf`
package's constants. Anything it does not read (a big-endian file, an unknown value type)
raises `GGUFHeaderError`, and the caller falls back to the `gguf` reader.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # gguf spec: general.alignment, when absent

# GGUFValueType codes (gguf-py constants.py) -> struct format of one scalar
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """The file is not a GGUF header this reader takes (the caller may try the `gguf` reader)."""


class _Cursor:
    def __init__(self, buf: mmap.mmap):
        self.buf, self.off = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.off)[0]
        self.off += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        end = self.off + n
        if end > len(self.buf):
            raise GGUFHeaderError("a string runs past the end of the file")
        s = self.buf[self.off : end].decode("utf-8")
        self.off = end
        return s

    def strings(self, count: int) -> list[str]:
        buf, off, out = self.buf, self.off, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            n = unpack(buf, off)[0]
            off += 8
            out.append(buf[off : off + n].decode("utf-8"))
            off += n
        if off > len(buf):
            raise GGUFHeaderError("a string array runs past the end of the file")
        self.off = off
        return out

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype == STRING:
                return self.strings(count)
            if etype in _NUMPY:
                arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.off)
                self.off += arr.nbytes
                return arr.tolist()
            raise GGUFHeaderError(f"array of value type {etype} is not read here")
        raise GGUFHeaderError(f"value type {vtype} is not read here")


def read_header(path: str) -> tuple[dict[str, Any], list[tuple[str, str, tuple[int, ...], int, int]]]:
    """(metadata key -> value, tensors) of the GGUF file at `path`; each tensor is (name, GGML
    type name, PyTorch-order shape, absolute file offset of its data, byte size). Raises
    `GGUFHeaderError` for what this reader does not take, `OSError` for an unreadable file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        c = _Cursor(buf)
        if buf[:4] != GGUF_MAGIC:
            raise GGUFHeaderError("no GGUF magic")
        c.off = 4
        version = c.unpack("<I")
        if version not in (2, 3):
            raise GGUFHeaderError(f"GGUF version {version} (big-endian, or not 2 or 3)")
        n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
        fields = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}  # as the gguf reader
        for _ in range(n_kv):
            key = c.string()
            fields[key] = c.value(c.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.unpack("<Q") for _ in range(c.unpack("<I"))]
            ttype, offset = GGMLQuantizationType(c.unpack("<I")), c.unpack("<Q")
            block, type_size = GGML_QUANT_SIZES[ttype]
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            infos.append((name, ttype.name, tuple(reversed(dims)), offset, n // block * type_size))
        align = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-c.off // align) * align
        return fields, [(n, t, s, data_start + off, nb) for n, t, s, off, nb in infos]
    except (struct.error, UnicodeDecodeError, ValueError, KeyError) as exc:
        if isinstance(exc, GGUFHeaderError):
            raise
        raise GGUFHeaderError(f"{type(exc).__name__}: {exc}") from None
    finally:
        buf.close()
