"""A full disk while saving: one error line naming the filesystem, the step and the last good checkpoint.

Two ways to fill the disk: an ``OSError(ENOSPC)`` injected into orbax's own write of one item (in the
background thread of an asynchronous save, or inside a synchronous one), and a real tmpfs too small for the
second checkpoint of a tiny train.py run (needs root to mount; skipped otherwise). The rerun with space
must resume from the checkpoint the error named and end bitwise where an undisturbed run (the shared
``trained_run``) ends.
"""

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from test_checkpoint import ABSTRACT, assert_trees_equal, make_state, new_checkpointer
from tiny import TEST_PEAK, TRAIN, config_with, saved_state

from transformer_jax.checkpoints.reader import INTEGRITY_ITEM
from transformer_jax.runtime import disk, errors
from transformer_jax.runtime.errors import DiskFullError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TENSORSTORE_FULL = ("RESOURCE_EXHAUSTED: Error writing \"params.w/0\" in OCDBT database at local file "
                    "\"/x/2.orbax-checkpoint-tmp/state/\": Failed to write 100643 bytes to file 19: No space "
                    "left on device [os_error_code='28']")


@pytest.fixture
def full_disk(monkeypatch):
    """``full_disk.on = True`` makes orbax's write of the ``integrity`` item raise OSError(ENOSPC)."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as json_handler

    original = json_handler.JsonCheckpointHandler._save_fn

    class Switch:
        on = False

    async def save_fn(self, x, directory):
        if Switch.on and directory.name.startswith(INTEGRITY_ITEM):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "metadata"))
        return await original(self, x, directory)

    monkeypatch.setattr(json_handler.JsonCheckpointHandler, "_save_fn", save_fn)
    return Switch


def _save(ckpt, step):
    return ckpt.save(step, make_state(float(step), step), data_state={"pos": step}, config={"d": 5},
                     force=True)


def _only_step_1_is_left_and_restores_bitwise(directory):
    assert sorted(os.listdir(directory)) == ["1"]  # no <step>.orbax-checkpoint-tmp left behind
    with new_checkpointer(directory) as ckpt:
        state, data_state, _, step = ckpt.restore(ABSTRACT)
    expected = make_state(1.0, 1)
    assert step == 1 and data_state == {"pos": 1} and int(state.step) == 1
    assert_trees_equal(state.params, expected.params)  # bitwise
    assert_trees_equal(state.opt_state, expected.opt_state)
    np.testing.assert_array_equal(jax.random.key_data(state.rng), jax.random.key_data(expected.rng))


def _assert_names_step_2(error: DiskFullError, directory) -> None:
    message = str(error)
    assert "the disk is full" in message and "checkpoint step 2 could not be saved" in message
    assert f"The last good checkpoint is step 1 in {directory}" in message
    assert "filesystem mounted at" in message and "\n" not in message


def test_a_background_save_that_fills_the_disk_is_reported_at_the_next_save(tmp_path, full_disk):
    directory = tmp_path / "ckpt"
    with pytest.raises(DiskFullError) as info, new_checkpointer(directory) as ckpt:
        assert _save(ckpt, 1)
        ckpt.wait()  # step 1 is written before the disk fills
        full_disk.on = True
        assert _save(ckpt, 2)  # started; it fails in the background thread
        # The disk stays full (switching it back here would race the background write): orbax reports
        # step 2's failure when step 3's save first waits for it, so the error names step 2, not 3.
        _save(ckpt, 3)
    _assert_names_step_2(info.value, directory)
    assert isinstance(info.value, OSError) and isinstance(info.value.__cause__, OSError)
    _only_step_1_is_left_and_restores_bitwise(directory)


def test_a_background_save_that_fills_the_disk_is_reported_at_wait_and_close_is_quiet(tmp_path, full_disk):
    directory = tmp_path / "ckpt"
    ckpt = new_checkpointer(directory)
    assert _save(ckpt, 1)
    ckpt.wait()
    full_disk.on = True
    assert _save(ckpt, 2)
    with pytest.raises(DiskFullError) as info:
        ckpt.wait()
    _assert_names_step_2(info.value, directory)
    ckpt.close()  # orbax would raise the same failure again; it was reported once
    _only_step_1_is_left_and_restores_bitwise(directory)


def test_a_synchronous_save_that_fills_the_disk(tmp_path, full_disk):
    directory = tmp_path / "ckpt"
    with pytest.raises(DiskFullError) as info, new_checkpointer(directory, async_save=False) as ckpt:
        assert _save(ckpt, 1)
        ckpt.wait()  # step 1 is written before the disk fills
        full_disk.on = True
        _save(ckpt, 2)
    _assert_names_step_2(info.value, directory)
    _only_step_1_is_left_and_restores_bitwise(directory)


def test_other_save_failures_are_not_called_a_full_disk(tmp_path, monkeypatch):
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as json_handler

    async def denied(self, x, directory):
        raise PermissionError(errno.EACCES, "Permission denied", str(directory))

    with new_checkpointer(tmp_path / "ckpt") as ckpt:
        assert _save(ckpt, 1)
        monkeypatch.setattr(json_handler.JsonCheckpointHandler, "_save_fn", denied)
        with pytest.raises(PermissionError):  # the original error, whatever the layer it surfaces in
            _save(ckpt, 2)
            ckpt.wait()


def test_is_disk_full_reads_every_shape_of_the_error():
    assert disk.is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert disk.is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert disk.is_disk_full(ValueError(TENSORSTORE_FULL))  # tensorstore, through orbax
    try:
        try:
            raise ValueError(TENSORSTORE_FULL)
        except ValueError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        assert disk.is_disk_full(outer)  # chained
    assert not disk.is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not disk.is_disk_full(ValueError("RESOURCE_EXHAUSTED: out of device memory"))
    assert not disk.is_disk_full(None)


def test_low_free_space_is_warned_about_once_after_the_first_save(tmp_path, monkeypatch, caplog):
    sizes = []
    monkeypatch.setattr(disk, "free_bytes", lambda path: 2 * sizes[-1])  # room for two more
    original = disk.directory_bytes
    monkeypatch.setattr(disk, "directory_bytes", lambda path: sizes.append(original(path)) or sizes[-1])
    with caplog.at_level(logging.WARNING), new_checkpointer(tmp_path / "ckpt") as ckpt:
        for step in (1, 2, 3):
            assert _save(ckpt, step)
    warnings = [r.getMessage() for r in caplog.records if "Low disk space" in r.getMessage()]
    assert len(warnings) == 1 and "room for 2 more checkpoint(s)" in warnings[0] and "(step 1)" in warnings[0]
    assert len(sizes) == 1 and sizes[0] > 0  # measured once, on the real step directory


def test_enough_free_space_gives_no_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING), new_checkpointer(tmp_path / "ckpt") as ckpt:
        assert _save(ckpt, 1) and _save(ckpt, 2)
    if disk.free_bytes(str(tmp_path)) > 100 * disk.directory_bytes(str(tmp_path / "ckpt" / "1")):
        assert not [r for r in caplog.records if "Low disk space" in r.getMessage()]


def test_a_full_disk_anywhere_else_is_one_error_line(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
    path = str(tmp_path / "metrics.jsonl")

    def main(argv):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    with pytest.raises(SystemExit) as info:
        errors.short_errors(main)([])
    assert info.value.code == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"error: no space left on device writing {path}: ")
    assert "filesystem mounted at" in lines[0]


# --------------------------------------------------------------------------------------- a real small disk
STEPS = TRAIN["train.num_steps"]
# The shared run's data, model, optimizer and checkpoint steps (2, 4, 6), no evaluation.
TINY = {**TEST_PEAK, **TRAIN, "log_every_steps": 1, "eval_every_steps": 0, "eval_bleu_examples": 0,
        "checkpoint_keep": 20, "final_eval_split": ""}


def _train(workdir) -> subprocess.CompletedProcess:
    flags = [f"--config.{k}={v}" for k, v in TINY.items()]
    env = {k: v for k, v in os.environ.items() if k != errors.TRACEBACK_ENV}
    return subprocess.run([sys.executable, os.path.join(REPO, "train.py"), f"--workdir={workdir}", *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _mount(point, size_bytes: int, remount: bool = False) -> bool:
    options = f"{'remount,' if remount else ''}size={size_bytes}"
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                            capture_output=True, text=True)
    return result.returncode == 0


@pytest.mark.slow
def test_a_real_full_disk_then_a_rerun_with_space_resumes_bitwise(tmp_path, trained_run):
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root")
    reference = Path(trained_run[0])  # TINY's steps; its evaluation adds a few kB of files beside them
    checkpoint = disk.directory_bytes(str(reference / "checkpoints" / "2"))
    rest = disk.directory_bytes(str(reference)) - disk.directory_bytes(str(reference / "checkpoints"))
    point = tmp_path / "small"
    point.mkdir()
    # Room for the tokenizer, the logs and one and a half checkpoints: step 2 fits, step 4 cannot.
    if not _mount(point, (rest + checkpoint * 3 // 2 + 65535) // 4096 * 4096):
        pytest.skip("mount -t tmpfs is not allowed here")
    try:
        workdir = point / "w"
        result = _train(workdir)
        assert result.returncode == 1, result.stderr[-3000:]
        assert "Traceback" not in result.stderr and "RESOURCE_EXHAUSTED" not in result.stderr
        assert "Event loop is closed" not in result.stderr and "sys.meta_path" not in result.stderr
        lines = [line for line in result.stderr.split("\n") if line.strip() and "\r" not in line
                 and "%|" not in line and not line.startswith("W")]  # no tqdm bars, data warnings
        assert len(lines) == 2, result.stderr[-3000:]
        assert lines[0].startswith("error: the disk is full: checkpoint step 4 could not be saved, the tmpfs "
                                   f"filesystem mounted at {point} ran out of space")
        assert f"The last good checkpoint is step 2 in {workdir / 'checkpoints'}" in lines[0]
        assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]  # the partial step 4 was removed

        config = config_with(TINY)
        before, before_data = saved_state(config, workdir, 2)
        ref_2, ref_2_data = saved_state(config, reference, 2)
        assert before_data == ref_2_data
        for a, b in zip(before, ref_2, strict=True):
            np.testing.assert_array_equal(a, b)  # the checkpoint the error named is intact

        assert _mount(point, 64 << 20, remount=True)
        result = _train(workdir)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Resuming from step 2 in" in result.stdout
        final, final_data = saved_state(config, workdir, STEPS)
        ref, ref_data = saved_state(config, reference, STEPS)
        assert final_data == ref_data
        for a, b in zip(final, ref, strict=True):
            np.testing.assert_array_equal(a, b)  # bitwise: nothing was lost
        rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
        assert [r["step"] for r in rows if "train_loss" in r] == list(range(1, STEPS + 1))
    finally:
        subprocess.run(["umount", str(point)], capture_output=True)
