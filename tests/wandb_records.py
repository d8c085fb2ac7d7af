"""Reading an offline W&B run back, for the tests that check what reached W&B.

An offline run's `run-*.wandb` file is W&B's transaction log in the LevelDB log format: a 7-byte
header, then 32 KiB blocks of records (crc32, uint16 length, type, payload), each payload a
`wandb_internal_pb2.Record`; wandb ships no reader for it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
FULL, LAST, ZERO = 1, 4, 0


def history(path: Path) -> dict[int, dict]:
    """The history rows of one offline run file, by step (records of the same step merged)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows: dict[int, dict] = {}
    offset, payload = 7, b""
    while offset + 7 <= len(data):
        if BLOCK - offset % BLOCK < 7:  # a block's tail too short for a header is padding
            offset += BLOCK - offset % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        payload += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                rows.setdefault(int(row["_step"]), {}).update(row)
        elif kind == ZERO:
            break
    return rows
