"""Device mesh over ('data', 'fsdp', 'tensor') and the logical-axis rules for parameters.

Parameters carry logical axis names (models/layers.py); `LOGICAL_RULES` maps them to mesh axes,
so data parallelism, FSDP (ZeRO-3 style parameter sharding) and tensor parallelism are mesh
sizes in the config, not code. The batch is sharded over ('data', 'fsdp'). The mesh uses Auto
axis types, so XLA's sharding propagation places intermediates (ARCHITECTURE.md, "Facts").
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from pretext_jax.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "mlp": "tensor",
    "layers": None,
    "norm": None,
}


def make_mesh(data: int, fsdp: int, tensor: int, devices: list[Any] | None = None) -> Mesh:
    """A mesh of the given axis sizes over `devices` (default: all); one size may be -1."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise UserError("only one of mesh.data, mesh.fsdp, mesh.tensor may be -1")
    known = math.prod(s for s in sizes if s != -1)
    if any(s == 0 or s < -1 for s in sizes) or len(devices) % known:
        raise UserError(f"mesh {sizes} does not fit {len(devices)} devices; choose sizes whose "
                        f"product is {len(devices)} (or use -1 for one axis)")
    sizes = [len(devices) // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != len(devices):
        raise UserError(f"mesh {sizes} uses {math.prod(sizes)} devices but {len(devices)} are "
                        f"present; make the product {len(devices)} or set one axis to -1")
    grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(names: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh
                    ) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec. A dimension that the mesh axis does not divide
    stays replicated (with a warning): tiny test models and odd vocabularies still run."""
    spec = []
    used: set[str] = set()
    for name, size in zip(names, shape, strict=True):
        rule = LOGICAL_RULES.get(name) if name is not None else None
        wanted = (rule,) if isinstance(rule, str) else rule or ()
        axes = tuple(a for a in wanted if a not in used and mesh.shape[a] > 1)
        if not axes:
            spec.append(None)
            continue
        ways = math.prod(mesh.shape[a] for a in axes)
        if size % ways:
            warnings.warn(f"dimension {name}={size} is not divisible by mesh axes {axes} "
                          f"({ways}); keeping it replicated", stacklevel=2)
            spec.append(None)
            continue
        spec.append(axes[0] if len(axes) == 1 else axes)
        used.update(axes)
    return PartitionSpec(*spec)


def state_shardings(state: nnx.State, mesh: Mesh) -> Any:
    """NamedShardings for an nnx.State: by logical names where a Variable has them, replicated
    otherwise (scalars, counters, RNG keys)."""

    def one(leaf: Any) -> NamedSharding:
        names = leaf.get_metadata().get("out_sharding") if isinstance(leaf, nnx.Variable) else None
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        shape = np.shape(value)
        if not names or len(names) != len(shape):
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, logical_to_spec(tuple(names), shape, mesh))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension over ('data', 'fsdp'), the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def optimizer_shardings(abstract_opt: Any, param_shardings: Any, mesh: Mesh) -> Any:
    """Shardings of an optimizer state: each moment sharded like the parameter it belongs to
    (matched by the end of its tree path), scalars and the rest replicated."""
    by_path: dict[tuple[str, ...], Any] = {}
    for path, sharding in jax.tree_util.tree_leaves_with_path(param_shardings):
        by_path[tuple(str(k) for k in path)] = sharding

    def pick(path: tuple[Any, ...], leaf: Any) -> Any:
        keys = tuple(str(k) for k in path)
        if keys and keys[-1] == ".value":  # the Variable's own node, not a parameter name
            keys = keys[:-1]
        for n in range(len(keys)):
            if keys[n:] in by_path and np.ndim(leaf) > 0:
                return by_path[keys[n:]]
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(pick, abstract_opt)


def check_batch(mesh: Mesh, batch_size: int, grad_accum_steps: int) -> None:
    """Refuses a global batch whose micro-batches do not split evenly over the data axes
    (data x fsdp) or whose rows do not split evenly over the processes."""
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = batch_size // grad_accum_steps
    if micro % shards:
        raise UserError(
            f"global batch {batch_size} / grad_accum_steps {grad_accum_steps} = {micro} is not "
            f"divisible by the data axes (data*fsdp = {shards}); use a multiple of "
            f"{shards * grad_accum_steps} for train.batch_size or change mesh.*")
    if batch_size % jax.process_count():
        raise UserError(f"train.batch_size={batch_size} is not divisible by the "
                        f"{jax.process_count()} processes")
