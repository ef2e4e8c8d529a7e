"""A sequence classifier built of npattn's pairs: Transformer encoder blocks, mean pooling, a linear head.

``TransformerClassifier`` maps a sequence of feature vectors (the patches of an
image, say) to class logits::

    1. e      = x @ embed.weight.T + embed.bias    [B, L, D]   functional.linear
    2. h      = e + pos                            [B, L, D]   nn.add_positions (learned)
    3. h      = block_n(h),  n = 0 .. N-1          [B, L, D]   transformer.TransformerBlock
    4. h      = layer_norm(h)   (pre-norm only)    [B, L, D]   layers.layer_norm
    5. z      = mean_pool(h, mask)                 [B, D]      layers.mean_pool
    6. logits = z @ head.weight.T + head.bias      [B, C]      functional.linear

and ``backward`` walks the six steps in reverse. The blocks are npattn's
``TransformerBlock`` as they are; the classifier only composes them.
``npattn demo --task digits`` trains it on scikit-learn's handwritten digits
(``docs/digits.md``).

Shape legend
------------
B batch, L sequence length (tokens), P features per token, D = d_model,
H heads, C classes, N blocks.

Code uses only the Python Array API standard through ``xp``; NumPy draws the
initial parameters on the host, so one seed gives the same numbers on every
backend.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from . import attention as A
from . import functional as F
from . import layers as Ly
from . import nn
from . import validation as V
from .backend import backend_name, device_of, from_numpy, seed_sequence
from .stack import BlockStack, block_grads_put_back_on_failure, blocks_put_back_on_failure
from .transformer import TransformerBlock

__all__ = ["TransformerClassifier", "ClassifierCache"]


class ClassifierCache(NamedTuple):
    """What ``TransformerClassifier.backward`` needs from ``forward``, by the forward's step
    numbers (the blocks keep their own caches)."""
    embed: F.LinearCache  #: 1. e = x @ embed.weight.T + embed.bias
    pos: nn.PositionsCache  #: 2. h = e + pos
    norm: Optional[Ly.LayerNormCache]  #: 4. h = layer_norm(h); None post-norm
    pool: Ly.MeanPoolCache  #: 5. z = mean_pool(h, mask)
    head: F.LinearCache  #: 6. logits = z @ head.weight.T + head.bias
    batch: int  #: B, for dlogits' shape
    # the blocks (3.) keep their own caches, as TransformerBlock does


class TransformerClassifier(BlockStack):
    """Patch embedding, learned positions, ``n_layers`` Transformer encoder blocks, mean pooling, a linear head.

    Parameters
    ----------
    n_features : int
        P, the features of one token (4 for 2x2 pixel patches).
    seq_len : int
        L, tokens per sequence (the learned position table is (L, D)).
    n_classes : int
        C, the logits per sequence.
    d_model, n_head : int
        Width D and heads H of every block (D divisible by H).
    n_layers : int
        N, the number of blocks (``TransformerBlock``).
    d_ff : int, optional
        The blocks' feed-forward width; default ``4 * d_model``.
    dropout : float
        Drop probability at every site of every block (the blocks' own
        ``ENCODER_DROPOUT_SITES``), in [0, 1).
    activation : {"relu", "gelu", "gelu_tanh"}
        As ``TransformerBlock``'s (the values it takes).
    norm_first : bool
        Pre-norm blocks, then one more layer norm (``norm.*``) before the
        pooling, as ViT; post-norm blocks already end in one.
    layer_norm_eps : float
    dtype : str
    backend : str or namespace
    seed : int or numpy.random.SeedSequence, optional
        Seeds every parameter and the blocks' dropout generators:
        None (fresh entropy), an int >= 0 or a ``numpy.random.SeedSequence``
        (spawned from as it stands, on a copy: the one given is not advanced),
        as every constructor's seed (``validation.check_seed``).

    Attributes
    ----------
    params : dict
        A new dict of every parameter, in the order of the forward's steps
        (``BlockStack.params``): ``embed.weight`` (D, P), ``embed.bias`` (D,),
        ``pos`` (L, D), ``blocks.{n}.`` + the block's own names
        (``blocks.0.self_attn.w_q``, ``blocks.0.linear1.weight``, ...),
        ``norm.weight`` and ``norm.bias`` (D,) with ``norm_first``,
        ``head.weight`` (C, D), ``head.bias`` (C,). Assign a whole dict with the
        same keys to replace them (every array is checked first, so a failed
        assignment changes nothing).
    grads : dict
        Filled by ``backward``: the keys and shapes of ``params``.
    dx : array or None
        Filled by ``backward``: the gradient with respect to the input ``x``,
        (B, L, P).
    blocks : list of TransformerBlock
    """

    #: The own parameters ``params`` lists before the blocks' (``norm.*`` and ``head.*`` come
    #: after them).
    LEADING = ("embed.weight", "embed.bias", "pos")
    #: The ``format`` of ``save`` files (their ``format_version`` is ``SAVE_VERSION``, 1).
    SAVE_FORMAT = "npattn.classifier.TransformerClassifier"
    #: The constructor arguments a ``save`` file holds (with ``dtype``).
    CONFIG_KEYS = ("n_features", "seq_len", "n_classes", "d_model", "n_head", "n_layers", "d_ff",
                   "dropout", "activation", "norm_first", "layer_norm_eps")

    def __init__(self, n_features: int, seq_len: int, n_classes: int, d_model: int = 32,
                 n_head: int = 4, n_layers: int = 1, d_ff: Optional[int] = None, *,
                 dropout: float = 0.0, activation: str = "relu", norm_first: bool = False,
                 layer_norm_eps: float = 1e-5, dtype: str = "float32", backend: Any = "numpy",
                 seed: Any = None) -> None:
        # Python ints from here on (a NumPy int would wrap in the arithmetic on them)
        n_features = V.check_positive_int("n_features", n_features)
        seq_len = V.check_positive_int("seq_len", seq_len)
        n_classes = V.check_positive_int("n_classes", n_classes)
        n_layers = V.check_positive_int("n_layers", n_layers)
        V.check_seed("seed", seed)
        # the embedding, positions and head are drawn in float64: arrays that can exist (the
        # blocks check their own)
        D = V.check_positive_int("d_model", d_model)
        V.check_array_bytes(["d_model", "n_features"], (D, n_features), 8, "the weight embed.weight")
        V.check_array_bytes(["seq_len", "d_model"], (seq_len, D), 8, "the positions pos")
        V.check_array_bytes(["n_classes", "d_model"], (n_classes, D), 8, "the weight head.weight")
        own_seq, *block_seqs = seed_sequence(seed).spawn(n_layers + 1)
        # the blocks check d_model, n_head, d_ff, dropout, activation, norm_first, eps, dtype, backend
        self.blocks = [
            TransformerBlock(d_model, n_head, d_ff, dropout=dropout, activation=activation,
                             norm_first=norm_first, layer_norm_eps=layer_norm_eps, dtype=dtype,
                             backend=backend, seed=int(s.generate_state(1)[0]))
            for s in block_seqs
        ]
        first = self.blocks[0]
        self.xp, self.dtype = first.xp, first.dtype
        self.n_features, self.seq_len, self.n_classes = n_features, seq_len, n_classes
        self.d_model, self.n_head, self.n_layers = first.d_model, first.n_head, n_layers
        self.d_ff, self.dropout, self.activation = first.d_ff, first.dropout, first.activation
        self.norm_first, self.layer_norm_eps = first.norm_first, first.layer_norm_eps
        self.training = True
        self._own = self._init_own(np.random.default_rng(own_seq))
        self.grads: dict = {}
        self.dx: Any = None
        self._cache: Optional[ClassifierCache] = None

    def _init_own(self, rng: np.random.Generator) -> dict:
        """torch's ``nn.Linear`` init for the embedding and the head (the head's bias 0), positions N(0, 0.02^2).

        Drawn in float64 on the host, then cast.
        """
        P, L, C, D = self.n_features, self.seq_len, self.n_classes, self.d_model
        a_in, a_out = 1.0 / math.sqrt(P), 1.0 / math.sqrt(D)
        own = {
            "embed.weight": rng.uniform(-a_in, a_in, size=(D, P)),  # [D, P]
            "embed.bias": rng.uniform(-a_in, a_in, size=D),  # [D]
            "pos": rng.normal(0.0, 0.02, size=(L, D)),  # [L, D]
        }
        if self.norm_first:
            own["norm.weight"], own["norm.bias"] = np.ones(D), np.zeros(D)  # [D] each
        own["head.weight"] = rng.uniform(-a_out, a_out, size=(C, D))  # [C, D]
        own["head.bias"] = np.zeros(C)  # [C]
        return {k: self.xp.astype(from_numpy(v, self.xp), self.dtype) for k, v in own.items()}

    # ---------------------------------------------------------------- forward

    def _check_forward(self, x: Any, mask: Any, need_weights: Any, dropout_masks: Any) -> None:
        device = device_of(self._own["pos"])
        V.check_floating_array("x", x, self.xp, device, dtype=self.dtype)
        L, P = self.seq_len, self.n_features
        if x.ndim != 3 or V.shape_of(x)[1:] != (L, P) or x.shape[0] < 1:
            raise ValueError(f"x: expected shape (B, {L}, {P}) (batch, seq_len, n_features), "
                             f"got shape {V.shape_of(x)}")
        if mask is not None:
            V.check_array("mask", mask, self.xp, device)
            if mask.dtype != self.xp.bool:
                raise TypeError(f"mask: expected a bool padding mask (True = a token), got dtype "
                                f"{V.dtype_name(mask.dtype)}")
            if V.shape_of(mask) != V.shape_of(x)[:2]:
                raise ValueError(f"mask: expected shape {V.shape_of(x)[:2]} (B, L), got shape "
                                 f"{V.shape_of(mask)}")
        V.check_bool("need_weights", need_weights)
        # every block's attention takes the call (and forms its weights), before block 0 runs
        self.check_blocks_impl((x, mask), int(x.shape[0]), L, need_weights=need_weights)
        self.check_dropout_masks(dropout_masks, int(x.shape[0]), L)  # every block's, before block 0 runs

    def forward(self, x: Any, mask: Any = None, *, need_weights: bool = False,
                dropout_masks: Optional[Sequence[Optional[dict]]] = None) -> Any:
        """Class logits for ``x``; with ``need_weights`` also every block's attention weights per head.

        Parameters
        ----------
        x : array, shape (B, L, P), the model's dtype
        mask : bool array, shape (B, L), optional
            True = a token, False = padding: padding is neither attended to
            (the blocks get it as a (B, 1, 1, L) mask) nor averaged.
        need_weights : bool
            Also return the blocks' attention weights.
        dropout_masks : list of dict or None, optional
            One entry per block: that block's keep-masks by site
            (``TransformerBlock.forward``'s ``dropout_masks``: keys among
            ``ENCODER_DROPOUT_SITES``, bool masks broadcastable to the site's
            shape). Every block's are checked before any block runs.

        Returns
        -------
        logits : array, shape (B, C)
        weights : list of arrays, shape (B, H, L, L), one per block
            Only with ``need_weights``: each block's self-attention
            probabilities, before dropout, read from its attention module's
            cache (``attention.weights``).

        Raises ``TypeError`` / ``ValueError`` naming the argument before
        anything runs: a refused call changes nothing (the cached forward,
        the blocks' generators). Neither does a call that fails after the
        checks (out of memory): the blocks that ran are put back
        (``TransformerBlock.forward_state``), and ``backward`` differentiates
        the previous forward.
        """
        # [B, L, P], [B, L] -> [B, C]
        self._check_forward(x, mask, need_weights, dropout_masks)
        xp, P = self.xp, self._own
        attn_mask = None if mask is None else xp.expand_dims(xp.expand_dims(mask, axis=1), axis=1)  # [B, 1, 1, L]
        # the checks above leave nothing that fails here; should something (memory) fail,
        # the blocks that ran are put back (caches, generators): the previous forward stays
        # the one cached, and backward differentiates it
        with blocks_put_back_on_failure(self.blocks):
            e, embed_c = F.linear_forward(x, P["embed.weight"], P["embed.bias"])  # 1.  [B, L, D]
            h, pos_c = nn.add_positions_forward(e, P["pos"])  # 2.                      [B, L, D]
            weights = []
            for n, block in enumerate(self.blocks):
                keeps = None if dropout_masks is None else dropout_masks[n]
                h = block.forward(h, mask=attn_mask, dropout_masks=keeps,  # 3.          [B, L, D]
                                  need_weights=need_weights)  # (auto then keeps the weights)
                if need_weights:
                    w = A.weights(block.self_attn.cache.sdpa)  # [B, H, L, L]
                    weights.append(xp.astype(w, self.dtype))
            norm_c = None
            if self.norm_first:
                h, norm_c = Ly.layer_norm_forward(h, P["norm.weight"], P["norm.bias"],  # 4. [B, L, D]
                                                  self.layer_norm_eps)
            z, pool_c = Ly.mean_pool_forward(h, mask)  # 5.                              [B, D]
            logits, head_c = F.linear_forward(z, P["head.weight"], P["head.bias"])  # 6. [B, C]
        self._cache = ClassifierCache(embed_c, pos_c, norm_c, pool_c, head_c, int(x.shape[0]))
        return (logits, weights) if need_weights else logits

    # --------------------------------------------------------------- backward

    def backward(self, dlogits: Any) -> dict:
        """Backpropagate ``dlogits`` (B, C) through the last forward; returns (and keeps) ``grads``.

        Also sets ``dx``, the gradient with respect to the forward's ``x``
        (B, L, P). Raises ``RuntimeError`` before any forward, ``ValueError``
        / ``TypeError`` for a ``dlogits`` of another shape / dtype than the
        logits'.

        Parameters
        ----------
        dlogits : array, shape (B, C)
            Upstream gradient of the logits, of the model's dtype, library and device.

        Returns
        -------
        grads : dict
            ``grads``: the keys and shapes of ``params``, in its order.

        Raises
        ------
        RuntimeError
            Before any forward.
        ValueError, TypeError
            For a ``dlogits`` of another shape, dtype or library than the logits'.
        """
        # [B, C] -> {name: [shape of the parameter]}
        c = self._cache
        if c is None:
            raise RuntimeError("backward: expected a forward call first (there is no cached forward)")
        V.check_grad("dlogits", dlogits, shape=(c.batch, self.n_classes), dtype=self.dtype,
                     xp=self.xp, device=device_of(self._own["pos"]), of="the last forward's logits")
        grads: dict = {}
        # 6. logits = z @ head.weight.T + head.bias
        dz, grads["head.weight"], grads["head.bias"] = F.linear_backward(dlogits, c.head)  # [B, D]
        # 5. z = mean_pool(h, mask)
        dh = Ly.mean_pool_backward(dz, c.pool)  # [B, L, D]
        # 4. h = layer_norm(h)
        if c.norm is not None:
            dh, grads["norm.weight"], grads["norm.bias"] = Ly.layer_norm_backward(dh, c.norm)
        # a failure from here on (memory) puts back the grads of the blocks whose backward ran
        with block_grads_put_back_on_failure(self.blocks):
            # 3. h = block_n(h), last block first
            for n in reversed(range(self.n_layers)):
                block = self.blocks[n]
                dh = block.backward(dh)  # [B, L, D]
                grads.update({f"blocks.{n}.{k}": g for k, g in block.grads.items()})
            # 2. h = e + pos
            de, grads["pos"] = nn.add_positions_backward(dh, c.pos)  # [B, L, D], [L, D]
            # 1. e = x @ embed.weight.T + embed.bias
            dx, grads["embed.weight"], grads["embed.bias"] = F.linear_backward(de, c.embed)  # [B, L, P]
            grads = {k: grads[k] for k in self.params}  # (in params' order; a failure here puts back too)
        self.grads = grads
        self.dx = dx
        return self.grads

    def __repr__(self):
        return (f"{type(self).__name__}(n_features={self.n_features}, seq_len={self.seq_len}, "
                f"n_classes={self.n_classes}, d_model={self.d_model}, n_head={self.n_head}, "
                f"n_layers={self.n_layers}, d_ff={self.d_ff}, dropout={self.dropout}, "
                f"activation={self.activation!r}, norm_first={self.norm_first}, "
                f"dtype={V.dtype_name(self.dtype)!r}, backend={backend_name(self.xp)!r})")
