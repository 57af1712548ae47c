"""TensorBoard event files written without TensorFlow: the checksum, the record framing, the
protobuf encoding, and the files a training run writes next to ``metrics.jsonl``."""
import math
import os
import struct

import numpy as np
import pytest
from _train_common import base_config

from specjax.training import SyntheticLMIterator, Trainer
from specjax.training import tensorboard as tb
from specjax.training.metrics import MetricsWriter, read_metrics


def test_crc32c_known_vectors():
    # RFC 3720 (iSCSI) appendix B.4 test vectors of CRC-32C
    assert tb.crc32c(b"123456789") == 0xE3069283
    assert tb.crc32c(bytes(32)) == 0x8A9136AA
    assert tb.crc32c(bytes([0xFF] * 32)) == 0x62A8AB43
    assert tb.crc32c(bytes(range(32))) == 0x46DD794E


def test_event_encoding_matches_the_protobuf_wire_format():
    # Event{wall_time=1.5, step=300, summary{value{tag="a", simple_value=0.25}}}, by hand:
    # field 1 (double): 0x09 + 8 bytes; field 2 (varint): 0x10 + varint(300) = ac 02;
    # field 5 (message): 0x2a len; Summary.value (1, message): 0x0a len;
    # Value.tag (1, string): 0x0a 01 'a'; Value.simple_value (2, float): 0x15 + 4 bytes.
    value = b"\x0a\x01a" + b"\x15" + struct.pack("<f", 0.25)
    summary = b"\x0a" + bytes([len(value)]) + value
    want = (b"\x09" + struct.pack("<d", 1.5) + b"\x10\xac\x02"
            + b"\x2a" + bytes([len(summary)]) + summary)
    assert tb.encode_event(1.5, 300, scalars={"a": 0.25}) == want
    assert tb.decode_event(want) == {"wall_time": 1.5, "step": 300, "file_version": None,
                                     "scalars": {"a": 0.25}}
    assert tb.decode_event(tb.encode_event(2.0, -3))["step"] == -3  # int64 two's complement


def test_writer_roundtrip_and_corruption_is_detected(tmp_path):
    w = tb.EventWriter(str(tmp_path))
    assert not os.listdir(tmp_path)  # nothing until the first write
    w.scalars(1, {"train/loss": 2.5, "train/lr": 1e-3})
    w.scalars(2, {"train/loss": float("nan")})
    events = tb.read_events(w.path)
    assert events[0]["file_version"] == "brain.Event:2"
    assert [(e["step"], e["scalars"]) for e in events[1:2]] == [
        (1, {"train/loss": 2.5, "train/lr": np.float32(1e-3).item()})]
    assert math.isnan(events[2]["scalars"]["train/loss"])
    data = bytearray(open(w.path, "rb").read())
    data[-5] ^= 1  # one bit of the last record's payload
    open(w.path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match="bad data CRC"):
        tb.read_events(w.path)


def test_metrics_writer_writes_the_same_scalars(tmp_path):
    w = MetricsWriter(str(tmp_path / "metrics.jsonl"))
    w.write(3, "train", {"loss": 1.25, "accuracy": 0.5})
    w.write(3, "eval/math", {"ce": 0.75})
    assert tb.read_scalars(str(tmp_path)) == {"train/loss": [(3, 1.25)],
                                              "train/accuracy": [(3, 0.5)],
                                              "eval/math/ce": [(3, 0.75)]}
    w = MetricsWriter(str(tmp_path / "off" / "metrics.jsonl"), tensorboard=False)
    w.write(1, "train", {"loss": 1.0})
    assert os.listdir(tmp_path / "off") == ["metrics.jsonl"]


def test_training_run_writes_event_file_next_to_metrics(tmp_path):
    c = base_config({"train.num_steps": 4, "checkpoint.every": 2, "output.plot": False})
    trainer = Trainer(c, workdir=str(tmp_path))
    it = SyntheticLMIterator(batch_size=8, seq_len=32,
                             vocab_size=trainer.task.model_config.vocab_size)
    trainer.train(it, None)
    trainer.close()
    files = [f for f in os.listdir(tmp_path) if f.startswith("events.out.tfevents.")]
    assert len(files) == 1
    scalars = tb.read_scalars(str(tmp_path))
    train = [r for r in read_metrics(str(tmp_path / "metrics.jsonl")) if r["split"] == "train"]
    assert [s for s, _ in scalars["train/loss"]] == [r["step"] for r in train] == [1, 2, 3, 4]
    for (_, v), r in zip(scalars["train/loss"], train):
        assert v == np.float32(r["loss"]).item()  # float32 simple_value of the same number
