"""st.py -- a minimal safetensors writer and reader, from the format spec.

A safetensors file is
    8 bytes   N, the header length, little-endian unsigned 64-bit
    N bytes   a JSON object {name: {"dtype": "F32", "shape": [...],
              "data_offsets": [begin, end]}, "__metadata__": {str: str}},
              padded at the end with spaces
    the data  every tensor's raw little-endian bytes, C order; offsets are
              relative to the start of this buffer

No safetensors package is needed: only json, struct and numpy.
"""
import json
import struct

import numpy as np

_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _to_numpy(t):
    """A numpy array from a numpy array or a torch tensor."""
    if hasattr(t, "detach"):
        t = t.detach().cpu().numpy()
    return np.asarray(t)


def save(path, tensors, metadata=None, align=8):
    """Writes {name: array or torch tensor} in the given order."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        a = _to_numpy(t)
        dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        if dt not in _NAMES:
            raise ValueError("st.save: unsupported dtype %s for %s" % (a.dtype, name))
        raw = np.ascontiguousarray(a, dtype=dt).tobytes()
        header[name] = {"dtype": _NAMES[dt], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    js = json.dumps(header, separators=(",", ":")).encode("utf-8")
    js += b" " * ((-len(js)) % align)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(js)))
        f.write(js)
        for b in blobs:
            f.write(b)


def load(path):
    """Returns (tensors, metadata): an ordered {name: numpy array} (file
    order, by data offset) and the __metadata__ dict ({} if none)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError("%s: shorter than the 8-byte header length" % path)
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise ValueError("%s: header length %d past the end" % (path, n))
    header = json.loads(data[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {}) or {}
    buf = memoryview(data)[8 + n:]
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    out, expect = {}, 0
    for name, info in items:
        dt = _DTYPES[info["dtype"]]
        b, e = info["data_offsets"]
        shape = tuple(info["shape"])
        if b != expect or e < b or e > len(buf):
            raise ValueError("%s: bad data_offsets for %s" % (path, name))
        count = int(np.prod(shape, dtype=np.int64))
        if (e - b) != count * dt.itemsize:
            raise ValueError("%s: %s has %d bytes, shape needs %d"
                             % (path, name, e - b, count * dt.itemsize))
        out[name] = np.frombuffer(buf[b:e], dtype=dt).reshape(shape).copy()
        expect = e
    if expect != len(buf):
        raise ValueError("%s: %d bytes after the last tensor"
                         % (path, len(buf) - expect))
    return out, meta
