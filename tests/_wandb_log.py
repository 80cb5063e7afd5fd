"""A reader for W&B's offline run log (`run-ID.wandb`), for tests: wandb 0.31 ships none.

The file is a `:W&B` header (4-byte magic, 2-byte 0xBEE1, 1-byte version) followed by 32 KiB blocks of
LevelDB-style log records: 7-byte header (crc32, little-endian uint16 length, type: 1 full, 2 first,
3 middle, 4 last), then the payload; a block tail shorter than a header is zero padding. Each complete
payload is one serialized `wandb.proto.wandb_internal_pb2.Record`.
"""

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = struct.Struct("<IHB")


def read_records(path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run log")
    records, pending, position = [], b"", 7
    while position + HEADER.size <= len(data):
        left = BLOCK - position % BLOCK
        if left < HEADER.size:
            position += left
            continue
        _, length, kind = HEADER.unpack_from(data, position)
        if kind == 0 and length == 0:  # padding to the end of the block
            position += left
            continue
        payload = data[position + HEADER.size : position + HEADER.size + length]
        position += HEADER.size + length
        if kind == 1:
            chunks = [payload]
        elif kind == 2:
            pending, chunks = payload, None
        elif kind == 3:
            pending, chunks = pending + payload, None
        else:
            chunks, pending = [pending + payload], b""
        for chunk in chunks or []:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
    return records


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def summarize_run(path) -> dict:
    """The run's identity, config, history rows, summary and artifacts from its .wandb log."""
    run, config, history, summary, artifacts, exit_ = None, {}, [], {}, [], None
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            summary.update({_key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "artifact":
            artifacts.append(record.artifact)
        elif kind == "exit":
            exit_ = record.exit
    return {"run": run, "config": config, "history": history, "summary": summary, "artifacts": artifacts,
            "exit": exit_}
