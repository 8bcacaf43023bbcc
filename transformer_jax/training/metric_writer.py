"""Where training metrics go: a progress bar, ``metrics.jsonl`` and TensorBoard event files.

TensorBoard files come from tensorboardX, which does not need TensorFlow. Only process 0 writes.

A resumed run redoes the steps after its checkpoint, so the writer first drops what the interrupted run
logged past ``initial_step``: rows of ``metrics.jsonl`` with a larger step (and a line cut short by a
kill), and, through tensorboardX's ``purge_step``, TensorBoard events from ``initial_step + 1`` on.
"""

from __future__ import annotations

import json
import logging
import os
import time

import tqdm
from tensorboardX import SummaryWriter


class MetricWriter:
    """Writes one JSON line per call to ``<workdir>/metrics.jsonl``, TensorBoard scalars, and a bar.

    The bar shows step, loss, learning rate, tokens/s and the ETA.
    """

    def __init__(self, workdir: str, *, enabled: bool, total_steps: int, initial_step: int = 0):
        self.enabled = enabled
        self.last_step = initial_step
        if not enabled:
            return
        path = os.path.join(workdir, "metrics.jsonl")
        purge_rows_after(path, initial_step)
        self._jsonl = open(path, "a")  # noqa: SIM115
        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=initial_step + 1)
        self._bar = tqdm.tqdm(total=total_steps, initial=initial_step, unit="step",
                              dynamic_ncols=True, mininterval=1.0)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **metrics}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in metrics.items():
            self._tb.add_scalar(key, value, step)
        self._bar.update(step - self.last_step)
        self.last_step = step
        shown = {k.removeprefix("train_"): v for k, v in metrics.items()
                 if k in ("train_loss", "train_learning_rate", "train_tokens_per_sec", "train_mfu",
                          "dev_nll", "dev_bleu")}
        if shown:
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=True)
        if any(k.startswith("dev_") for k in metrics):
            self._bar.write(f"step {step}: " + ", ".join(
                f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith("dev_")))

    def close(self) -> None:
        if self.enabled:
            self._bar.close()
            self._tb.close()
            self._jsonl.close()


def purge_rows_after(path: str, step: int) -> int:
    """Drops the rows of a metrics.jsonl with a step above ``step`` (and unreadable lines); returns how many.

    The file is rewritten atomically (a new file renamed over it), so a kill leaves the old or the new one.
    """
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = f.read().splitlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line)
    dropped = len(lines) - len(kept)
    if dropped:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(line + "\n" for line in kept)
        os.replace(tmp, path)
        logging.info("Dropped %d rows past step %d from %s (a resumed run redoes them)", dropped, step, path)
    return dropped
