"""Tests for metric_writer.py: metrics.jsonl rows, TensorBoard scalars, and nothing written when disabled."""

import io
import json
import struct
import sys

import pytest
from tensorboardX.proto import event_pb2

from transformer_jax.runtime import errors
from transformer_jax.training import loop
from transformer_jax.training.metric_writer import MetricWriter


def _scalars(tensorboard_dir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} read from the event files (TFRecord framing, no TensorFlow)."""
    out = {}
    for path in sorted(tensorboard_dir.iterdir()):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])  # skip the length CRC
            pos += 12 + length + 4  # and the data CRC
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_rows_and_scalars_hold_what_was_written(tmp_path):
    writer = MetricWriter(str(tmp_path), enabled=True, total_steps=9, initial_step=2)
    writer.write(3, {"train_loss": 2.5, "train_learning_rate": 1e-3})
    writer.write(7, {"dev_nll": 1.25, "dev_bleu": 17.0})
    assert writer.last_step == 7
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 7]
    assert rows[0]["train_loss"] == 2.5 and rows[1]["dev_bleu"] == 17.0
    assert rows[0]["time"] <= rows[1]["time"]
    scalars = _scalars(tmp_path / "tensorboard")
    assert sorted(scalars) == ["dev_bleu", "dev_nll", "train_learning_rate", "train_loss"]
    assert scalars["train_loss"] == [(3, 2.5)] and scalars["dev_nll"] == [(7, 1.25)]


def test_a_second_writer_appends(tmp_path):
    for step in (1, 2):
        writer = MetricWriter(str(tmp_path), enabled=True, total_steps=2, initial_step=step - 1)
        writer.write(step, {"train_loss": float(step)})
        writer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train_loss"]) for r in rows] == [(1, 1.0), (2, 2.0)]


@pytest.mark.parametrize("metrics", [{"train_loss": 1.0}, {}])
def test_disabled_writer_writes_nothing(tmp_path, metrics):
    writer = MetricWriter(str(tmp_path), enabled=False, total_steps=5)
    writer.write(1, metrics)
    writer.close()
    assert list(tmp_path.iterdir()) == []


def test_a_resumed_writer_drops_the_rows_past_its_step(tmp_path):
    """After a resume from step 4, the rows an interrupted run logged for steps 5 and 6 are redone."""
    writer = MetricWriter(str(tmp_path), enabled=True, total_steps=6)
    for step in range(1, 7):
        writer.write(step, {"train_loss": float(step)})
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "train_lo')  # a line cut short by kill -9
    writer = MetricWriter(str(tmp_path), enabled=True, total_steps=6, initial_step=4)
    writer.write(5, {"train_loss": 50.0})
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train_loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0)]


def screen_lines(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: a carriage return goes back to the start of the line, and
    what follows overwrites what was there."""
    lines = []
    for raw in text.split("\n"):
        line, column = [], 0
        for char in raw:
            if char == "\r":
                column = 0
                continue
            line[column:column + 1] = [char]
            column += 1
        lines.append("".join(line).rstrip())
    return lines


def test_a_message_or_an_error_while_the_bar_is_drawn_gets_a_line_of_its_own(tmp_path, monkeypatch):
    terminal = io.StringIO()  # stdout and stderr share a terminal
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    writer = MetricWriter(str(tmp_path), enabled=True, total_steps=9)
    writer.write(2, {"train_loss": 2.5})
    with pytest.raises(SystemExit):
        errors.print_error("no space left")
    writer.write(3, {"train_loss": 2.25})
    loop._say(True, "Preempted: saved a checkpoint at step 3")
    writer.close()
    lines = screen_lines(terminal.getvalue())
    assert "error: no space left" in lines and "Preempted: saved a checkpoint at step 3" in lines, lines
    assert lines[-2].startswith(" 33%") and "loss=2.25" in lines[-2]  # the bar, drawn again below them
