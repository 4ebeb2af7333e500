"""Binary frames for the edge API: small, no base64.

    frame = b"MOAE" | u32 header length | JSON header | tensor bytes
    header["tensors"] = [{"name", "shape", "dtype", "offset", "nbytes", "scale_offset"?}, ...]

int8 stores each row (last dim) as round(x / s * 127) with one fp16 scale s = max|row| per row:
a quarter of fp32, and what the client's drafter reads changes by < 1% of each row's range.
"""

from __future__ import annotations

import json
import struct

import torch

MAGIC = b"MOAE"
MEDIA_TYPE = "application/x-moa-edge"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}


class FrameError(ValueError):
    """A frame is truncated or malformed."""


def _to_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bf16: ship the raw 16-bit patterns
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _from_bytes(buf: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    if not buf:
        return torch.zeros(
            [0 if s == -1 else s for s in shape], dtype=torch.int16 if dtype == "bf16" else DTYPES[dtype]
        ).view(DTYPES[dtype])
    if dtype == "bf16":
        return torch.frombuffer(bytearray(buf), dtype=torch.int16).view(torch.bfloat16).reshape(shape)
    return torch.frombuffer(bytearray(buf), dtype=DTYPES[dtype]).reshape(shape)


def pack(header: dict, tensors: dict[str, torch.Tensor], dtype: str = "fp16") -> bytes:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    index, blobs, offset = [], [], 0
    for name, t in tensors.items():
        t = t.detach().float()
        entry = {"name": name, "shape": list(t.shape), "dtype": dtype}
        if dtype == "int8":
            rows = t.reshape(-1, t.shape[-1]) if t.numel() else t.reshape(0, 1)
            scale = rows.abs().amax(-1).clamp_min(1e-8).to(torch.float16)
            q = torch.round(rows / scale.float()[:, None] * 127).clamp(-127, 127).to(torch.int8)
            data, sdata = _to_bytes(q), _to_bytes(scale)
            entry["scale_offset"] = offset + len(data)
            blob = data + sdata
        else:
            data = _to_bytes(t.to(DTYPES[dtype]))
            blob = data
        entry.update(offset=offset, nbytes=len(data))
        index.append(entry)
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps({**header, "tensors": index}, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + b"".join(blobs)


def unpack(frame: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    if len(frame) < 8 or frame[:4] != MAGIC:
        raise FrameError("not an edge frame")
    (n,) = struct.unpack("<I", frame[4:8])
    if 8 + n > len(frame):
        raise FrameError("truncated frame header")
    header = json.loads(frame[8 : 8 + n])
    body = frame[8 + n :]
    tensors = {}
    for e in header.pop("tensors", []):
        end = e["offset"] + e["nbytes"]
        if end > len(body):
            raise FrameError(f"truncated tensor {e['name']}")
        if e["dtype"] == "int8":
            rows = int(torch.tensor(e["shape"][:-1]).prod()) if len(e["shape"]) > 1 else 1
            q = _from_bytes(body[e["offset"] : end], "int8", [rows, -1] if rows else [0, 1]).float()
            scale = _from_bytes(body[e["scale_offset"] : e["scale_offset"] + 2 * rows], "fp16", [rows]).float()
            tensors[e["name"]] = (q * scale[:, None] / 127).reshape(e["shape"])
        else:
            tensors[e["name"]] = _from_bytes(body[e["offset"] : end], e["dtype"], e["shape"]).float()
    return header, tensors
