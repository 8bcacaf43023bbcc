"""Device mesh, and the rules that map the model's logical axis names onto it.

Parameters and activations are annotated with the model's logical names (``axes.py``); the mapping from
names to mesh axes lives in the config (``config.sharding.logical_axis_rules``), never in the model.
The same code runs on one CPU (a 1x1 mesh, where every constraint is free), on one host with several
devices and on many hosts (after ``jax.distributed.initialize()``).
"""

import math
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from transformer_jax.model import axes

MESH_AXES = ("data", "model")


def initialize_multiprocess() -> None:
    """Joins this process to a multi-process job: ``jax.distributed.initialize()``, which finds the job
    itself under Slurm, on a TPU pod, or from the ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
    ``JAX_PROCESS_ID`` environment. CPU processes all-reduce through gloo (GPUs and TPUs ignore it)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize()


def resolve_mesh_shape(mesh_shape, num_devices: int) -> tuple[int, int]:
    """Replaces a -1 in (data, model) by what fills ``num_devices``; checks the product."""
    shape = tuple(int(s) for s in mesh_shape)
    if len(shape) != len(MESH_AXES):
        raise ValueError(f"mesh_shape must have {len(MESH_AXES)} entries {MESH_AXES}, got {shape}")
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh_shape entries must be positive, with at most one -1; got {shape}")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(
                f"mesh_shape {shape}: {num_devices} devices are not divisible by {known}")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise ValueError(f"mesh_shape {shape} needs {math.prod(shape)} devices, found {num_devices}")
    return shape


def make_mesh(mesh_shape, devices=None) -> Mesh:
    """A ('data', 'model') mesh with automatic (GSPMD) axes over all (or the given) devices."""
    devices = jax.devices() if devices is None else devices
    shape = resolve_mesh_shape(mesh_shape, len(devices))
    try:
        device_grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
        device_grid = np.asarray(devices).reshape(shape)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return Mesh(device_grid, MESH_AXES, axis_types=auto)


def rules_from_config(rules) -> tuple[tuple[str, str | None], ...]:
    """Validates logical axis rules taken from a config: pairs (logical name, mesh axis or None)."""
    known = set(axes.ALL)
    out = []
    for rule in rules:
        if len(rule) != 2:
            raise ValueError(f"a logical axis rule is a (name, mesh_axis) pair, got {rule!r}")
        name, axis = rule
        if name not in known:
            raise ValueError(f"unknown logical axis {name!r} in rules; expected one of {sorted(known)}")
        if axis is not None and axis not in MESH_AXES:
            raise ValueError(f"rule for {name!r} maps to {axis!r}; mesh axes are {MESH_AXES} or None")
        out.append((name, axis))
    return tuple(out)


def logical_to_sharding(logical_tree, mesh: Mesh, rules) -> object:
    """Maps a pytree of logical PartitionSpecs (or boxed abstract values) to NamedShardings."""
    specs = nn.get_partition_spec(logical_tree)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a [batch, length] array: batch split over 'data', replicated over 'model'."""
    return NamedSharding(mesh, PartitionSpec("data"))


def global_batch(local_batch: dict, mesh: Mesh) -> dict:
    """Assembles this process's rows into global arrays sharded over the mesh's 'data' axis."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in local_batch.items()}


def with_default_sharding(abstract_tree: Any) -> Any:
    """Gives ``ShapeDtypeStruct`` leaves without a sharding the first local device (orbax would guess one)."""
    # The factory, not the class: JAX 0.12 deprecates calling SingleDeviceSharding (0.10 has both).
    default = jax.sharding.make_single_device_sharding(jax.local_devices()[0])

    def fill(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct) and getattr(leaf, "sharding", None) is None:
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=default)
        return leaf

    return jax.tree.map(fill, abstract_tree)
