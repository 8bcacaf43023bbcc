"""Where training metrics go: a progress bar, ``metrics.jsonl`` and TensorBoard event files.

TensorBoard files come from tensorboardX, which does not need TensorFlow. Only process 0 writes.
"""

from __future__ import annotations

import json
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
        self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")  # noqa: SIM115
        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
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
