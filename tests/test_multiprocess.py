"""A real two-process data-parallel run over loopback (jax.distributed + gloo), not a mock."""

import os
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest
from conftest import with_test_xla_flags

from transformer_jax.model.config import ModelConfig
from transformer_jax.runtime import sharding
from transformer_jax.training import steps, train_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One of the two processes: joins the job, runs ``train_three_steps`` on its rows, saves what it got.
WORKER = textwrap.dedent("""
    import sys
    import jax
    port, process_id, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id, initialization_timeout=60)
    import numpy as np
    sys.path.insert(0, "tests")
    from test_multiprocess import train_three_steps
    np.savez(out, **train_three_steps(process_id))
    print("devices", jax.device_count(), "processes", jax.process_count())
""")


def train_three_steps(process_id: int) -> dict[str, np.ndarray]:
    """3 data-parallel train steps over every device of the job, each process feeding only its 3 of the
    6 rows; ``process_id`` -1: one device of this single process, the whole batch (the reference).
    Returns the parameters (``arr_0`` .. in tree order) and ``loss``, the last step's loss sum."""
    cfg = ModelConfig(vocab_size=31, d_model=16, d_ff=24, num_heads=2, num_encoder_layers=1,
                      num_decoder_layers=1, dropout_rate=0.1, max_len=16)
    rules = (("batch", "data"),)
    tx = optax.adam(1e-2)
    mesh = sharding.make_mesh((-1, 1), jax.devices() if process_id >= 0 else jax.devices()[:1])
    state, state_sharding = train_state.create_train_state(cfg, tx, mesh, rules, seed=0)
    step = steps.make_train_step(cfg, tx, mesh, rules, state_sharding, label_smoothing=0.1)
    rng = np.random.default_rng(0)
    for _ in range(3):
        batch = {"inputs": rng.integers(1, 31, size=(6, 7)).astype(np.int32),
                 "targets": rng.integers(1, 31, size=(6, 5)).astype(np.int32)}
        if process_id >= 0:  # each process feeds only its own rows
            batch = {k: v[3 * process_id: 3 * process_id + 3] for k, v in batch.items()}
        state, sums = step(state, sharding.global_batch(batch, mesh))
    leaves = [np.asarray(x.addressable_data(0)) for x in jax.tree.leaves(state.params)]
    return {**{f"arr_{i}": leaf for i, leaf in enumerate(leaves)},
            "loss": np.asarray(sums["loss"].addressable_data(0))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_data_parallel_like_one(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=with_test_xla_flags())  # no device count
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(port), str(i), str(tmp_path / f"p{i}.npz")],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    ref = train_three_steps(-1)  # while they run
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert "devices 2 processes 2" in out
    p0, p1 = (np.load(tmp_path / f"{n}.npz") for n in ("p0", "p1"))
    assert len(p0.files) > 10 and sorted(p0.files) == sorted(ref)
    for name in p0.files:
        np.testing.assert_array_equal(p0[name], p1[name], err_msg=name)  # identical on both hosts
        np.testing.assert_allclose(p0[name], ref[name], atol=1e-6, rtol=1e-6, err_msg=name)
