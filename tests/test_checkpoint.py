"""Tests for transformer_jax.checkpoints (manager and reader): round trip, retention, schedule, damage,
averaging."""

import glob
import json
import logging
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct

from transformer_jax.checkpoints import integrity as checks
from transformer_jax.checkpoints import manager as ckpt_lib
from transformer_jax.checkpoints.averaging import average_checkpoints
from transformer_jax.checkpoints.integrity import CheckpointMismatchError, NonFiniteStateError
from transformer_jax.checkpoints.manager import DAMAGED_SUFFIX, Checkpointer
from transformer_jax.checkpoints.reader import CheckpointReader


@struct.dataclass
class TinyState:
    """Shaped like the real TrainState: step, params, optimizer state and a typed PRNG key."""

    step: jax.Array
    params: dict
    opt_state: optax.OptState
    rng: jax.Array


_TX = optax.adam(1e-3)


def make_state(value: float = 0.0, step: int = 0) -> TinyState:
    """Every parameter equals ``value``: w float32[3, 5], b bfloat16[7]."""
    params = {"w": jnp.full((3, 5), value, jnp.float32), "b": jnp.full((7,), value, jnp.bfloat16)}
    return TinyState(
        step=jnp.asarray(step), params=params, opt_state=_TX.init(params), rng=jax.random.key(step)
    )


ABSTRACT = jax.eval_shape(make_state)


def new_checkpointer(directory, **kwargs) -> Checkpointer:
    kwargs.setdefault("save_every_steps", None)
    kwargs.setdefault("save_every_minutes", None)
    return Checkpointer(str(directory), **kwargs)


def save_steps(directory, steps, **kwargs) -> None:
    """Saves a state whose parameters all equal the step number, for each step."""
    with new_checkpointer(directory, **kwargs) as ckpt:
        for step in steps:
            state = make_state(float(step), step)
            assert ckpt.save(step, state, data_state={"pos": step}, config={"d_model": 5}, force=True)


def assert_trees_equal(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32))


# ------------------------------------------------------------------------------------------- round trip
def test_round_trip_state_data_and_config(tmp_path):
    state = make_state(2.5, step=7).replace(rng=jax.random.key(42))
    state = state.replace(opt_state=_TX.update(state.params, state.opt_state, state.params)[1])
    config = {"d_model": 5, "dropout_rate": 0.1, "name": "tiny", "axes": [1, 2]}
    ckpt = new_checkpointer(tmp_path)
    assert ckpt.all_steps() == [] and ckpt.reader.latest_step() is None
    assert ckpt.save(7, state, data_state={"epoch": 1, "pos": 13}, config=config, force=True)
    ckpt.close()

    # A new Checkpointer, as after a restart.
    ckpt = new_checkpointer(tmp_path)
    assert ckpt.all_steps() == [7] and ckpt.reader.latest_step() == 7
    restored, data_state, restored_config, step = ckpt.restore(ABSTRACT)
    ckpt.close()
    assert step == 7 and data_state == {"epoch": 1, "pos": 13} and restored_config == config
    assert isinstance(restored, TinyState)
    assert_trees_equal(restored.params, state.params)
    assert_trees_equal(restored.opt_state, state.opt_state)
    assert int(restored.step) == 7
    # The typed PRNG key comes back as a typed key with the same bits (orbax stores it natively).
    assert jnp.issubdtype(restored.rng.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(restored.rng), jax.random.key_data(state.rng))
    assert restored.params["w"].sharding == jax.sharding.make_single_device_sharding(jax.devices()[0])


def test_restore_with_explicit_sharding(tmp_path):
    save_steps(tmp_path, [1])
    sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)), jax.sharding.PartitionSpec()
    )
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), ABSTRACT)
    with new_checkpointer(tmp_path) as ckpt:
        restored, *_ = ckpt.restore(abstract)
    assert restored.params["w"].sharding == sharding


def _snapshot(directory) -> dict[str, tuple[int, int]]:
    """{path: (size, mtime_ns)} of every file and folder under ``directory``."""
    entries = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            entries[path] = (os.path.getsize(path), os.stat(path).st_mtime_ns)
    return entries


def test_the_reader_reads_and_falls_back_without_writing(tmp_path, caplog):
    save_steps(tmp_path, [1, 2, 3])
    _damage(str(tmp_path / "3"), "garbage_array_files")
    before = _snapshot(tmp_path)
    reader = CheckpointReader(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert reader.all_steps() == [1, 2, 3] and reader.latest_step() == 3
        assert reader.saved_info(step=1)[:2] == (1, {"d_model": 5})
        _, data_state, _, step = reader.restore(ABSTRACT)
        assert step == 2 and data_state == {"pos": 2}
        params, step = reader.restore_params(ABSTRACT.params)
        assert step == 2 and float(params["w"][0, 0]) == 2.0
        assert reader.all_steps() == [1, 2, 3]  # the damaged step stays where it is
    assert any("step 3" in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records)
    assert _snapshot(tmp_path) == before  # nothing created, changed, renamed or deleted
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CheckpointReader(tmp_path / "missing")


def test_max_to_keep(tmp_path):
    save_steps(tmp_path, [1, 2, 3, 4, 5], max_to_keep=2)
    with new_checkpointer(tmp_path, max_to_keep=2) as ckpt:
        assert ckpt.all_steps() == [4, 5]
    assert sorted(os.listdir(tmp_path)) == ["4", "5"]


def _save(ckpt, step, *, preemption=False) -> None:
    assert ckpt.save(step, make_state(float(step), step), data_state={"pos": step}, config={}, force=True,
                     preemption=preemption)
    ckpt.wait()


def test_preemption_saves_are_kept_out_of_max_to_keep_and_of_averaging(tmp_path):
    """A save forced by SIGTERM off the schedule is kept while it is the newest (a resume needs it), never
    counts among the ``max_to_keep`` scheduled ones, and is never averaged unless it is the step asked for."""
    with new_checkpointer(tmp_path, max_to_keep=2) as ckpt:
        for step in (2, 4):
            _save(ckpt, step)
        _save(ckpt, 5, preemption=True)
        assert ckpt.all_steps() == [2, 4, 5]  # 5 kept for the resume, 2 still one of the last two
    with new_checkpointer(tmp_path, max_to_keep=2) as ckpt:  # a new process: 5 is known from its files
        assert ckpt.averageable_steps(5) == [2, 4, 5] and ckpt.averageable_steps(4) == [2, 4]
        _save(ckpt, 6)
        assert ckpt.all_steps() == [4, 6]  # 5 is no longer needed; 4 and 6 are the last two scheduled
    # A directory that still holds a preemption save below newer steps (a deletion that failed, or a copy):
    # averaging skips it.
    with new_checkpointer(tmp_path / "b", max_to_keep=None) as ckpt:
        _save(ckpt, 5, preemption=True)
    shutil.copytree(tmp_path / "b" / "5", tmp_path / "5")
    assert CheckpointReader(str(tmp_path)).averageable_steps(6) == [4, 6]


def test_save_of_existing_step_is_skipped(tmp_path):
    save_steps(tmp_path, [3])
    with new_checkpointer(tmp_path) as ckpt:
        assert not ckpt.save(3, make_state(9.0), data_state={}, config={}, force=True)
        restored, *_ = ckpt.restore(ABSTRACT)
    assert float(restored.params["w"][0, 0]) == 3.0


# -------------------------------------------------------------------------------------------- schedule
def test_should_save_by_steps(tmp_path):
    ckpt = new_checkpointer(tmp_path, save_every_steps=10)
    assert [s for s in range(0, 35) if ckpt.should_save(s)] == [10, 20, 30]
    assert ckpt.save(20, make_state(), data_state={}, config={})  # due, so saved without force
    assert not ckpt.save(21, make_state(), data_state={}, config={})  # not due
    assert not ckpt.should_save(20) and not ckpt.should_save(10)  # at or below the last saved step
    ckpt.close()
    with new_checkpointer(tmp_path, save_every_steps=10) as resumed:
        assert not resumed.should_save(20) and resumed.should_save(30)


def test_should_save_by_minutes(tmp_path, monkeypatch):
    clock = {"now": 1000.0}
    monkeypatch.setattr(ckpt_lib, "_now", lambda: clock["now"])
    ckpt = new_checkpointer(tmp_path, save_every_minutes=10)
    clock["now"] += 599.0
    assert not ckpt.should_save(1)
    clock["now"] += 1.0
    assert ckpt.should_save(1)
    assert ckpt.save(1, make_state(), data_state={}, config={})
    clock["now"] += 300.0  # the interval restarts at the save
    assert not ckpt.should_save(2)
    clock["now"] += 300.0
    assert ckpt.should_save(2)
    ckpt.close()

    both = new_checkpointer(tmp_path / "both", save_every_steps=4, save_every_minutes=10)
    assert both.should_save(4) and not both.should_save(5)
    clock["now"] += 600.0
    assert both.should_save(5)
    both.close()


def test_time_schedule_with_several_processes_follows_process_0(tmp_path, monkeypatch):
    clock = {"now": 0.0}
    monkeypatch.setattr(ckpt_lib, "_now", lambda: clock["now"])
    ckpt = new_checkpointer(tmp_path, save_every_minutes=10, time_check_every=4)
    # Pretend to be process 1 of 2, whose clock says "not yet" while process 0's says "due".
    broadcasts = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(
        ckpt_lib.multihost_utils, "broadcast_one_to_all", lambda x: broadcasts.append(x) or True
    )
    assert not ckpt.should_save(5) and broadcasts == []  # not a check step: no collective
    assert ckpt.should_save(8) and len(broadcasts) == 1 and not bool(broadcasts[0])
    monkeypatch.undo()
    ckpt.close()


def test_schedule_arguments_are_validated(tmp_path):
    with pytest.raises(ValueError, match=r"save_every_steps.*\b0\b"):
        new_checkpointer(tmp_path, save_every_steps=0)
    with pytest.raises(ValueError, match=r"save_every_minutes.*-1"):
        new_checkpointer(tmp_path, save_every_minutes=-1)
    with pytest.raises(ValueError, match=r"time_check_every.*\b0\b"):
        new_checkpointer(tmp_path, save_every_minutes=1, time_check_every=0)


# -------------------------------------------------------------------------------------- damaged steps
def _damage(step_dir: str, how: str) -> None:
    if how == "garbage_array_files":
        files = [f for f in glob.glob(f"{step_dir}/state/**/d/*", recursive=True) if os.path.isfile(f)]
        assert files, f"no array data files found under {step_dir}/state"
        for f in files:
            with open(f, "r+b") as fh:
                fh.write(b"\x01" * os.path.getsize(f))  # same length, wrong bytes
    elif how == "missing_metadata":
        os.remove(f"{step_dir}/state/_METADATA")
    elif how == "truncated_json":
        path = f"{step_dir}/data/metadata"
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        raise ValueError(how)




@pytest.mark.parametrize("how", ["garbage_array_files", "missing_metadata", "truncated_json"])
def test_damaged_latest_falls_back_to_previous(tmp_path, caplog, how):
    save_steps(tmp_path, [1, 2, 3])
    _damage(str(tmp_path / "3"), how)
    ckpt = new_checkpointer(tmp_path)
    with caplog.at_level(logging.WARNING, logger=ckpt_lib.__name__):
        restored, data_state, _, step = ckpt.restore(ABSTRACT)
    assert step == 2 and data_state == {"pos": 2}
    assert float(restored.params["w"][0, 0]) == 2.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 3" in m and str(tmp_path) in m and "damaged" in m for m in warnings), warnings
    # The damaged step is moved aside, so the resumed run can write step 3 again.
    assert ckpt.all_steps() == [1, 2]
    assert glob.glob(f"{tmp_path}/3{DAMAGED_SUFFIX}-*")
    assert ckpt.save(3, make_state(30.0, 3), data_state={"pos": 3}, config={}, force=True)
    ckpt.close()
    with new_checkpointer(tmp_path) as again:
        restored, _, _, step = again.restore(ABSTRACT)
    assert step == 3 and float(restored.params["w"][0, 0]) == 30.0


def test_a_damaged_step_moved_aside_does_not_hold_back_the_saves_after_the_resumed_one(tmp_path, monkeypatch):
    """Resumed from step 2 past a damaged step 3: step 3 is due again at once (every 3 steps), and a timed
    save at step 2 + 1 (it never waits for the run to pass step 3)."""
    save_steps(tmp_path / "a", [1, 2, 3])
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    _damage(str(tmp_path / "a" / "3"), "missing_metadata")
    with new_checkpointer(tmp_path / "a", save_every_steps=3) as ckpt:
        assert ckpt.restore(ABSTRACT)[3] == 2
        assert ckpt.should_save(3)
    _damage(str(tmp_path / "b" / "3"), "truncated_json")
    clock = [100.0]
    monkeypatch.setattr(ckpt_lib, "_now", lambda: clock[0])
    with new_checkpointer(tmp_path / "b", save_every_minutes=1.0) as ckpt:
        assert ckpt.restore(ABSTRACT)[3] == 2
        clock[0] += 61.0
        assert ckpt.should_save(3) and not ckpt.should_save(2)


def test_explicitly_requested_damaged_step_raises(tmp_path):
    save_steps(tmp_path, [1, 2])
    _damage(str(tmp_path / "2"), "missing_metadata")
    reader = CheckpointReader(tmp_path)
    with pytest.raises(RuntimeError, match=rf"step 2 in {re.escape(str(tmp_path))}"):
        reader.restore(ABSTRACT, step=2)
    with pytest.raises(FileNotFoundError, match=rf"step 9 in {re.escape(str(tmp_path))}.*\[1, 2\]"):
        reader.restore(ABSTRACT, step=9)
    assert reader.all_steps() == [1, 2]  # no silent fallback, nothing moved


def test_no_restorable_step_raises_and_moves_nothing(tmp_path):
    save_steps(tmp_path, [1, 2])
    for step in (1, 2):
        _damage(str(tmp_path / str(step)), "missing_metadata")
    with new_checkpointer(tmp_path) as ckpt:
        with pytest.raises(RuntimeError, match=rf"{re.escape(str(tmp_path))}.*\[2, 1\]"):
            ckpt.restore(ABSTRACT)
        assert ckpt.all_steps() == [1, 2]
    with new_checkpointer(tmp_path / "empty") as empty:
        with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "empty"))):
            empty.restore(ABSTRACT)


def test_wrong_target_is_not_mistaken_for_damage(tmp_path, caplog):
    save_steps(tmp_path, [1, 2])
    wrong = jax.eval_shape(lambda: make_state().replace(params={"w": jnp.zeros((4, 4))}))
    expected = r"params/w: saved \[3, 5\], expected \[4, 4\]"
    with new_checkpointer(tmp_path) as ckpt, caplog.at_level(logging.WARNING, logger=ckpt_lib.__name__):
        # Raised before any array is read, naming the arrays (saved vs expected), for any requested step.
        with pytest.raises(CheckpointMismatchError, match=expected):
            ckpt.restore(wrong)
        with pytest.raises(CheckpointMismatchError, match=expected):
            ckpt.reader.restore(wrong, step=1)
        assert ckpt.all_steps() == [1, 2]
    assert not [r for r in caplog.records if "damaged" in r.getMessage()]


def test_interrupted_save_tmp_dirs_are_removed_on_start(tmp_path, caplog):
    save_steps(tmp_path, [1])
    # The names orbax gives an unfinished save: "<step>.orbax-checkpoint-tmp" (orbax/_src/path/atomicity.py,
    # _get_tmp_directory), and "<step>.orbax-checkpoint-tmp-<timestamp>" in older releases.
    assert ckpt_lib.TMP_DIR_SUFFIX == ".orbax-checkpoint-tmp"
    leftovers = ["2.orbax-checkpoint-tmp", "3.orbax-checkpoint-tmp-1712345678"]
    for name in leftovers:
        os.makedirs(tmp_path / name / "state")
        (tmp_path / name / "state" / "_METADATA").write_text("{")
    assert CheckpointReader(tmp_path).all_steps() == [1]  # a reader neither counts nor deletes them
    assert all(os.path.isdir(tmp_path / name) for name in leftovers)

    with caplog.at_level(logging.WARNING, logger=ckpt_lib.__name__):
        ckpt = new_checkpointer(tmp_path)
    assert ckpt.all_steps() == [1] and ckpt.reader.latest_step() == 1
    assert sorted(os.listdir(tmp_path)) == ["1"]
    assert any("unfinished" in r.getMessage() and leftovers[0] in r.getMessage() for r in caplog.records)
    assert ckpt.save(2, make_state(2.0, 2), data_state={}, config={}, force=True)
    ckpt.close()
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]


# ------------------------------------------------------------------------------------------- averaging
def test_average_checkpoints_known_values(tmp_path):
    save_steps(tmp_path, [1, 2, 3, 4, 5], max_to_keep=10)
    averaged = average_checkpoints(str(tmp_path), ABSTRACT, [1, 2, 3, 4, 5])
    assert averaged["w"].dtype == jnp.float32 and averaged["b"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(averaged["w"]), 3.0, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(averaged["b"], np.float32), 3.0, rtol=0, atol=1e-2)
    # Parameters only (not the whole state) as the target.
    averaged = average_checkpoints(str(tmp_path), ABSTRACT.params, [3, 4, 5])
    np.testing.assert_allclose(np.asarray(averaged["w"]), 4.0, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(averaged["b"], np.float32), 4.0, rtol=0, atol=1e-2)
    averaged = average_checkpoints(str(tmp_path), ABSTRACT, [5, 4])
    np.testing.assert_allclose(np.asarray(averaged["w"]), 4.5, rtol=0, atol=1e-6)
    averaged = average_checkpoints(str(tmp_path), ABSTRACT, [1, 5])
    np.testing.assert_allclose(np.asarray(averaged["w"]), 3.0, rtol=0, atol=1e-6)


def test_average_checkpoints_names_the_steps_it_lacks(tmp_path):
    save_steps(tmp_path, [1, 2, 3])
    with pytest.raises(ValueError, match=r"steps \[4, 5\] are not in .* \(it has \[1, 2, 3\]\)"):
        average_checkpoints(str(tmp_path), ABSTRACT, [2, 3, 4, 5])


# ------------------------------------------------------------------------------- integrity (issue 12)
def big_state(step: int) -> TinyState:
    """Random w float32[61, 67] (one data file of ~16 kB), so a flip lands inside array bytes."""
    params = {"w": jax.random.normal(jax.random.key(step), (61, 67)),
              "b": jnp.full((7,), step, jnp.bfloat16)}
    return TinyState(step=jnp.asarray(step), params=params, opt_state=_TX.init(params),
                     rng=jax.random.key(step))


BIG_ABSTRACT = jax.eval_shape(lambda: big_state(0))


def flip_64_bytes_in_the_middle(step_dir) -> str:
    """Inverts 64 bytes in the middle of the step's largest array data file (same size); returns its path."""
    files = [f for f in glob.glob(f"{step_dir}/state/**/d/*", recursive=True) if os.path.isfile(f)]
    path = max(files, key=os.path.getsize)
    size = os.path.getsize(path)
    assert size > 1000, size
    with open(path, "r+b") as f:
        f.seek(size // 2 - 32)
        chunk = f.read(64)
        f.seek(size // 2 - 32)
        f.write(bytes(b ^ 0xFF for b in chunk))
    assert os.path.getsize(path) == size
    return path


def test_bit_flip_is_detected_and_falls_back_like_other_damage(tmp_path, caplog):
    with new_checkpointer(tmp_path) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, big_state(step), data_state={"pos": step}, config={}, force=True)
    flip_64_bytes_in_the_middle(tmp_path / "3")
    reader = CheckpointReader(tmp_path)  # evaluate.py's path: an explicit step fails
    with pytest.raises(RuntimeError, match=r"step 3.*checksum mismatch.*params/w"):
        reader.restore(BIG_ABSTRACT, step=3)
    with pytest.raises(RuntimeError, match=r"step 3 in .*checksum mismatch"):
        average_checkpoints(str(tmp_path), BIG_ABSTRACT, [2, 3])
    ckpt = new_checkpointer(tmp_path)
    with caplog.at_level(logging.WARNING, logger=ckpt_lib.__name__):
        restored, data_state, _, step = ckpt.restore(BIG_ABSTRACT)
    ckpt.close()
    assert step == 2 and data_state == {"pos": 2}
    assert_trees_equal(restored.params, big_state(2).params)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 3" in m and "damaged" in m and "checksum" in m for m in warnings), warnings
    assert glob.glob(f"{tmp_path}/3{DAMAGED_SUFFIX}-*")


def test_digest_sees_every_single_element_change_and_counts_non_finite():
    state = big_state(4)
    base = checks.state_digest(state)
    assert set(base) == {"step", "params/b", "params/w", "opt_state/0/count", "opt_state/0/mu/b",
                         "opt_state/0/mu/w", "opt_state/0/nu/b", "opt_state/0/nu/w", "rng"}
    assert base["params/w"]["shape"] == [61, 67] and not checks.nonfinite_arrays(base)
    w = np.asarray(state.params["w"])
    for index in [(0, 0), (30, 33), (60, 66)]:
        changed = w.copy()
        changed[index] = np.nextafter(changed[index], np.float32(np.inf))  # the smallest possible change
        digest = checks.state_digest(state.replace(params={**state.params, "w": jnp.asarray(changed)}))
        assert digest["params/w"]["h"] != base["params/w"]["h"], index
        assert digest["params/b"]["h"] == base["params/b"]["h"]
    swapped = w.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # same values, other order
    digest = checks.state_digest(state.replace(params={**state.params, "w": jnp.asarray(swapped)}))
    assert digest["params/w"]["h"] != base["params/w"]["h"]
    poisoned = state.replace(opt_state=jax.tree.map(lambda x: x.at[..., 0].set(jnp.inf) if x.ndim else x,
                                                    state.opt_state))
    assert checks.nonfinite_arrays(checks.state_digest(poisoned)) == [
        "opt_state/0/mu/b", "opt_state/0/mu/w", "opt_state/0/nu/b", "opt_state/0/nu/w"]


def test_a_non_finite_state_is_never_saved_and_the_message_names_a_step_that_exists(tmp_path):
    ckpt = new_checkpointer(tmp_path)
    assert "no checkpoint" in ckpt.last_good_message()
    poisoned = make_state(1.0, 2)
    poisoned = poisoned.replace(params={**poisoned.params, "w": jnp.full((3, 5), jnp.nan)})
    with pytest.raises(NonFiniteStateError, match=r"after step 2 .*params/w.*There is no checkpoint"):
        ckpt.save(2, poisoned, data_state={}, config={}, force=True)
    assert ckpt.save(3, make_state(3.0, 3), data_state={}, config={}, force=True)  # async: maybe in flight
    with pytest.raises(NonFiniteStateError, match=r"after step 4 .*The last good checkpoint is step 3 in"):
        ckpt.save(4, poisoned, data_state={}, config={}, force=True)
    ckpt.close()
    assert sorted(os.listdir(tmp_path)) == ["3"]


def test_leaving_on_an_exception_finishes_the_save_in_flight(tmp_path):
    with pytest.raises(KeyError):
        with new_checkpointer(tmp_path) as ckpt:
            assert ckpt.save(5, big_state(5), data_state={}, config={}, force=True)
            raise KeyError("a crash while the save is in flight")
    assert sorted(os.listdir(tmp_path)) == ["5"]
    with new_checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(BIG_ABSTRACT)[3] == 5


def test_a_step_removed_while_read_is_skipped_without_calling_it_damaged(tmp_path, caplog, monkeypatch):
    save_steps(tmp_path, [1, 2, 3])
    reader = CheckpointReader(tmp_path)
    original = CheckpointReader.read_state

    def trainer_deletes_step_3_meanwhile(self, step, abstract_state):
        if step == 3:
            shutil.rmtree(tmp_path / "3")  # what a trainer's max_to_keep does
        return original(self, step, abstract_state)

    monkeypatch.setattr(CheckpointReader, "read_state", trainer_deletes_step_3_meanwhile)
    with caplog.at_level(logging.WARNING, logger=ckpt_lib.__name__):
        _, data_state, _, step = reader.restore(ABSTRACT)
    assert step == 2 and data_state == {"pos": 2}
    messages = [r.getMessage() for r in caplog.records]
    assert any("step 3" in m and "removed" in m for m in messages), messages
    assert not any("damaged" in m for m in messages), messages


def test_metadata_is_saved_and_read_without_arrays(tmp_path):
    with new_checkpointer(tmp_path) as ckpt:
        ckpt.save(4, make_state(), data_state={}, config={"d_model": 5}, force=True,
                  metadata={"tokenizer_sha256": "ab" * 32})
    assert CheckpointReader(tmp_path).saved_info() == (4, {"d_model": 5}, {"tokenizer_sha256": "ab" * 32})


def test_a_config_saved_before_model_fields_existed_compares_them_as_their_defaults():
    """Every model field is read as its default where a saved config lacks it (as the restore reads it), so
    an old workdir resumes once a field is added; a new config that sets one otherwise is refused."""
    from configs import default as default_config
    from transformer_jax import run_config
    from transformer_jax.model.config import ModelConfig

    config = default_config.get_config()
    new = json.loads(json.dumps(dict(run_config.build_run_config(config, environment=False).saved)))
    old = json.loads(json.dumps(new))
    defaults = ModelConfig.settable_defaults()
    added = [name for name in ("norm_style", "position_encoding", "max_relative_position", "ffn_activation")
             if new["model"][name] == defaults[name]]
    assert len(added) == 4  # fields of the default config at their defaults: as if added after the save
    for name in added:
        del old["model"][name]
    assert checks.model_differences(old, new) == [] and checks.run_time_differences(old, new) == []
    assert run_config.run_config_from_saved(old).model == run_config.run_config_from_saved(new).model
    new["model"]["norm_style"] = "pre"
    assert checks.model_differences(old, new) == ["model.norm_style: saved 'post', new 'pre'"]
    new["model"]["norm_style"], new["model"]["ffn_activation"] = "post", "gelu"
    assert checks.model_differences(old, new) == ["model.ffn_activation: saved 'relu', new 'gelu'"]


def test_a_resume_refuses_another_position_scheme_and_another_relative_clip_distance():
    """The scheme decides what the parameters mean (rotary -> ALiBi keeps every shape); the clip distance
    k the relative tables' 2k+1 rows, so it is compared only where a side uses relative positions."""
    from configs import default as default_config
    from transformer_jax import run_config

    def saved(**model) -> dict:
        config = default_config.get_config()
        config.model.update(model)
        return json.loads(json.dumps(dict(run_config.build_run_config(config, environment=False).saved)))

    assert not {"model.position_encoding", "model.max_relative_position"} & set(checks.RUN_TIME_FIELDS)
    assert checks.model_differences(saved(position_encoding="rotary"), saved(position_encoding="alibi")) == [
        "model.position_encoding: saved 'rotary', new 'alibi'"]
    relative, shorter = (saved(position_encoding="relative", max_relative_position=k) for k in (16, 8))
    assert checks.model_differences(relative, shorter) == ["model.max_relative_position: saved 16, new 8"]
    # Under a scheme without relative tables k means nothing, and a config saved before it existed resumes.
    sinusoid = saved()
    assert checks.model_differences(sinusoid, saved(max_relative_position=8)) == []
    del sinusoid["model"]["max_relative_position"]
    assert checks.model_differences(sinusoid, saved()) == []
    assert checks.model_differences(sinusoid, saved(position_encoding="relative")) == [
        "model.position_encoding: saved 'sinusoidal', new 'relative'"]  # k is read as its default, 16
