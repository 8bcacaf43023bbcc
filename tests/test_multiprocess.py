"""A real two-process data-parallel run over loopback (jax.distributed + gloo), not a mock."""

import os
import socket
import subprocess
import sys
import textwrap

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs 3 data-parallel train steps; process_id -1 means "single process, whole batch" (the reference).
WORKER = textwrap.dedent("""
    import sys
    import jax
    port, process_id, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if process_id >= 0:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                   process_id=process_id, initialization_timeout=60)
    import numpy as np, optax
    jax.config.update("jax_default_matmul_precision", "highest")
    from transformer_jax.runtime import sharding
    from transformer_jax.training import steps, train_state
    from transformer_jax.model.config import ModelConfig
    cfg = ModelConfig(vocab_size=31, d_model=16, d_ff=24, num_heads=2, num_encoder_layers=1,
                                num_decoder_layers=1, dropout_rate=0.1, max_len=16)
    rules = (("batch", "data"),)
    tx = optax.adam(1e-2)
    mesh = sharding.make_mesh((-1, 1))
    state, state_sharding = train_state.create_train_state(cfg, tx, mesh, rules, seed=0)
    step = steps.make_train_step(cfg, tx, mesh, rules, state_sharding, label_smoothing=0.1)
    rng = np.random.default_rng(0)
    for i in range(3):
        batch = {"inputs": rng.integers(1, 31, size=(6, 7)).astype(np.int32),
                 "targets": rng.integers(1, 31, size=(6, 5)).astype(np.int32)}
        if process_id >= 0:  # each process feeds only its own rows
            batch = {k: v[3 * process_id: 3 * process_id + 3] for k, v in batch.items()}
        state, sums = step(state, sharding.global_batch(batch, mesh))
    leaves = [np.asarray(x.addressable_data(0)) for x in jax.tree.leaves(state.params)]
    np.savez(out, *leaves, loss=np.asarray(sums["loss"].addressable_data(0)))
    print("devices", jax.device_count(), "processes", jax.process_count())
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_data_parallel_like_one(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(port), str(i), str(tmp_path / f"p{i}.npz")],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert "devices 2 processes 2" in out
    single = subprocess.run([sys.executable, "-c", WORKER, "0", "-1", str(tmp_path / "single.npz")],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    p0, p1, ref = (np.load(tmp_path / f"{n}.npz") for n in ("p0", "p1", "single"))
    assert len(p0.files) > 10
    for name in p0.files:
        np.testing.assert_array_equal(p0[name], p1[name], err_msg=name)  # identical on both hosts
        np.testing.assert_allclose(p0[name], ref[name], atol=1e-6, rtol=1e-6, err_msg=name)
