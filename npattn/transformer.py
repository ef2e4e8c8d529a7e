"""The Transformer's encoder and decoder blocks, composed of npattn's pairs.

``TransformerBlock`` computes what ``torch.nn.TransformerEncoderLayer(batch_first=True)``
computes and ``TransformerDecoderBlock`` what ``torch.nn.TransformerDecoderLayer(batch_first=True)``
does, each with a hand-derived backward. A block is a stack of *sublayers*; each is

* post-norm (``norm_first=False``, the original Transformer's):
  ``out = layer_norm(x + dropout(core(x)))``
* pre-norm (``norm_first=True``): ``out = x + dropout(core(layer_norm(x)))``

where ``core`` is self-attention (``MultiHeadAttention``), cross-attention over
``memory`` or the feed-forward network (``layers.feed_forward_forward``). The
pure pair ``sublayer_forward`` / ``sublayer_backward`` does the norm, the
dropout and the residual around any core; the blocks are thin stateful
compositions of it (docs/transformer.md derives the backward).

Shape legend
------------
B batch, L target length, Lm memory length, D = d_model, H heads,
F = d_ff (the feed-forward width).

Code uses only the Python Array API standard through ``xp``.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import functools
import math
from collections import OrderedDict
from typing import Any, Callable, Mapping, NamedTuple, Optional

import numpy as np

from . import functional as F
from . import layers as Ly
from . import validation as V
from .backend import (backend_name, device_of, dropout_key, from_numpy, generator_kept_on_failure, keep_mask,
                      namespace, seed_sequence)
from .module import (MultiHeadAttention, check_forward_impl, check_forward_inputs,
                     check_params_assignment, check_path, model_from_save_file, picklable_state,
                     restore_state, set_rng_state, write_save_file)

__all__ = [
    "TransformerBlock",
    "TransformerDecoderBlock",
    "SublayerCache",
    "BlockState",
    "BlockGradState",
    "sublayer_forward",
    "sublayer_backward",
    "ENCODER_DROPOUT_SITES",
    "DECODER_DROPOUT_SITES",
]

#: The dropout sites of ``TransformerBlock``, named as the torch layer's modules:
#: ``self_attn`` the attention probabilities (B, H, L, L); ``dropout1`` after the
#: attention (B, L, D); ``dropout`` inside the feed-forward (B, L, F); ``dropout2``
#: after the feed-forward (B, L, D).
ENCODER_DROPOUT_SITES = ("self_attn", "dropout1", "dropout", "dropout2")

#: The dropout sites of ``TransformerDecoderBlock``: ``self_attn`` (B, H, L, L) and
#: ``multihead_attn`` (B, H, L, Lm) the attention probabilities; ``dropout1``,
#: ``dropout2``, ``dropout3`` after self-attention, cross-attention and the
#: feed-forward (B, L, D); ``dropout`` inside the feed-forward (B, L, F).
DECODER_DROPOUT_SITES = ("self_attn", "multihead_attn", "dropout1", "dropout2", "dropout3", "dropout")

#: Each dropout site's shape in the legend's letters, as the messages about a keep-mask say it.
SITE_SHAPES = {"self_attn": "(B, H, L, L)", "multihead_attn": "(B, H, L, Lm)", "dropout1": "(B, L, D)",
               "dropout2": "(B, L, D)", "dropout3": "(B, L, D)", "dropout": "(B, L, F)"}

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")

#: The ``format_version`` of the blocks' ``save`` files (their ``format`` is the
#: class's ``SAVE_FORMAT``: ``"npattn.TransformerBlock"``, ``"npattn.TransformerDecoderBlock"``).
SAVE_VERSION = 1

#: The constructor arguments a save file's ``config`` holds, all of them (format version 1).
CONFIG_KEYS = ("d_model", "n_head", "d_ff", "dropout", "activation", "norm_first", "layer_norm_eps",
               "bias", "dtype")


# --------------------------------------------------------------------------
# the pure pair: norm, core, dropout and residual around any core


class SublayerCache(NamedTuple):
    """What ``sublayer_backward`` needs from ``sublayer_forward``."""
    norm: Ly.LayerNormCache  #: the sublayer's layer norm (of x pre-norm, of the sum post-norm)
    core: Any  #: the core's own cache (MHACache, FeedForwardCache, ...)
    drop: F.DropoutCache  #: holds the keep-mask of the dropout after the core
    res: Ly.ResidualCache  #: s = x + y
    norm_first: bool  #: pre-norm (True) or post-norm


def sublayer_forward(x: Any, core: Callable, *, norm_weight: Any, norm_bias: Any, eps: float,
                     norm_first: bool, dropout_p: float, dropout_mask: Any = None,
                     rng: Any = None) -> tuple[Any, SublayerCache]:
    """One residual sublayer around ``core``, post-norm or pre-norm.

    Post-norm (``norm_first=False``):

    1. ``c = core(x)``                          [B, L, D]
    2. ``y = dropout(c)``                       [B, L, D]
    3. ``s = x + y``                            (``layers.residual_forward``)
    4. ``out = layer_norm(s)``                  [B, L, D]

    Pre-norm (``norm_first=True``):

    1. ``n = layer_norm(x)``                    [B, L, D]
    2. ``c = core(n)``                          [B, L, D]
    3. ``y = dropout(c)``                       [B, L, D]
    4. ``out = x + y``                          (``layers.residual_forward``)

    Parameters
    ----------
    x : array, shape (B, L, D)
    core : callable
        ``core(n) -> (c, core_cache)``, a tuple, with ``c`` of the library,
        device, shape and dtype of ``x`` (anything else is a ``TypeError`` or
        ``ValueError`` naming ``core``: never broadcast into the residual).
    norm_weight, norm_bias : array, shape (D,), or None
    eps : float
    norm_first : bool
    dropout_p : float
        Drop probability after the core (0 turns it off).
    dropout_mask : bool array broadcastable to (B, L, D), optional
        Keep-mask; otherwise drawn from ``rng`` when ``dropout_p > 0``.
    rng : int, numpy.random.SeedSequence, BitGenerator, Generator or None

    Returns
    -------
    out : array, shape (B, L, D)
    cache : SublayerCache
    """
    # [B, L, D] -> [B, L, D]
    _check_sublayer_inputs(x, core, norm_weight, norm_bias, eps, norm_first, dropout_p,
                           dropout_mask, rng)
    like = V.spec_of(x)
    with generator_kept_on_failure(rng):  # a step failing after the draw puts rng back
        if norm_first:
            n, norm_c = Ly.layer_norm_forward(x, norm_weight, norm_bias, eps)  # 1. [B, L, D]
            c, core_c = _core_pair(core(n), like)  # 2.                            [B, L, D]
            y, drop_c = F.dropout_forward(c, dropout_p, mask=dropout_mask, rng=rng)  # 3. [B, L, D]
            out, res_c = Ly.residual_forward(x, y)  # 4.                           [B, L, D]
        else:
            c, core_c = _core_pair(core(x), like)  # 1.                            [B, L, D]
            y, drop_c = F.dropout_forward(c, dropout_p, mask=dropout_mask, rng=rng)  # 2. [B, L, D]
            s, res_c = Ly.residual_forward(x, y)  # 3.                             [B, L, D]
            out, norm_c = Ly.layer_norm_forward(s, norm_weight, norm_bias, eps)  # 4. [B, L, D]
    return out, SublayerCache(norm_c, core_c, drop_c, res_c, bool(norm_first))


def _check_sublayer_inputs(x: Any, core: Any, norm_weight: Any, norm_bias: Any, eps: Any,
                           norm_first: Any, dropout_p: Any, dropout_mask: Any, rng: Any) -> None:
    """``sublayer_forward``'s arguments, by its names, before the core runs (the layer norm
    and the dropout check their own again under their names, which then pass)."""
    with V.argument_names({"weight": "norm_weight", "bias": "norm_bias"}):
        Ly.check_layer_norm_inputs(x, norm_weight, norm_bias, eps)
    if not callable(core):
        raise TypeError(f"core: expected a callable core(n) -> (out, cache), got {V.type_name(core)}")
    V.check_bool("norm_first", norm_first)
    V.check_probability("dropout_p", dropout_p)
    V.check_mask("dropout_mask", dropout_mask, namespace(x), target=V.shape_of(x),
                 target_text="x", dtype=x.dtype, device=device_of(x), bool_only=True,
                 where="like x", library="that of x")
    V.check_rng("rng", rng)


def _check_like_x(name: str, a: Any, like: V.ArraySpec) -> None:
    """``a``, returned by the callable ``name``, has x's library, device, shape and dtype:
    nothing is broadcast into the residual or promoted."""
    V.check_grad(name, a, shape=like.shape, dtype=like.dtype, xp=like.xp, device=like.device, of="x")


def _core_pair(result: Any, like: V.ArraySpec) -> tuple[Any, Any]:
    """``(out, cache)`` from what ``core`` returned, ``out`` like x."""
    if not (isinstance(result, tuple) and len(result) == 2):
        got = V.type_name(result)
        if isinstance(result, tuple):
            got = f"a tuple of {len(result)} items"
        elif hasattr(result, "shape"):
            got += f" of shape {V.shape_of(result)}"
        raise TypeError(f"core: expected a pair (out, cache), out of x's shape, got {got}")
    _check_like_x("core", result[0], like)
    return result[0], result[1]


def sublayer_backward(dout: Any, cache: SublayerCache, core_backward: Callable
                      ) -> tuple[Any, Any, Any]:
    """Gradients of ``sublayer_forward``: its steps' backwards in reverse.

    The input ``x`` reaches the output twice, through the residual and through
    the core, so ``dx`` is the sum of the two paths' gradients.

    Parameters
    ----------
    dout : array, shape (B, L, D)
    cache : SublayerCache
    core_backward : callable
        ``core_backward(dc, core_cache) -> dn``, the gradient with respect to
        the core's input, of the library, device, shape and dtype of ``x``
        (checked, as ``core``'s output; the core's own parameter gradients
        are its business).

    Returns
    -------
    dx : array, shape (B, L, D)
    dnorm_weight, dnorm_bias : array, shape (D,), or None
    """
    # [B, L, D] -> [B, L, D], [D], [D]
    V.check_cache("cache", cache, SublayerCache, "sublayer_forward")
    if cache.norm_first:
        # 4. out = x + y
        dx_res, dy = Ly.residual_backward(dout, cache.res)  # [B, L, D] each
        # 3. y = dropout(c), with the forward's keep-mask
        dc = F.dropout_backward(dy, cache.drop)  # [B, L, D]
        # 2. c = core(n)
        dn = core_backward(dc, cache.core)  # [B, L, D]
        _check_like_x("core_backward", dn, cache.res.like)
        # 1. n = layer_norm(x)
        dx_norm, dw, db = Ly.layer_norm_backward(dn, cache.norm)  # [B, L, D], [D], [D]
        return dx_res + dx_norm, dw, db  # x fed the residual and the norm
    # 4. out = layer_norm(s)
    ds, dw, db = Ly.layer_norm_backward(dout, cache.norm)  # [B, L, D], [D], [D]
    # 3. s = x + y
    dx_res, dy = Ly.residual_backward(ds, cache.res)  # [B, L, D] each
    # 2. y = dropout(c)
    dc = F.dropout_backward(dy, cache.drop)  # [B, L, D]
    # 1. c = core(x)
    dx_core = core_backward(dc, cache.core)  # [B, L, D]
    _check_like_x("core_backward", dx_core, cache.res.like)
    return dx_res + dx_core, dw, db  # x fed the residual and the core


# --------------------------------------------------------------------------
# the stateful blocks


class EncoderBlockCache(NamedTuple):
    """What ``TransformerBlock.backward`` needs from its ``forward``."""
    attn: SublayerCache  #: core cache: the MHACache of self_attn
    ff: SublayerCache  #: core cache: layers.FeedForwardCache
    out_shape: tuple  #: the output's shape: dout must have it
    out_dtype: Any  #: the output's dtype
    decoding: bool = False  #: the forward appended to a KV cache: nothing to differentiate


class DecoderBlockCache(NamedTuple):
    """What ``TransformerDecoderBlock.backward`` needs from its ``forward``."""
    self_attn: SublayerCache  #: core cache: the MHACache of self_attn
    cross_attn: SublayerCache  #: core cache: the MHACache of multihead_attn
    ff: SublayerCache  #: core cache: layers.FeedForwardCache
    memory_shape: tuple  #: shape of the memory: dmemory has it
    out_shape: tuple  #: the output's shape: dout must have it
    out_dtype: Any  #: the output's dtype


class BlockState(NamedTuple):
    """What a block's forward changes, read by ``forward_state`` and put back by
    ``restore_forward_state``."""

    owner: Any  #: the block it was read from
    cache: Any  #: its cache (EncoderBlockCache, DecoderBlockCache) or None
    attn_caches: dict  #: its attention modules' caches (MHACache or None), by name
    rng_state: Mapping[str, Any]  #: its dropout generator's state
    attn_states: dict  #: its attention modules' forward_state() (the cache and whether it decoded), by name


class BlockGradState(NamedTuple):
    """What a block's backward changes, read by ``backward_state`` and put back by
    ``restore_backward_state``."""

    owner: Any  #: the block it was read from
    grads: dict  #: its grads
    attn: dict  #: its attention modules' (grads, dmask, cache), by name


class _Block(abc.ABC):
    """What both blocks share: parameters, modes, dropout masks, torch state dicts."""

    _ATTNS: tuple = ()  # names of the MultiHeadAttention submodules
    _NORMS: tuple = ()  # names of the layer norms
    _SITES: tuple = ()  # dropout sites
    _TORCH_METHODS: tuple = ()  # the torch layer's methods that compute its output
    SAVE_FORMAT: str = ""  # the ``format`` of the class's save files

    def __init__(self, d_model: int, n_head: int, d_ff: Optional[int] = None, *,
                 dropout: float = 0.0, activation: str = "relu", norm_first: bool = False,
                 layer_norm_eps: float = 1e-5, bias: bool = True, dtype: str = "float32",
                 backend: Any = "numpy", seed: Any = None) -> None:
        d_ff = V.check_positive_int("d_ff", d_ff, allow_none=True)  # Python ints from here on
        V.check_choice("activation", activation, ACTIVATIONS)
        V.check_bool("norm_first", norm_first)
        V.check_bool("bias", bias)
        Ly.check_eps("layer_norm_eps", layer_norm_eps)  # a positive finite float; the dtype's range below
        V.check_seed("seed", seed)
        # linear1.weight (F, D) and linear2.weight (D, F) are drawn in float64: arrays that can exist
        D = V.check_positive_int("d_model", d_model)
        V.check_array_bytes(["d_model"] if d_ff is None else ["d_model", "d_ff"],
                            (4 * D if d_ff is None else d_ff, D), 8, "the weight linear1.weight")
        seqs = seed_sequence(seed).spawn(len(self._ATTNS) + 2)
        attn_seeds = [int(s.generate_state(1)[0]) for s in seqs[: len(self._ATTNS)]]
        # the attention modules check d_model, n_head, dropout, dtype and backend
        self._attn = {
            name: MultiHeadAttention(d_model, n_head, dropout=dropout, bias=bias, dtype=dtype,
                                     backend=backend, seed=s)
            for name, s in zip(self._ATTNS, attn_seeds)
        }
        first = self._attn[self._ATTNS[0]]
        self.xp, self.dtype = first.xp, first.dtype
        Ly.check_eps("layer_norm_eps", layer_norm_eps, self.xp, self.dtype)  # held by the dtype
        self.d_model, self.n_head = int(d_model), int(n_head)
        self.d_ff = 4 * self.d_model if d_ff is None else d_ff
        self.dropout = float(dropout)
        self.activation = activation
        self.norm_first = bool(norm_first)
        self.layer_norm_eps = float(layer_norm_eps)
        self.bias = bool(bias)
        self.training = True
        self._own = self._init_own(np.random.default_rng(seqs[-2]))
        self._rng = np.random.default_rng(seqs[-1])  # every dropout site draws from it
        self.grads: dict = {}
        self._cache: Any = None

    def _init_own(self, rng: np.random.Generator) -> dict:
        """torch's ``nn.Linear`` init: weight and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)); norms 1 and 0.

        Drawn in float64 on the host, then cast, so one seed gives the same
        parameters on every backend.
        """
        D, Fd = self.d_model, self.d_ff
        own = {}
        for name, (fan_out, fan_in) in (("linear1", (Fd, D)), ("linear2", (D, Fd))):
            a = 1.0 / math.sqrt(fan_in)
            own[f"{name}.weight"] = rng.uniform(-a, a, size=(fan_out, fan_in))
            if self.bias:
                own[f"{name}.bias"] = rng.uniform(-a, a, size=fan_out)
        for name in self._NORMS:
            own[f"{name}.weight"] = np.ones(D)
            if self.bias:
                own[f"{name}.bias"] = np.zeros(D)
        return {k: self.xp.astype(from_numpy(v, self.xp), self.dtype) for k, v in own.items()}

    # ------------------------------------------------------------ parameters

    @property
    def params(self) -> dict:
        """A new dict of the parameters, named as the torch layer's state dict.

        ``self_attn.w_q`` ... (the ``MultiHeadAttention`` names, prefixed by
        the submodule: ``self_attn.``, and ``multihead_attn.`` in the decoder),
        ``linear1.weight`` (F, D), ``linear1.bias`` (F,), ``linear2.weight``
        (D, F), ``linear2.bias`` (D,), ``norm1.weight`` (D,), ``norm1.bias``
        (D,), ... (no biases with ``bias=False``). Assign a whole dict to
        ``params`` to replace them (every array checked first); writing into
        the returned dict changes nothing.
        """
        out = {f"{a}.{k}": v for a in self._ATTNS for k, v in self._attn[a].params.items()}
        out.update(self._own)
        return out

    @params.setter
    def params(self, new: dict):
        check_params_assignment(new, self.params, self.xp)
        # all checked; should a module's assignment fail all the same (an interrupt, memory),
        # the modules assigned before it are put back: a failed assignment changes nothing
        before = {a: dict(self._attn[a].params) for a in self._ATTNS}
        try:
            for a in self._ATTNS:
                sub = {k.split(".", 1)[1]: v for k, v in new.items() if k.startswith(a + ".")}
                self._attn[a].params = sub
        except BaseException:
            for a, old in before.items():
                self._attn[a].params = old
            raise
        self._own = {k: new[k] for k in self._own}

    @property
    def rng_state(self) -> dict:
        """The state of the block's dropout generator (every site draws from it), a copy.

        Assign a state read here to restore it (a ``TypeError`` for what is not a
        dict, a ``ValueError`` for a dict NumPy refuses); models made of blocks
        save and load it (``npattn.stack``).
        """
        return copy.deepcopy(dict(self._rng.bit_generator.state))

    @rng_state.setter
    def rng_state(self, state: dict):
        if not isinstance(state, dict):  # (None included: a save file without one leaves
            # the generator as it is, not this setter)
            raise TypeError(f"rng_state: expected a dict read from rng_state, got {V.type_name(state)}")
        set_rng_state("rng_state", self._rng, state)

    @property
    def modes(self) -> dict:
        """The block's mode and its attention modules': ``{"training": ..., "self_attn": ...}``.

        A new dict of bools (``"multihead_attn"`` too in the decoder). ``train``
        and ``eval`` set them all alike; ``block.self_attn.eval()`` sets one
        apart (its dropout on the attention probabilities is off while the
        block's other sites drop). Assign a dict read here to restore them
        (``TypeError`` naming ``modes`` for another type, ``ValueError`` for other
        keys, before any is set);
        ``save`` and ``load`` keep them, so do the models made of blocks.
        """
        return {"training": self.training, **{name: m.training for name, m in self._attn.items()}}

    @modes.setter
    def modes(self, new: dict):
        keys = ["training", *self._ATTNS]
        if not isinstance(new, dict) or not all(isinstance(v, (bool, np.bool_)) for v in new.values()):
            raise TypeError(f"modes: expected a dict of bools with the keys {keys}, got {new!r}")
        if sorted(new, key=str) != sorted(keys):
            raise ValueError(f"modes: expected a dict of bools with the keys {keys}, got {new!r}")
        self.training = bool(new["training"])
        for name, m in self._attn.items():
            m.train(bool(new[name]))

    @property
    def self_attn(self) -> MultiHeadAttention:
        """The self-attention module (its ``params`` are this block's ``self_attn.*``)."""
        return self._attn["self_attn"]

    def train(self, mode: bool = True):
        """Training mode: dropout acts (when ``dropout > 0``). Returns self."""
        V.check_bool("mode", mode)
        self.training = bool(mode)
        for m in self._attn.values():
            m.train(mode)
        return self

    def eval(self):
        """Evaluation mode: dropout is off. Returns self."""
        return self.train(False)

    @abc.abstractmethod
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The block's output; each block defines its own arguments."""

    def __call__(self, *args, **kwargs):
        """``forward(*args, **kwargs)``, as a torch module is called."""
        return self.forward(*args, **kwargs)

    # ---------------------------------------------------------------- dropout

    def _check_dropout_masks(self, dropout_masks: Any, shapes: dict) -> None:
        if dropout_masks is None:
            return
        if not isinstance(dropout_masks, dict):
            raise TypeError(f"dropout_masks: expected a dict or None, got {V.type_name(dropout_masks)}")
        unknown = sorted(set(dropout_masks) - set(self._SITES), key=str)  # a key may be no string
        if unknown:
            raise ValueError(f"dropout_masks: expected keys among {list(self._SITES)}, got {unknown}")
        device = device_of(self.params["linear1.weight"])
        for site, m in dropout_masks.items():
            V.check_mask(f"dropout_masks[{site!r}]", m, self.xp, target=shapes[site],
                         target_text=SITE_SHAPES[site], dtype=self.dtype, device=device,
                         bool_only=True)

    def _masks(self, dropout_masks: Optional[dict]) -> tuple[float, dict]:
        """The drop probability this forward uses and the keep-masks given (none outside training)."""
        if not (self.training and self.dropout > 0.0):
            return 0.0, {}
        return self.dropout, dict(dropout_masks or {})

    def _attention_keep(self, masks: dict, site: str, shape: tuple, p: float) -> Any:
        """The attention-probability keep-mask: the one given, else drawn from the block's generator."""
        if p == 0.0:
            return None
        if masks.get(site) is not None:
            return masks[site]
        return keep_mask(dropout_key(self._rng), p, shape, self.xp,
                         device_of(self.params["linear1.weight"]))  # [B, H, L, Lk] bool

    # ---------------------------------------------------------------- cores

    def _attn_core(self, name: str, *, memory: Any, mask: Any, is_causal: bool, keep: Any,
                   kv_cache: Any = None, need_weights: bool = False) -> Callable:
        mha = self._attn[name]

        def core(n):  # [B, L, D] -> [B, L, D]
            kv = n if memory is None else memory
            out, _ = mha.forward(n, kv, kv, mask=mask, is_causal=is_causal, dropout_mask=keep,
                                 kv_cache=kv_cache, need_weights=need_weights,
                                 average_attn_weights=False)
            return out, mha.cache

        return core

    def _attn_core_backward(self, name: str, grads: dict, dmemory: list) -> Callable:
        mha = self._attn[name]

        def core_backward(dc, core_cache):  # [B, L, D] -> [B, L, D]
            mha.cache = core_cache
            dq, dk, dv = mha.backward(dc)
            grads.update({f"{name}.{k}": v for k, v in mha.grads.items()})
            if name == "self_attn":
                return dq + dk + dv  # query = key = value = n
            dmemory.append(dk + dv)  # key = value = memory
            return dq

        return core_backward

    def _ff_core(self, p: float, keep: Any) -> Callable:
        P = self._own

        def core(n):  # [B, L, D] -> [B, L, D]
            return Ly.feed_forward_forward(n, P["linear1.weight"], P.get("linear1.bias"),
                                           P["linear2.weight"], P.get("linear2.bias"),
                                           activation=self.activation, dropout_p=p,
                                           dropout_mask=keep, rng=self._rng)

        return core

    def _ff_core_backward(self, grads: dict) -> Callable:
        def core_backward(dc, core_cache):  # [B, L, D] -> [B, L, D]
            dn, dw1, db1, dw2, db2 = Ly.feed_forward_backward(dc, core_cache)
            grads.update({"linear1.weight": dw1, "linear2.weight": dw2})
            if self.bias:
                grads.update({"linear1.bias": db1, "linear2.bias": db2})
            return dn

        return core_backward

    def _sublayer(self, x, core, norm: str, p: float, keep: Any):
        P = self._own
        return sublayer_forward(x, core, norm_weight=P[f"{norm}.weight"], norm_bias=P.get(f"{norm}.bias"),
                                eps=self.layer_norm_eps, norm_first=self.norm_first, dropout_p=p,
                                dropout_mask=keep, rng=self._rng)

    def _sublayer_backward(self, dout, cache, core_backward, norm: str, grads: dict):
        dx, dw, db = sublayer_backward(dout, cache, core_backward)
        grads[f"{norm}.weight"] = dw
        if self.bias:
            grads[f"{norm}.bias"] = db
        return dx

    def _run(self, fn, kv_cache=None):
        """Run a forward; on failure put back what it changed (``forward_state``) and the
        lengths of ``kv_cache`` (self-attention appended to it before the failure)."""
        saved = self.forward_state()
        lens = None if kv_cache is None else [int(n) for n in kv_cache.cache_seqlens]
        try:
            return fn()
        except BaseException:
            self.restore_forward_state(saved)
            if lens is not None:  # what lies past an entry's length is never read
                kv_cache.truncate(lens)
            raise

    def forward_state(self) -> BlockState:
        """What a forward of this block changes, as it is now: the block's cache, its
        attention modules' ``forward_state`` (their caches and whether they decoded) and its
        dropout generator's state.

        ``restore_forward_state`` puts it back. A model made of blocks reads it
        from each block before its forward, so that a forward failing in a later
        step (out of memory) leaves the blocks that ran as they were: a failed
        call changes nothing. (The KV caches a decoding forward appended to are
        the caller's to truncate.)
        """
        states = {a: m.forward_state() for a, m in self._attn.items()}
        return BlockState(self, self._cache, {a: st.cache for a, st in states.items()},
                          self._rng.bit_generator.state, states)

    def restore_forward_state(self, state: BlockState) -> None:
        """Put back a ``forward_state`` of this block; a ``TypeError`` for anything else."""
        if not isinstance(state, BlockState) or state.owner is not self:
            raise TypeError(f"state: expected a BlockState read from this block's forward_state(), "
                            f"got {'one of another block' if isinstance(state, BlockState) else V.type_name(state)}")
        self._rng.bit_generator.state = state.rng_state
        for a, m in self._attn.items():
            m.restore_forward_state(state.attn_states[a])
        self._cache = state.cache

    def backward_state(self) -> BlockGradState:
        """What a backward of this block changes, as it is now: its ``grads`` and its
        attention modules' ``grads``, ``dmask`` and ``cache`` (the backward hands each module
        the cache of this block's forward, and the modules' backwards run one after another).

        ``restore_backward_state`` puts it back. The block's backward does so
        when it fails (out of memory, say) after an attention module's backward
        has run, and a model made of blocks does so for the blocks whose
        backward ran before another's failed: a failed call changes nothing.
        """
        return BlockGradState(self, self.grads,
                              {a: (m.grads, m.dmask, m.cache) for a, m in self._attn.items()})

    def restore_backward_state(self, state: BlockGradState) -> None:
        """Put back a ``backward_state`` of this block; a ``TypeError`` for anything else."""
        if not isinstance(state, BlockGradState) or state.owner is not self:
            raise TypeError(f"state: expected a BlockGradState read from this block's backward_state(), "
                            f"got {'one of another block' if isinstance(state, BlockGradState) else V.type_name(state)}")
        for a, m in self._attn.items():
            grads, dmask, cache = state.attn[a]
            m.grads, m.dmask = grads, dmask
            if m.cache is not cache:  # the backward handed it this block's forward's
                m.cache = cache
        self.grads = state.grads

    @contextlib.contextmanager
    def _backward_put_back(self):
        """Run a backward's steps inside; on failure put back what they changed
        (``backward_state``), then let the error go on."""
        saved = self.backward_state()
        try:
            yield
        except BaseException:
            self.restore_backward_state(saved)
            raise

    def _check_dout(self, dout: Any) -> None:
        c = self._cache
        if c is None:
            raise RuntimeError("backward: expected a forward call first (there is no cached forward)")
        if getattr(c, "decoding", False):  # (only an encoder block decodes): whatever dout is
            raise RuntimeError("backward: the last forward used kv_cache, and decoding is forward only "
                               "(it keeps nothing to differentiate); run a forward without kv_cache "
                               "before backward")
        V.check_array("dout", dout, self.xp, device_of(self.params["linear1.weight"]))
        if V.shape_of(dout) != tuple(c.out_shape):
            raise ValueError(f"dout: expected shape {tuple(c.out_shape)} (that of the last forward's "
                             f"output), got {V.shape_of(dout)}")
        if dout.dtype != c.out_dtype:
            raise TypeError(f"dout: expected dtype {V.dtype_name(c.out_dtype)} (that of the last "
                            f"forward's output), got {V.dtype_name(dout.dtype)}")

    def _ordered(self, grads: dict) -> dict:
        return {k: grads[k] for k in self.params}

    # ----------------------------------------------------------- torch interop

    def torch_state_dict(self) -> Any:
        """``params`` as the torch layer's state dict: CPU tensors, copies, torch's key order."""
        import torch

        from .torch_interop import host_tensor

        dtype = getattr(torch, V.dtype_name(self.dtype))
        sd = OrderedDict()
        for a in self._ATTNS:
            for k, v in self._attn[a].torch_state_dict().items():
                sd[f"{a}.{k}"] = v
        for k, v in self._own.items():
            if isinstance(v, torch.Tensor):  # bfloat16 has no NumPy form: stay in torch
                sd[k] = v.detach().to(device="cpu", dtype=dtype, copy=True)
            else:
                sd[k] = torch.from_numpy(host_tensor(k, v)).to(dtype)  # (JAX's bfloat16 widened)
        return sd

    def load_torch_state_dict(self, state_dict: Any):
        """Set ``params`` from the torch layer's state dict (all keys and shapes checked first). Returns self."""
        from .torch_interop import (check_state_dict, host_tensor, params_from_torch_state_dict,
                                    torch_state_dict_shapes)

        expected = [f"{a}.{k}" for a in self._ATTNS for k in torch_state_dict_shapes(self._attn[a])]
        expected += list(self._own)
        check_state_dict(state_dict)
        got = set(state_dict.keys())
        missing = [k for k in expected if k not in got]
        unexpected = sorted(got - set(expected), key=str)  # key=str: a key may be no string
        if missing or unexpected:
            raise ValueError(f"state_dict: expected keys {expected}, got {sorted(got, key=str)} "
                             f"(missing {missing}, unexpected {unexpected})")
        new = {}
        for a in self._ATTNS:
            sub = {k.split(".", 1)[1]: v for k, v in state_dict.items() if k.startswith(a + ".")}
            # its errors name the key as given: state_dict['self_attn.in_proj_weight']
            full = {f"state_dict[{k!r}]": f"state_dict[{f'{a}.{k}'!r}]" for k in sub}
            with V.argument_names(full):
                for k, v in params_from_torch_state_dict(self._attn[a], sub).items():
                    new[f"{a}.{k}"] = v
        for k in self._own:
            new[k] = host_tensor(k, state_dict[k])
        arrays = {}
        for k, like in self.params.items():
            a = np.asarray(new[k])
            if a.shape != V.shape_of(like):
                raise ValueError(f"state_dict[{k!r}]: expected shape {V.shape_of(like)}, got {a.shape}")
            arrays[k] = self.xp.astype(from_numpy(a, self.xp, device_of(like)), self.dtype)
        self.params = arrays
        return self

    @classmethod
    def _copy_of_torch(cls, layer: Any, torch_cls: Any, backend: Any) -> Any:
        """``from_torch``'s block: the layer's layout and modes, checked before a block is made,
        then its weights."""
        config = cls._config_from_torch(layer, torch_cls)
        modes = cls._modes_from_torch(layer)
        block = cls(**config, backend=backend)
        # weights held otherwise (a parametrization, pruning) give other keys: named as the layer's
        with V.argument_names({"state_dict": "layer.state_dict()"}):
            block.load_torch_state_dict(layer.state_dict())
        block.modes = modes
        return block

    @classmethod
    def _modes_from_torch(cls, layer: Any) -> dict:
        """The modes of a checked torch layer as ``modes`` holds them: the layer's (which its
        dropout modules share) and each attention module's. A dropout module in another mode
        than its layer, with a drop probability above 0, is a ValueError: the block has one mode
        for its sites outside attention."""
        for site in cls._SITES:  # (a dropout module that drops nothing may be in either mode)
            module = getattr(layer, site)
            if site not in cls._ATTNS and module.p > 0 and module.training != layer.training:
                raise ValueError(f"layer: expected {site} in the layer's mode (training={layer.training}; "
                                 "a block has one mode for its dropout outside attention), got "
                                 f"{site}.training={module.training}")
        return {"training": bool(layer.training), **{a: bool(getattr(layer, a).training) for a in cls._ATTNS}}

    @classmethod
    def _config_from_torch(cls, layer: Any, torch_cls: Any) -> dict:
        if not isinstance(layer, torch_cls):
            raise TypeError(f"layer: expected a {torch_cls.__module__}.{torch_cls.__name__}, "
                            f"got {type(layer).__name__}")
        import torch

        from .torch_interop import check_torch_methods, module_dtype, options_from_torch

        # a subclass computing otherwise (its own _ff_block, say) would be copied into torch's computation
        check_torch_methods("layer", layer, torch_cls, cls._TORCH_METHODS,
                            why=" (npattn's blocks compute as torch's layer does)")

        # the modules the layer builds, which a user may have replaced (an nn.RMSNorm for norm1 has
        # a weight of the same shape, so the state dict matched and a layer norm ran in its place)
        kinds = {**{a: torch.nn.MultiheadAttention for a in cls._ATTNS},
                 "linear1": torch.nn.Linear, "linear2": torch.nn.Linear,
                 **{n: torch.nn.LayerNorm for n in cls._NORMS},
                 **{s: torch.nn.Dropout for s in cls._SITES if s not in cls._ATTNS}}
        for name, kind in kinds.items():
            m = getattr(layer, name, None)
            if not isinstance(m, kind):
                raise ValueError(f"layer: expected {name} a torch.nn.{kind.__name__} (as the torch "
                                 f"layer builds it), got {type(m).__name__}")
            # e.g. an nn.Linear subclass that adds a LoRA term
            check_torch_methods("layer", m, kind, part=f"{name} with ", why=" (as the torch layer builds it)")
        for a in cls._ATTNS:
            if not getattr(layer, a).batch_first:  # torch sets both from one argument
                where = "" if a == "self_attn" else f" in {a}"
                raise ValueError("layer: expected batch_first=True (npattn takes (B, L, D) inputs), "
                                 f"got batch_first=False{where}")
        # the attention modules' options as MultiHeadAttention.from_torch reads them (their dtype
        # is the layer's, below, so that a mixed one is named by its path in the layer)
        attn = {a: options_from_torch(getattr(layer, a)) for a in cls._ATTNS}
        for a, o in attn.items():  # what the torch layer never sets but its attention modules can
            # hold: add_zero_attn has no parameter, so no state dict check sees it
            extra = [f"{n}=True" for n in ("add_bias_kv", "add_zero_attn") if o[n]]
            extra += [f"{n}={o[n]}" for n in ("kdim", "vdim") if o[n] != o["d_model"]]
            if extra:
                raise ValueError(f"layer: expected {a} without add_bias_kv, add_zero_attn and with "
                                 f"kdim = vdim = embed_dim={o['d_model']} (npattn's blocks have "
                                 f"none of them), got {', '.join(extra)} in {a}")

        # the sub-modules' sizes and biases, read before the state dict is: a replaced module built
        # otherwise would fail there, in a message about keys or shapes of an argument never passed
        D, Fd = attn["self_attn"]["d_model"], layer.linear1.out_features
        width, inner = "self_attn's embed_dim", "linear1's out_features"
        sizes = [*((a, "embed_dim", o["d_model"], D, width) for a, o in attn.items() if a != "self_attn"),
                 ("linear1", "in_features", layer.linear1.in_features, D, width),
                 ("linear2", "in_features", layer.linear2.in_features, Fd, inner),
                 ("linear2", "out_features", layer.linear2.out_features, D, width),
                 *((n, "normalized_shape", tuple(getattr(layer, n).normalized_shape), (D,), width)
                   for n in cls._NORMS)]
        for name, what, got, want, whose in sizes:
            if got != want:
                raise ValueError(f"layer: expected {name} with {what} {want} ({whose}), got {got}")
        for n in cls._NORMS:
            if getattr(layer, n).weight is None:  # elementwise_affine=False
                raise ValueError(f"layer: expected {n} with a weight (elementwise_affine=True: npattn's "
                                 f"norms have one), got {n}.weight None")
        has_bias = {**{f"{a}.in_proj": o["qkv_bias"] for a, o in attn.items()},
                    **{f"{a}.out_proj": o["out_bias"] for a, o in attn.items()},
                    "linear1": layer.linear1.bias is not None, "linear2": layer.linear2.bias is not None,
                    **{n: getattr(layer, n).bias is not None for n in cls._NORMS}}
        if len(set(has_bias.values())) > 1:
            with_bias = [n for n, b in has_bias.items() if b]
            without = [n for n, b in has_bias.items() if not b]
            raise ValueError(f"layer: expected every projection, linear layer and norm with a bias or "
                             f"none with one (npattn's blocks have one setting, bias), got "
                             f"{', '.join(without)} without a bias and {', '.join(with_bias)} with one")

        act = layer.activation
        for kind in (torch.nn.ReLU, torch.nn.GELU):  # read by their class below, so their forward must be it
            if isinstance(act, kind):
                check_torch_methods("layer", act, kind, part="activation with ")
        gelu_form = None  # "none" or "tanh": F.gelu, nn.GELU or functools.partial(F.gelu, approximate=)
        if act is torch.nn.functional.gelu:
            gelu_form = "none"
        elif isinstance(act, torch.nn.GELU):
            gelu_form = act.approximate
        elif (isinstance(act, functools.partial) and act.func is torch.nn.functional.gelu and not act.args
              and set(act.keywords) <= {"approximate"}):
            gelu_form = act.keywords.get("approximate", "none")  # what GPT.to_torch builds
        # F.relu is a Python function around torch.relu: the same computation, not the same object
        if act is torch.nn.functional.relu or act is torch.relu or isinstance(act, torch.nn.ReLU):
            activation = "relu"
        elif gelu_form in ("none", "tanh"):
            activation = "gelu" if gelu_form == "none" else "gelu_tanh"
        else:
            raise ValueError("layer: expected activation 'relu', 'gelu', torch.nn.functional.relu, "
                             "torch.relu, a torch.nn.ReLU, torch.nn.functional.gelu, a torch.nn.GELU "
                             "(either approximate) or functools.partial(torch.nn.functional.gelu, "
                             f"approximate=...), got {act!r}")
        # npattn's block has one of each: a layer whose modules differ would copy into other numbers
        heads = {a: o["n_head"] for a, o in attn.items()}
        eps = {n: float(getattr(layer, n).eps) for n in cls._NORMS}
        drops = {}
        for site in cls._SITES:  # an attention module's drop probability is its float dropout
            if site in cls._ATTNS:
                drops[f"{site}.dropout"] = float(attn[site]["dropout"])
            else:
                drops[site] = float(getattr(layer, site).p)
        for what, values, config in (("num_heads", heads, "n_head"), ("eps", eps, "layer_norm_eps"),
                                     ("drop probability", drops, "dropout")):
            if len(set(values.values())) > 1:
                raise ValueError(f"layer: expected one {what} for {', '.join(values)} (npattn's blocks "
                                 f"have one {config}), got {', '.join(map(str, values.values()))}")
        return dict(
            d_model=attn["self_attn"]["d_model"], n_head=attn["self_attn"]["n_head"],
            d_ff=layer.linear1.out_features, dropout=drops["dropout"],
            activation=activation, norm_first=bool(layer.norm_first),
            layer_norm_eps=eps["norm1"], bias=layer.linear1.bias is not None,
            dtype=module_dtype(layer, "layer"),
        )

    # ------------------------------------------------------ copy, pickle, save

    def __getstate__(self) -> dict:
        """What ``pickle`` and ``copy.deepcopy`` keep: everything but the namespace and the cache.

        As ``MultiHeadAttention``'s: the backend travels by name and is
        resolved again; parameters, ``grads``, the mode, the configuration and
        the dropout generators' states are kept (the attention modules pickle
        themselves), so a copy draws the same next dropout masks as the
        original and then goes its own way. The last forward's cache (its
        activations) is dropped: ``backward`` on a copy needs a forward first.
        """
        return picklable_state(self)

    def __setstate__(self, state: dict) -> None:
        restore_state(self, state)

    def save(self, path: Any) -> None:
        """Write the block to ``path``, a portable ``.npz`` file (``MultiHeadAttention.save``'s layout).

        One array per parameter, named as ``params`` with the prefix
        ``param/`` (``param/self_attn.w_q``, ``param/linear1.weight``, ...;
        bfloat16 stored as float32, exactly), and an entry ``config`` holding
        one JSON string: ``format`` (the class's ``SAVE_FORMAT``),
        ``format_version`` (``SAVE_VERSION``), the constructor arguments
        (``config``, the keys ``CONFIG_KEYS``), the mode (``training``), the
        modes of the block and of its attention modules (``modes``: one set
        apart with ``block.self_attn.eval()`` stays apart) and the
        state of the block's dropout generator (``rng_state``). Every dropout
        site draws from that one generator (the attention modules get their
        keep-masks from it and never draw from their own), so it is the only
        one saved. Nothing is pickled. Written at ``path`` exactly, or into a
        binary file object; read it back with ``load``. Settings changed on
        the attention modules after construction (such as ``self_attn.impl``)
        are not the block's configuration and are not saved.
        """
        check_path(path)
        header = {
            "format": self.SAVE_FORMAT,
            "format_version": SAVE_VERSION,
            "config": self._config(),
            "training": self.training,
            "modes": self.modes,
            "rng_state": self._rng.bit_generator.state,
            "saved_from_backend": backend_name(self.xp),
        }
        write_save_file(path, header, self.params, xp=self.xp, dtype=self.dtype)

    @classmethod
    def load(cls, path: Any, *, backend: Any = "numpy") -> Any:
        """A block rebuilt from a file of ``save``, on ``backend`` (any backend, not only the saving one).

        Parameters bit for bit, the configuration, the modes (the block's and
        its attention modules'; a file without ``modes`` puts them all in the
        mode ``training``) and the dropout generator's state: the next forward
        in training mode draws the dropout masks the saved block would have drawn. Reads with
        ``np.load(..., allow_pickle=False)``. Raises ``ValueError`` naming
        what was expected and what the file holds when it is not such a file:
        another format (a ``MultiHeadAttention`` file, the other block's
        file), an unknown ``format_version``, configuration keys missing or
        unexpected, a configuration the constructor rejects (bfloat16 on a
        backend without it), a parameter missing, unexpected, of another shape
        or dtype, malformed ``modes`` or a malformed generator state. A ``path`` that names a
        directory is an ``IsADirectoryError``, a missing file a ``FileNotFoundError``.
        """
        block, header, label = model_from_save_file(cls, path, backend=backend, fmt=cls.SAVE_FORMAT,
                                                    version=SAVE_VERSION, config_keys=CONFIG_KEYS)
        modes = header.get("modes")
        if modes is not None:  # a file without them: every module in the mode ``training``
            try:
                block.modes = modes
            except (TypeError, ValueError) as exc:  # the setter's message names its argument, modes
                reason = str(exc).removeprefix("modes: ")
                raise ValueError(f"{label}: 'modes' in the header: {reason}") from exc
            if modes["training"] != header["training"]:
                raise ValueError(f"{label}: expected 'modes' in the header to hold the block's mode "
                                 f"'training' ({header['training']!r}), got {modes!r}")
        set_rng_state(f"{label}: rng_state", block._rng, header.get("rng_state"))
        return block

    def _config(self) -> dict:
        """The constructor arguments that rebuild this block's layout (not its parameters or backend)."""
        config = {k: getattr(self, k) for k in CONFIG_KEYS}
        config["dtype"] = V.dtype_name(self.dtype)
        return config

    def __repr__(self):
        return (f"{type(self).__name__}(d_model={self.d_model}, n_head={self.n_head}, d_ff={self.d_ff}, "
                f"dropout={self.dropout}, activation={self.activation!r}, norm_first={self.norm_first}, "
                f"layer_norm_eps={self.layer_norm_eps}, bias={self.bias}, dtype={V.dtype_name(self.dtype)!r}, "
                f"backend={backend_name(self.xp)!r})")


#: The arguments of the attention checks, as a block's callers name them: self-attention
#: reads x three times, cross-attention x and the encoder's memory.
_SELF_NAMES = {"query": "x", "key": "x", "value": "x"}
_CROSS_NAMES = {"query": "x", "key": "memory", "value": "memory", "mask": "memory_mask"}


class TransformerBlock(_Block):
    """The Transformer encoder layer, as ``torch.nn.TransformerEncoderLayer(batch_first=True)``.

    Post-norm (``norm_first=False``, the default, as torch)::

        x = norm1(x + dropout1(self_attn(x)))
        x = norm2(x + dropout2(ff(x)))

    pre-norm (``norm_first=True``)::

        x = x + dropout1(self_attn(norm1(x)))
        x = x + dropout2(ff(norm2(x)))

    with ``ff(x) = linear2(dropout(activation(linear1(x))))``. Each line is
    one ``sublayer_forward``; ``backward`` calls their backwards in reverse.

    Parameters
    ----------
    d_model, n_head : int
        Model width D and heads H (D divisible by H).
    d_ff : int, optional
        Feed-forward width F; default ``4 * d_model`` (torch's default is 2048).
    dropout : float
        Drop probability at every site (``ENCODER_DROPOUT_SITES``), in [0, 1).
    activation : {"relu", "gelu", "gelu_tanh"}
        "gelu" is the exact (erf) form, as torch's "gelu"; "gelu_tanh" the tanh
        approximation (GPT-2's; torch's ``nn.GELU(approximate="tanh")``).
    norm_first : bool
    layer_norm_eps : float
    bias : bool
        Biases in the attention, the linear layers and the layer norms (torch's ``bias``).
    dtype : str
        Parameter dtype: "float32" (default), "float64", "float16", or
        "bfloat16" on a backend that has it (torch, JAX). See Notes.
    backend : str or namespace
        "numpy", "cupy", "array_api_strict", "torch", "jax", "dask"
        (``backend.BACKENDS``), or an Array API namespace, as
        ``MultiHeadAttention``'s.
    seed : int or numpy.random.SeedSequence, optional
        Seeds the weights and the dropout generator: None (fresh entropy),
        an int >= 0 or a ``numpy.random.SeedSequence`` (spawned from as it
        stands, on a copy: the one given is not advanced), as every
        constructor's seed (``validation.check_seed``).

    Attributes
    ----------
    grads : dict
        Filled by ``backward``: same keys and shapes as ``params``.

    Notes
    -----
    *Dtypes.* Inputs, outputs, parameters and gradients are all in
    ``dtype``. With float16 or bfloat16 the parts that lose most in half
    precision run in float32 and round their result to ``dtype``: the
    attention scores,
    softmax, probability dropout and the probabilities' product with the
    values (``MultiHeadAttention``), layer norm (mean, variance,
    normalisation and its backward, weight and bias gradients summed in
    float32) and GELU, both forms, forward and backward (ReLU is exact in any
    dtype). The linear layers multiply in ``dtype`` (NumPy and torch on the
    CPU accumulate half-precision products in float32 and round once); the
    bias adds, the dropout after each core and the residual sums are in
    ``dtype``. ``tests/test_transformer_io.py`` bounds the result against
    float64: outputs within ``K u`` and gradients within ``2 K u`` in norm
    (``u = eps / 2``, K = 17 roundings in the encoder, 25 in the decoder).

    *Copies and files.* ``copy.deepcopy`` and ``pickle`` keep everything
    but the last forward's cache, the backend by name (``__getstate__``);
    ``save`` / ``load`` write and read a portable ``.npz`` file (format
    ``SAVE_FORMAT``), onto any backend.
    """

    _ATTNS = ("self_attn",)
    _NORMS = ("norm1", "norm2")
    _TORCH_METHODS = ("forward", "_sa_block", "_ff_block")  # a subclass must keep them to be copied
    _SITES = ENCODER_DROPOUT_SITES
    #: The ``format`` of this class's ``save`` files.
    SAVE_FORMAT = "npattn.TransformerBlock"

    def forward(self, x: Any, mask: Any = None, is_causal: bool = False,
                dropout_masks: Optional[dict] = None, kv_cache: Any = None, *,
                need_weights: bool = False) -> Any:
        """The block's output for ``x``.

        Parameters
        ----------
        x : array, shape (B, L, D)
        mask : array, optional
            Self-attention mask, npattn's convention: bool True = may attend,
            or floating (added to the scores); broadcastable to (B, H, L, L),
            e.g. (B, 1, 1, L) for padding.
        is_causal : bool
            Position i attends j <= i (ANDed with ``mask``).
        dropout_masks : dict, optional
            Keep-masks (bool, True = keep) by site, ``ENCODER_DROPOUT_SITES``:
            ``self_attn`` (B, H, L, L), ``dropout1`` (B, L, D), ``dropout``
            (B, L, F), ``dropout2`` (B, L, D), each broadcastable. Sites not
            given draw from the block's generator. Used only in training
            mode with ``dropout > 0``.
        kv_cache : KVCache, optional
            Incremental decoding, forward only: ``x`` holds the n new tokens
            of each entry; self-attention appends their keys and values to
            the cache and attends the cached ones followed by them,
            bottom-right aligned (``MultiHeadAttention.forward``'s
            ``kv_cache``), in eval mode (or without dropout). ``mask`` and
            ``dropout_masks`` must be None: the cache's own lengths say which
            keys each entry has, and ``need_weights`` False: a decoding forward keeps no cache to
            read the weights from. ``backward`` after such a forward is a
            ``RuntimeError``.
        need_weights : bool
            Keep the self-attention's weights (B, H, L, L) in its cache, read
            by ``attention.weights(block.self_attn.cache.sdpa)``: its
            ``impl="auto"`` then takes an implementation that forms them
            (the blocked one, which it takes for long sequences otherwise,
            does not); ``self_attn.impl = "blocked"`` is then a ``ValueError``.

        Returns
        -------
        out : array, shape (B, L, D)
        """
        with V.argument_names(_SELF_NAMES):
            check_forward_inputs(self.self_attn, x, x, x, mask=mask, dropout_mask=None,
                                 is_causal=is_causal, need_weights=need_weights,
                                 kv_cache=kv_cache)
        if kv_cache is not None and need_weights:  # decoding keeps no cache: they would be lost
            raise ValueError("need_weights: expected False with kv_cache (a decoding forward keeps "
                             "no cache to read the weights from, self_attn.cache is None after "
                             "it), got True")
        B, L, D = x.shape
        check_forward_impl(self.self_attn, self.self_attn.impl, (x, mask), lengths=(B, L, L),
                           need_weights=need_weights, kv_cache=kv_cache)
        if kv_cache is not None and self.training and self.dropout > 0.0:
            raise ValueError("kv_cache: decoding is forward only, without dropout; call eval() "
                             f"first (the block is in training mode with dropout {self.dropout})")
        if kv_cache is not None and dropout_masks is not None:  # as the module's dropout_mask
            raise ValueError(f"dropout_masks: expected None with kv_cache (decoding is forward only, "
                             f"without dropout), got {V.type_name(dropout_masks)}")
        shapes = {"self_attn": (B, self.n_head, L, L), "dropout1": (B, L, D),
                  "dropout": (B, L, self.d_ff), "dropout2": (B, L, D)}
        self._check_dropout_masks(dropout_masks, shapes)
        p, masks = self._masks(dropout_masks)

        def run():
            keep = self._attention_keep(masks, "self_attn", shapes["self_attn"], p)
            h, attn_c = self._sublayer(  # 1. x = norm1(x + dropout1(self_attn(x))), or pre-norm
                x, self._attn_core("self_attn", memory=None, mask=mask, is_causal=is_causal, keep=keep,
                                   kv_cache=kv_cache, need_weights=need_weights),
                "norm1", p, masks.get("dropout1"))  # [B, L, D]
            out, ff_c = self._sublayer(  # 2. x = norm2(x + dropout2(ff(x))), or pre-norm
                h, self._ff_core(p, masks.get("dropout")), "norm2", p, masks.get("dropout2"))  # [B, L, D]
            return out, EncoderBlockCache(attn_c, ff_c, tuple(out.shape), out.dtype, kv_cache is not None)

        out, cache = self._run(run, kv_cache)
        self._cache = cache
        return out

    def backward(self, dout: Any) -> Any:
        """Backpropagate ``dout`` (B, L, D) through the last forward; fills ``grads``, returns ``dx`` (B, L, D).

        Raises ``RuntimeError`` before any forward and ``ValueError`` /
        ``TypeError`` for a ``dout`` of another shape / dtype than the
        output's. Afterwards the attention modules' ``cache`` and ``grads`` are
        those of this block's last forward and backward.

        Parameters
        ----------
        dout : array, shape (B, L, D)
            Upstream gradient of the output, of its dtype, library and device.

        Returns
        -------
        dx : array, shape (B, L, D)

        Raises
        ------
        RuntimeError
            Before any forward, or after a forward with ``kv_cache``.
        ValueError, TypeError
            For a ``dout`` of another shape, dtype or library than the output's.
        """
        self._check_dout(dout)
        c = self._cache
        grads: dict = {}
        with self._backward_put_back():  # on failure the attention module's grads are put back
            # 2. x = sublayer(h; ff, norm2)
            dh = self._sublayer_backward(dout, c.ff, self._ff_core_backward(grads), "norm2", grads)
            # 1. h = sublayer(x; self_attn, norm1)
            dx = self._sublayer_backward(dh, c.attn, self._attn_core_backward("self_attn", grads, []),
                                         "norm1", grads)
            grads = self._ordered(grads)  # (in params' order; a failure here puts back too)
        self.grads = grads
        return dx

    @classmethod
    def from_torch(cls, layer: Any, *, backend: Any = "numpy") -> "TransformerBlock":
        """A copy of a ``torch.nn.TransformerEncoderLayer(batch_first=True)``: layout, weights, modes
        (the layer's and its attention module's; a dropout module in another mode than the layer, with
        ``p > 0``, is a ``ValueError``), on ``backend`` (the constructor's ``backend``).

        Parameters
        ----------
        layer : torch.nn.TransformerEncoderLayer
            With ``batch_first=True``.
        backend : str or namespace module
            npattn backend of the copy (default "numpy").

        Returns
        -------
        block : TransformerBlock
        """
        import torch

        return cls._copy_of_torch(layer, torch.nn.TransformerEncoderLayer, backend)


class TransformerDecoderBlock(_Block):
    """The Transformer decoder layer, as ``torch.nn.TransformerDecoderLayer(batch_first=True)``.

    Post-norm (``norm_first=False``)::

        x = norm1(x + dropout1(self_attn(x)))
        x = norm2(x + dropout2(multihead_attn(x, memory)))
        x = norm3(x + dropout3(ff(x)))

    pre-norm (``norm_first=True``) ``x = x + dropoutk(core(normk(x)))`` for each.
    Parameters as ``TransformerBlock``; ``params`` adds ``multihead_attn.*``
    and ``norm3.*``; the dropout sites are ``DECODER_DROPOUT_SITES``.

    Dtypes, copies and files as ``TransformerBlock``: with float16 or
    bfloat16 the attention scores and softmax (both attentions), layer norm
    and GELU compute in float32 and round to ``dtype``; everything returned
    is in ``dtype``. ``save`` writes the format ``SAVE_FORMAT``, which
    ``TransformerBlock.load`` refuses, and the other way round.
    """

    _ATTNS = ("self_attn", "multihead_attn")
    _NORMS = ("norm1", "norm2", "norm3")
    _TORCH_METHODS = ("forward", "_sa_block", "_mha_block", "_ff_block")
    _SITES = DECODER_DROPOUT_SITES
    #: The ``format`` of this class's ``save`` files.
    SAVE_FORMAT = "npattn.TransformerDecoderBlock"

    @property
    def multihead_attn(self) -> MultiHeadAttention:
        """The cross-attention module (its ``params`` are this block's ``multihead_attn.*``)."""
        return self._attn["multihead_attn"]

    def forward(self, x: Any, memory: Any, mask: Any = None, memory_mask: Any = None,
                is_causal: bool = False, dropout_masks: Optional[dict] = None) -> Any:
        """The block's output for target ``x`` attending to ``memory``.

        Parameters
        ----------
        x : array, shape (B, L, D)
        memory : array, shape (B, Lm, D)
            The encoder's output.
        mask : array, optional
            Self-attention mask (True = may attend, or floating), broadcastable to (B, H, L, L).
        memory_mask : array, optional
            Cross-attention mask, broadcastable to (B, H, L, Lm), e.g. (B, 1, 1, Lm) for padding.
        is_causal : bool
            Causal self-attention (ANDed with ``mask``).
        dropout_masks : dict, optional
            Keep-masks by site (``DECODER_DROPOUT_SITES``): ``self_attn`` (B, H, L, L),
            ``multihead_attn`` (B, H, L, Lm), ``dropout1``/``dropout2``/``dropout3``
            (B, L, D), ``dropout`` (B, L, F).

        Returns
        -------
        out : array, shape (B, L, D)
        """
        with V.argument_names(_SELF_NAMES):
            check_forward_inputs(self.self_attn, x, x, x, mask=mask, dropout_mask=None,
                                 is_causal=is_causal, need_weights=False)
        with V.argument_names(_CROSS_NAMES):
            check_forward_inputs(self.multihead_attn, x, memory, memory, mask=memory_mask,
                                 dropout_mask=None, is_causal=False, need_weights=False)
        B, L, D = x.shape
        Lm = memory.shape[1]
        check_forward_impl(self.self_attn, self.self_attn.impl, (x, mask), lengths=(B, L, L))
        check_forward_impl(self.multihead_attn, self.multihead_attn.impl, (x, memory, memory_mask),
                           lengths=(B, L, Lm))
        shapes = {"self_attn": (B, self.n_head, L, L), "multihead_attn": (B, self.n_head, L, Lm),
                  "dropout1": (B, L, D), "dropout2": (B, L, D), "dropout3": (B, L, D),
                  "dropout": (B, L, self.d_ff)}
        self._check_dropout_masks(dropout_masks, shapes)
        p, masks = self._masks(dropout_masks)

        def run():
            keep = self._attention_keep(masks, "self_attn", shapes["self_attn"], p)
            h1, sa_c = self._sublayer(  # 1. x = norm1(x + dropout1(self_attn(x)))
                x, self._attn_core("self_attn", memory=None, mask=mask, is_causal=is_causal, keep=keep),
                "norm1", p, masks.get("dropout1"))  # [B, L, D]
            keep = self._attention_keep(masks, "multihead_attn", shapes["multihead_attn"], p)
            h2, ca_c = self._sublayer(  # 2. x = norm2(x + dropout2(multihead_attn(x, memory)))
                h1, self._attn_core("multihead_attn", memory=memory, mask=memory_mask, is_causal=False,
                                    keep=keep),
                "norm2", p, masks.get("dropout2"))  # [B, L, D]
            out, ff_c = self._sublayer(  # 3. x = norm3(x + dropout3(ff(x)))
                h2, self._ff_core(p, masks.get("dropout")), "norm3", p, masks.get("dropout3"))  # [B, L, D]
            return out, DecoderBlockCache(sa_c, ca_c, ff_c, tuple(memory.shape), tuple(out.shape),
                                          out.dtype)

        out, cache = self._run(run)
        self._cache = cache
        return out

    def backward(self, dout: Any) -> tuple[Any, Any]:
        """Backpropagate ``dout`` (B, L, D); fills ``grads``, returns ``(dx, dmemory)``, (B, L, D) and (B, Lm, D).

        Errors and the attention modules' state as ``TransformerBlock.backward``.

        Parameters
        ----------
        dout : array, shape (B, L, D)
            Upstream gradient of the output, of its dtype, library and device.

        Returns
        -------
        dx : array, shape (B, L, D)
        dmemory : array, shape (B, Lm, D)

        Raises
        ------
        RuntimeError
            Before any forward.
        ValueError, TypeError
            For a ``dout`` of another shape, dtype or library than the output's.
        """
        self._check_dout(dout)
        c = self._cache
        grads: dict = {}
        dmemory: list = []
        with self._backward_put_back():  # on failure the attention modules' grads are put back
            # 3. x = sublayer(h2; ff, norm3)
            dh2 = self._sublayer_backward(dout, c.ff, self._ff_core_backward(grads), "norm3", grads)
            # 2. h2 = sublayer(h1; multihead_attn over memory, norm2); memory's gradient is collected
            dh1 = self._sublayer_backward(dh2, c.cross_attn,
                                          self._attn_core_backward("multihead_attn", grads, dmemory),
                                          "norm2", grads)
            # 1. h1 = sublayer(x; self_attn, norm1)
            dx = self._sublayer_backward(dh1, c.self_attn,
                                         self._attn_core_backward("self_attn", grads, []), "norm1", grads)
            grads = self._ordered(grads)  # (in params' order; a failure here puts back too)
        self.grads = grads
        return dx, dmemory[0]

    @classmethod
    def from_torch(cls, layer: Any, *, backend: Any = "numpy") -> "TransformerDecoderBlock":
        """A copy of a ``torch.nn.TransformerDecoderLayer(batch_first=True)``: layout, weights, modes
        (the layer's and its attention modules'; a dropout module in another mode than the layer, with
        ``p > 0``, is a ``ValueError``), on ``backend`` (the constructor's ``backend``).

        Parameters
        ----------
        layer : torch.nn.TransformerDecoderLayer
            With ``batch_first=True``.
        backend : str or namespace module
            npattn backend of the copy (default "numpy").

        Returns
        -------
        block : TransformerDecoderBlock
        """
        import torch

        return cls._copy_of_torch(layer, torch.nn.TransformerDecoderLayer, backend)

