"""A second device on a CPU-only machine, for catching host/device mix-ups without a GPU.

`SimulatedDevice` is a torch dispatch mode under which tensors created on (or moved to) the
device named `meta` are real CPU tensors wrapped in `OnDevice`, and every op is checked the way
a CUDA build of PyTorch and vLLM would check it:

- aten ops may not mix device tensors with host tensors (host 0-dim scalars excepted), except
  copies between devices and host index tensors into a device tensor (both allowed by CUDA);
- custom ops (vLLM's `_C` kernels: rotary embedding, cache writes) accept device tensors only,
  as the CUDA wheel registers them for CUDA alone.

The data is real, so code under the mode computes real results that tests can compare.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = torch.device("meta")
_aten = torch.ops.aten
_CROSS_DEVICE = {_aten.copy_.default, _aten._to_copy.default, _aten._copy_from.default}
_INDEXING = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default}


class DeviceMismatch(RuntimeError):
    pass


class OnDevice(torch.Tensor):
    """A CPU tensor that reports the simulated device."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.size(), strides=inner.stride(),
                                                   storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                   device=DEVICE)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("OnDevice tensors are only usable inside SimulatedDevice()")

    def __repr__(self) -> str:
        return f"OnDevice({self.inner!r})"


def to_device(t: torch.Tensor) -> OnDevice:
    return OnDevice(t)


def to_host(t: torch.Tensor) -> torch.Tensor:
    return t.inner if isinstance(t, OnDevice) else t


class SimulatedDevice:
    """Context manager: aten ops are checked by dispatch, custom kernels (which bypass Python
    dispatch through their catch-all registration) by a torch-function mode."""

    def __enter__(self) -> "SimulatedDevice":
        self._modes = [_CustomKernels(), _AtenOps()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class _CustomKernels(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and _is_custom(func):
            flat = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            if any(not isinstance(a, OnDevice) for a in flat):
                raise DeviceMismatch(f"{func}: host tensor given to a kernel the CUDA build has for the device only")
            args, kwargs = pytree.tree_map_only(OnDevice, lambda t: t.inner, (args, kwargs))
        return func(*args, **kwargs)


def _is_custom(func) -> bool:
    namespace = getattr(func, "namespace", None) or func._qualified_op_name.split("::")[0]
    return namespace not in ("aten", "prims")


class _AtenOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        on_dev = [a for a in flat if isinstance(a, OnDevice)]
        on_host = [a for a in flat if not isinstance(a, OnDevice) and a.dim() > 0]
        _check(func, args, on_dev, on_host)
        wrappers = {id(a.inner): a for a in on_dev}
        inner_args, inner_kwargs = pytree.tree_map_only(OnDevice, lambda t: t.inner, (args, kwargs))
        to_dev = _targets_device(func, inner_kwargs) if func in _CROSS_DEVICE or not flat else None
        if to_dev is not None:
            inner_kwargs = {**inner_kwargs, "device": torch.device("cpu")}
        out = func(*inner_args, **inner_kwargs)
        # A copy goes where its device argument says, else stays where its input was.
        wrap = to_dev if to_dev is not None else bool(on_dev)
        if func is _aten.copy_.default:
            return args[0]
        return pytree.tree_map_only(torch.Tensor, lambda t: _rewrap(t, wrappers, wrap), out)


def _rewrap(t: torch.Tensor, wrappers: dict, wrap: bool) -> torch.Tensor:
    """An in-place op's result is its input's wrapper; a new result is wrapped if on the device."""
    known = wrappers.get(id(t))
    if known is not None:
        return known
    return OnDevice(t) if wrap else t


def _check(func, args, on_dev, on_host) -> None:
    name = f"{func.namespace}::{func._schema.name.split('::')[-1]}"
    if _is_custom(func):
        return  # checked by _CustomKernels before its tensors were unwrapped
    if func in _CROSS_DEVICE or not (on_dev and on_host):
        return
    if func in _INDEXING and isinstance(args[0], OnDevice):
        indices = [a for a in pytree.tree_leaves(args[1:2]) if isinstance(a, torch.Tensor)]
        others = [a for a in pytree.tree_leaves(args[2:]) if isinstance(a, torch.Tensor) and a.dim() > 0]
        if not any(not isinstance(a, OnDevice) for a in others) and indices:
            return  # host index tensors into a device tensor: CUDA allows it
    raise DeviceMismatch(f"{name}: expected all tensors on the same device, got the device and the host")


def _targets_device(func, kwargs) -> bool | None:
    """For copies and factories: True when the result goes to the simulated device, False to the host."""
    device = kwargs.get("device")
    if device is None:
        return None
    return torch.device(device).type == DEVICE.type
