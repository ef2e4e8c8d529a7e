"""Weights between ``npattn.MultiHeadAttention`` and ``torch.nn.MultiheadAttention``.

torch is imported inside the functions only, so ``import npattn`` never
imports it and torch stays an optional extra: ``pip install torch==2.13.0``
(the CPU build; a plain ``pip install torch`` pulls a multi-GB CUDA build).

Only weights are converted, never data layout: npattn's inputs are
(B, L, D); torch's are (L, B, D) unless the torch module was built with
``batch_first=True``. Transpose your inputs, or use ``batch_first=True``.
torch's ``True = ignore`` masks are converted by ``npattn.masks``, not here.

This module never imports ``npattn.module``: it reads a module's layout from
its attributes (``d_model``, ``kdim``, ...) and its ``params``, and
``MultiHeadAttention.from_torch`` builds the module from ``config_from_torch``
and ``load_torch_state_dict``.

Name mapping (Dkv = D for every torch layer)::

    torch state dict                       npattn params
    in_proj_weight      (3D, D)            w_q, w_k, w_v stacked      (kdim == vdim == D)
    q_proj_weight       (D, D)             w_q                        (kdim or vdim != D)
    k_proj_weight       (D, kdim)          w_k
    v_proj_weight       (D, vdim)          w_v
    in_proj_bias        (3D,)              b_q, b_k, b_v stacked      (bias=True)
    bias_k, bias_v      (1, 1, D)          bias_k, bias_v  (D,)       (add_bias_kv=True)
    out_proj.weight     (D, D)             w_o
    out_proj.bias       (D,)               b_o                        (bias=True)

torch has one ``bias`` flag for both projections and no ``qdim``,
``n_kv_head`` or ``sinks`` parameter; npattn layers that use them have no
torch state dict and get a ``ValueError`` naming the setting. ``scale`` and
``softcap`` change no parameter: their weights convert, but torch's module
computes without them (its scale is always ``1 / sqrt(Dh)``, with no cap).
A module built by ``from_torch`` has the defaults (``sinks=False``).
A subclass of ``torch.nn.MultiheadAttention`` with its own ``forward``
computes something else and is a ``ValueError`` (``check_torch_methods``); forward
hooks are not read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import array_api_compat
import numpy as np

from . import validation as V
from .backend import from_numpy, to_numpy

__all__ = [
    "check_state_dict",
    "host_tensor",
    "config_from_torch",
    "options_from_torch",
    "params_from_torch_state_dict",
    "load_torch_state_dict",
    "module_dtype",
    "check_torch_methods",
    "torch_state_dict",
    "torch_state_dict_shapes",
]


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "npattn.torch_interop needs PyTorch: pip install torch==2.13.0 for the CPU "
            "build (a plain 'pip install torch' pulls a multi-GB CUDA build)"
        ) from exc
    return torch


#: What the conversions read of ``mha`` (an npattn ``MultiHeadAttention``).
_LAYOUT = ("d_model", "n_head", "n_kv_head", "qdim", "kdim", "vdim", "qkv_bias", "out_bias",
           "add_bias_kv", "params")


def _check_torch_compatible(mha) -> None:
    """torch's MultiheadAttention has no qdim, no GQA, no sinks and one bias flag."""
    lacking = [a for a in _LAYOUT if not hasattr(mha, a)]
    if lacking:
        raise TypeError(f"mha: expected an npattn MultiHeadAttention, got {V.type_name(mha)} "
                        f"(without {', '.join(lacking)})")
    if mha.qdim != mha.d_model:
        raise ValueError(
            f"qdim: torch.nn.MultiheadAttention needs qdim == d_model={mha.d_model}, got {mha.qdim}"
        )
    if mha.n_kv_head != mha.n_head:
        raise ValueError(
            f"n_kv_head: torch.nn.MultiheadAttention needs n_kv_head == n_head={mha.n_head}, "
            f"got {mha.n_kv_head}"
        )
    if getattr(mha, "sinks", False):
        raise ValueError(
            "sinks: expected a module without attention sinks (torch.nn.MultiheadAttention has "
            "none, no place for the parameter 'sinks'), got sinks=True"
        )
    if mha.qkv_bias != mha.out_bias:
        raise ValueError(
            "qkv_bias, out_bias: torch.nn.MultiheadAttention has one bias flag for both, "
            f"got qkv_bias={mha.qkv_bias}, out_bias={mha.out_bias}"
        )


def torch_state_dict_shapes(mha: Any) -> "OrderedDict[str, tuple]":
    """The keys and shapes of the torch state dict of ``mha``, in torch's order.

    Parameters
    ----------
    mha : MultiHeadAttention
        A layout torch has (``qdim == d_model``, ``n_kv_head == n_head``, no sinks, and
        ``qkv_bias == out_bias``); another is a ``ValueError`` naming the setting.

    Returns
    -------
    shapes : OrderedDict of str to tuple of int
        As the module docstring's table: ``in_proj_weight`` (3D, D) when ``kdim ==
        vdim == D``, else ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``; the
        biases and ``bias_k``/``bias_v`` (1, 1, D) where the module has them.
    """
    _check_torch_compatible(mha)
    D = mha.d_model
    shapes: "OrderedDict[str, tuple]" = OrderedDict()
    if mha.kdim == D and mha.vdim == D:
        shapes["in_proj_weight"] = (3 * D, D)
    else:
        shapes["q_proj_weight"] = (D, D)
        shapes["k_proj_weight"] = (D, mha.kdim)
        shapes["v_proj_weight"] = (D, mha.vdim)
    if mha.qkv_bias:
        shapes["in_proj_bias"] = (3 * D,)
    if mha.add_bias_kv:
        shapes["bias_k"] = (1, 1, D)
        shapes["bias_v"] = (1, 1, D)
    shapes["out_proj.weight"] = (D, D)
    if mha.out_bias:
        shapes["out_proj.bias"] = (D,)
    return shapes


def _host(x) -> np.ndarray:
    """A host NumPy copy of a torch tensor or any backend's array (bfloat16 widened to float32, exactly)."""
    if array_api_compat.is_torch_array(x):
        torch = _torch()
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            x = x.to(torch.float32)
        return x.numpy().copy()
    a = np.asarray(to_numpy(x))
    return a.astype(np.float32) if a.dtype.name == "bfloat16" else a  # JAX's (ml_dtypes')


def check_state_dict(state_dict: Any) -> None:
    """``TypeError`` unless ``state_dict`` is a mapping (of names to tensors)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict: expected a mapping of names to tensors (a torch "
                        f"state_dict), got {V.type_name(state_dict)}")


def host_tensor(name: str, value: Any) -> np.ndarray:
    """``state_dict[name]`` as a host NumPy copy (bfloat16 widened to float32, exactly); a
    ``TypeError`` naming it unless it is a floating tensor or array (a NumPy masked array, or
    dask's of masked chunks, is none: its mask would be lost)."""
    # a class is none (NumPy's scalar types carry shape and dtype as descriptors)
    if isinstance(value, type) or not (hasattr(value, "shape") and hasattr(value, "dtype")):
        raise TypeError(f"state_dict[{name!r}]: expected a tensor or array, got {V.type_name(value)}")
    masked = V.masked_array_kind(value)
    if masked:  # the copy would keep the data and drop the mask
        raise TypeError(f"state_dict[{name!r}]: expected a tensor or a plain array, got "
                        f"{masked} (npattn would ignore its mask); pass its data, "
                        f"{V.masked_data_call(value)}, with the masked entries filled in")
    try:
        a = _host(value)
    except (NotImplementedError, RuntimeError, TypeError, ValueError) as exc:  # e.g. torch's meta
        # tensors, which hold no numbers to copy
        raise TypeError(f"state_dict[{name!r}]: expected a tensor whose numbers can be copied to "
                        f"the host, got one that cannot be ({type(exc).__name__}: {exc})") from exc
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"state_dict[{name!r}]: expected a floating tensor, got dtype {value.dtype}")
    return a


def params_from_torch_state_dict(mha: Any, state_dict: Any) -> dict:
    """A ``torch.nn.MultiheadAttention`` state dict as npattn parameters: host NumPy arrays.

    ``mha`` gives the layout (the attributes ``torch_state_dict_shapes``
    reads). Values may be torch tensors or arrays of any backend (not NumPy
    masked arrays, whose mask would be lost); they keep their dtype (bfloat16
    widened to float32, exactly). All keys are checked
    (missing, unexpected, shape) first. Returns ``{name: array}``, e.g.
    ``w_q`` (D, D), ``b_q`` (D,), ``bias_k`` (D,), in ``mha.params``' order
    where it has them.

    Parameters
    ----------
    mha : MultiHeadAttention
        The layout, as ``torch_state_dict_shapes``'; its parameters are not changed.
    state_dict : mapping of str to tensor or array
        Exactly the keys ``torch_state_dict_shapes(mha)`` lists, of those shapes,
        floating.

    Returns
    -------
    params : dict of str to numpy.ndarray
        New host arrays (copies), ``w_k`` (D, kdim) and ``w_v`` (D, vdim).
    """
    expected = torch_state_dict_shapes(mha)
    check_state_dict(state_dict)
    got = set(state_dict.keys())
    missing = [k for k in expected if k not in got]
    unexpected = sorted(got - set(expected), key=str)  # key=str: a key may be no string
    if missing or unexpected:
        raise ValueError(
            f"state_dict: expected keys {list(expected)}, got {sorted(got, key=str)} "
            f"(missing {missing}, unexpected {unexpected})"
        )
    host = {}
    for name, shape in expected.items():
        a = host_tensor(name, state_dict[name])
        if tuple(a.shape) != shape:
            raise ValueError(f"state_dict[{name!r}]: expected shape {shape}, got {tuple(a.shape)}")
        host[name] = a

    D = mha.d_model
    params = {}
    if "in_proj_weight" in host:
        w = host["in_proj_weight"]  # [3D, D]
        params["w_q"], params["w_k"], params["w_v"] = w[:D], w[D : 2 * D], w[2 * D :]
    else:
        params["w_q"] = host["q_proj_weight"]  # [D, D]
        params["w_k"] = host["k_proj_weight"]  # [D, Dk]
        params["w_v"] = host["v_proj_weight"]  # [D, Dv]
    params["w_o"] = host["out_proj.weight"]  # [D, D]
    if "in_proj_bias" in host:
        b = host["in_proj_bias"]  # [3D]
        params["b_q"], params["b_k"], params["b_v"] = b[:D], b[D : 2 * D], b[2 * D :]
    if "out_proj.bias" in host:
        params["b_o"] = host["out_proj.bias"]  # [D]
    if "bias_k" in host:
        params["bias_k"] = host["bias_k"].reshape(D)  # [1, 1, D] -> [D]
        params["bias_v"] = host["bias_v"].reshape(D)
    order = [n for n in mha.params] + [n for n in params if n not in mha.params]
    return {n: np.array(params[n]) for n in order if n in params}  # copies, not views


def load_torch_state_dict(mha: Any, state_dict: Any) -> None:
    """Set ``mha.params`` from a ``torch.nn.MultiheadAttention`` state dict.

    Values may be torch tensors or arrays of any backend; they are cast to
    ``mha.dtype`` on ``mha``'s backend. All keys are checked (missing,
    unexpected, shape) before anything is assigned.

    Parameters
    ----------
    mha : MultiHeadAttention
        Its ``params`` are replaced, all of them, once every key and shape is checked.
    state_dict : mapping of str to tensor or array
        As ``params_from_torch_state_dict``'s.
    """
    host = params_from_torch_state_dict(mha, state_dict)
    mha.params = {n: mha.xp.astype(from_numpy(a, mha.xp), mha.dtype) for n, a in host.items()}


def torch_state_dict(mha: Any) -> "OrderedDict":
    """``mha.params`` as a ``torch.nn.MultiheadAttention`` state dict.

    CPU tensors of the torch dtype matching ``mha.dtype``, copies (not views
    of the parameters), keys in torch's order; ``module.load_state_dict`` of
    a torch module built with the same settings accepts it.

    Parameters
    ----------
    mha : MultiHeadAttention
        Of a layout torch has (``torch_state_dict_shapes``).

    Returns
    -------
    state_dict : OrderedDict of str to torch.Tensor
        The keys and shapes of ``torch_state_dict_shapes(mha)``.
    """
    torch = _torch()
    shapes = torch_state_dict_shapes(mha)
    P = mha.params
    dtype = getattr(torch, V.dtype_name(mha.dtype))

    def t(name):
        x = P[name]
        if array_api_compat.is_torch_array(x):
            return x.detach().to(device="cpu", dtype=dtype, copy=True)
        return torch.from_numpy(_host(x)).to(dtype)

    sd = OrderedDict()
    for name in shapes:
        if name == "in_proj_weight":
            sd[name] = torch.cat([t("w_q"), t("w_k"), t("w_v")], dim=0)  # [3D, D]
        elif name == "in_proj_bias":
            sd[name] = torch.cat([t("b_q"), t("b_k"), t("b_v")], dim=0)  # [3D]
        elif name in ("bias_k", "bias_v"):
            sd[name] = t(name).reshape(1, 1, -1)  # [1, 1, D]
        else:
            src = {"q_proj_weight": "w_q", "k_proj_weight": "w_k", "v_proj_weight": "w_v",
                   "out_proj.weight": "w_o", "out_proj.bias": "b_o"}[name]
            sd[name] = t(src)
    return sd


def module_dtype(module: Any, name: str = "module") -> str:
    """The name of the one dtype of a torch module's parameters ("float32", ...).

    A module without parameters is read from its floating-point buffers (weights
    held as buffers are in its state dict all the same). A ``ValueError`` naming
    ``name`` when the tensors read have more than one dtype: npattn's modules have
    one, and casting every tensor to one of them would round the others silently
    (torch's own forward refuses such a module); and when the module has neither
    parameters nor floating-point buffers, whose dtype no default should stand for.
    """
    tensors, what = list(module.named_parameters()), "parameters"
    if not tensors:
        tensors, what = [(n, b) for n, b in module.named_buffers() if b.is_floating_point()], "buffers"
    if not tensors:
        raise ValueError(f"{name}: expected a module with parameters or floating-point buffers (the "
                         f"dtype of the copy is theirs), got a {type(module).__name__} with neither")
    by_dtype: dict = {}
    for n, p in tensors:
        by_dtype.setdefault(V.dtype_name(p.dtype), []).append(n)
    if len(by_dtype) > 1:
        got = "; ".join(f"{d} ({', '.join(ns)})" for d, ns in by_dtype.items())
        raise ValueError(f"{name}: expected {what} of one dtype (npattn's modules have one), "
                         f"got {got}")
    return next(iter(by_dtype))


def check_torch_methods(name: str, module: Any, kind: Any, methods: tuple = ("forward",), *,
                        part: str = "", why: str = "") -> None:
    """``ValueError`` naming ``name`` if the class of ``module`` (an instance of the torch class
    ``kind``) defines any of ``kind``'s ``methods`` anew: npattn copies the weights and computes
    as ``kind`` does, and a subclass with its own ``forward`` computes something else, which no
    copy of its weights reproduces. ``part`` ("linear1 with ") and ``why`` (" (...)") word it."""
    own = [m for m in methods if getattr(type(module), m, None) is not getattr(kind, m)]
    if own:
        cls = type(module)
        raise ValueError(f"{name}: expected {part}torch.nn.{kind.__name__}'s {', '.join(own)}{why}, "
                         f"got a {cls.__module__}.{cls.__qualname__} with its own")


def options_from_torch(module: Any) -> dict:
    """The ``MultiHeadAttention`` keyword arguments a ``torch.nn.MultiheadAttention``'s
    attributes give: ``d_model``, ``n_head``, ``dropout``, ``bias``, ``qkv_bias``,
    ``out_bias``, ``kdim``, ``vdim``, ``add_bias_kv`` and ``add_zero_attn``
    (``config_from_torch`` without ``dtype``). The transformer blocks' ``from_torch`` read
    their attention modules with it, and name a mixed dtype for the whole layer
    (``module_dtype``).

    Parameters
    ----------
    module : torch.nn.MultiheadAttention
        Not a subclass with its own ``forward`` (a ``ValueError``).

    Returns
    -------
    options : dict
        ``d_model`` (``embed_dim``), ``n_head`` (``num_heads``), ``dropout``,
        ``bias`` and ``qkv_bias`` (``in_proj_bias`` present), ``out_bias``
        (``out_proj.bias`` present), ``kdim``, ``vdim``, ``add_bias_kv`` (``bias_k``
        present), ``add_zero_attn``.
    """
    torch = _torch()
    if not isinstance(module, torch.nn.MultiheadAttention):
        raise TypeError(
            f"module: expected a torch.nn.MultiheadAttention, got {type(module).__name__}"
        )
    check_torch_methods("module", module, torch.nn.MultiheadAttention,
                        why=" (npattn computes as torch's module does)")
    bias = module.in_proj_bias is not None
    return dict(
        d_model=module.embed_dim,
        n_head=module.num_heads,
        dropout=module.dropout,
        bias=bias,
        qkv_bias=bias,
        out_bias=module.out_proj.bias is not None,
        kdim=module.kdim,
        vdim=module.vdim,
        add_bias_kv=module.bias_k is not None,
        add_zero_attn=bool(module.add_zero_attn),
    )


def config_from_torch(module: Any) -> dict:
    """The ``MultiHeadAttention`` keyword arguments that copy the layout of a torch module.

    Parameters
    ----------
    module : torch.nn.MultiheadAttention

    Returns
    -------
    dict
        The keys of ``options_from_torch`` and ``dtype`` (a name: "float32",
        ...; a ``ValueError`` when the parameters have more than one,
        ``module_dtype``). ``module.batch_first`` is not among them: npattn
        always takes (B, L, D) inputs.
    """
    return dict(options_from_torch(module), dtype=module_dtype(module, "module"))
