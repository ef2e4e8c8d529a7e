"""A GPT (decoder-only Transformer) built from npattn's pairs, with a hand-derived backward.

GPT-2's layout (Radford et al., 2019) at any size; every step is a
forward/backward pair of npattn::

    1. e      = embedding(ids, wte)              [B, L, D]   nn.embedding_forward
    2. x      = e + wpe[s : s + L]               [B, L, D]   nn.add_positions_forward (learned)
    3. x      = block_n(x, is_causal=True)       [B, L, D]   transformer.TransformerBlock, n = 0 .. N-1
                pre-norm: x + attn(ln1(x)), then x + ff(ln2(x)), GELU (tanh form)
    4. h      = layer_norm(x; ln_f)              [B, L, D]   layers.layer_norm_forward
    5. logits = h @ wte.T                        [B, L, V]   functional.linear_forward (tied head)
    6. loss   = cross_entropy(logits, targets)   []          nn.cross_entropy_forward

The head is *tied*: the output projection is the token table ``wte`` itself,
so its gradient is the sum of two terms, one from step 5 (``dlogits^T h``)
and one from step 1 (``one_hot(ids)^T de``). ``s`` is the position of the
first token: 0 for a whole sequence, the cached length while decoding.

``generate`` decodes with one ``npattn.KVCache`` per block: the prompt runs
once, then each new token attends the cached keys and values only; the
logits equal a full forward over the same tokens (tests: 1e-10 in float64).
Sampling (greedy, temperature, top-k) is done on the host from a seeded
``numpy.random.Generator``, so one seed gives the same tokens on every backend
(up to a logit difference at a sampling boundary).

``training_step`` is one step of the whole loop: forward, loss, backward,
gradient clipping by the global norm (``nn.clip_grad_norm``), Adam
(``nn.adam_step``).

Shape legend
------------
B batch, L sequence length, V vocabulary size, D = d_model, H heads,
F = d_ff, N layers, T = block_size (the longest sequence).

Code uses only the Python Array API standard through ``xp``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from . import functional as F
from . import layers as Ly
from . import nn
from . import validation as V
from .backend import (backend_name, device_of, dropout_key, from_numpy, keep_mask, make_rng,
                      persisted, resolve_backend, seed_sequence, to_numpy, widest_int)
from .kvcache import KVCache, persist_with
from .module import check_kv_cache
from .stack import BlockStack, block_grads_put_back_on_failure, blocks_put_back_on_failure
from .transformer import TransformerBlock

__all__ = ["GPT", "GPTCache", "training_step", "sample_next", "check_sampling", "check_training_options", "SAVE_FORMAT", "SAVE_VERSION",
           "CONFIG_KEYS"]

#: The ``format`` of a ``GPT.save`` file and its version.
SAVE_FORMAT = "npattn.gpt.GPT"
SAVE_VERSION = 1
#: The constructor arguments a save file holds (with ``dtype``).
CONFIG_KEYS = ("vocab_size", "block_size", "d_model", "n_layer", "n_head", "d_ff", "dropout",
               "layer_norm_eps", "bias")


class GPTCache(NamedTuple):
    """What ``GPT.backward`` needs from ``forward``, by the forward's step numbers (the
    blocks keep their own caches)."""
    embed: nn.EmbeddingCache  #: 1. e = embedding(ids, wte)
    pos: nn.PositionsCache  #: 2. x = e + wpe[s : s + L]
    start: int  #: 2. s, the position of the first token
    ln_f: Ly.LayerNormCache  #: 4. h = layer_norm(x; ln_f)
    head: F.LinearCache  #: 5. logits = h @ wte.T
    decoding: bool  #: the forward appended to KV caches: nothing to differentiate


class GPT(BlockStack):
    """A GPT-2-style language model with hand-derived gradients.

    Parameters
    ----------
    vocab_size : int
        V, the number of token ids.
    block_size : int
        T, the longest sequence (rows of the learned position table).
    d_model, n_layer, n_head : int
        Width D, number of blocks N, heads H (D divisible by H).
    d_ff : int, optional
        Feed-forward width F; default ``4 * d_model``.
    dropout : float
        Drop probability at every site of every block (``ENCODER_DROPOUT_SITES``:
        attention probabilities, after attention, inside and after the
        feed-forward), in training mode. There is no dropout on the embeddings.
    layer_norm_eps : float
    bias : bool
        Biases in the attention, feed-forward and layer norms.
    dtype : str or dtype
        "float32" (default) or "float64", as a name or a dtype of any library.
    backend : str or namespace
    seed : int or numpy.random.SeedSequence, optional
        Seeds the weights and the dropout generator: None (fresh entropy),
        an int >= 0 or a ``numpy.random.SeedSequence`` (spawned from as it
        stands, on a copy: the one given is not advanced), as every
        constructor's seed (``validation.check_seed``).

    Attributes
    ----------
    blocks : list of TransformerBlock
        ``norm_first=True``, ``activation="gelu_tanh"``; run causal.
    params : dict
        A new dict of every parameter (``BlockStack.params``): ``wte`` (V, D),
        ``wpe`` (T, D), ``blocks.{n}.{name}`` (the block's names:
        ``self_attn.w_q`` ..., ``linear1.weight`` ..., ``norm1.weight`` ...),
        ``ln_f.weight`` (D,), ``ln_f.bias`` (D,). Assign a whole dict to
        replace them (every array checked first).
    grads : dict
        Filled by ``backward``: same keys and shapes as ``params``.
    """

    #: The own parameters ``params`` lists before the blocks' (``ln_f.*`` comes after them).
    LEADING = ("wte", "wpe")
    #: The ``format`` of ``save`` files, ``npattn.gpt.SAVE_FORMAT``.
    SAVE_FORMAT = SAVE_FORMAT
    #: Their ``format_version``, ``npattn.gpt.SAVE_VERSION``.
    SAVE_VERSION = SAVE_VERSION
    #: The constructor arguments a ``save`` file holds (with ``dtype``), ``npattn.gpt.CONFIG_KEYS``.
    CONFIG_KEYS = CONFIG_KEYS

    def __init__(self, vocab_size: int, block_size: int, d_model: int, n_layer: int, n_head: int,
                 d_ff: Optional[int] = None, *, dropout: float = 0.0, layer_norm_eps: float = 1e-5,
                 bias: bool = True, dtype: str = "float32", backend: Any = "numpy",
                 seed: Any = None) -> None:
        vocab_size = V.check_size("vocab_size", vocab_size, minimum=1)
        block_size = V.check_size("block_size", block_size, minimum=1)
        n_layer = V.check_size("n_layer", n_layer, minimum=1)
        # a name or a dtype of any library, as MultiHeadAttention's; of those, single or double
        xp = resolve_backend(backend)
        try:
            dtype = V.float_dtype_name(xp, dtype)
        except (TypeError, ValueError):  # not a float dtype of xp: told with the GPT's two
            V.float_dtype_name(xp, dtype, choices=("float32", "float64"))
            raise
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype: expected 'float32' or 'float64' (the GPT's Adam and sampling are "
                             f"written for them; the blocks alone take half precision), got {dtype!r}")
        V.check_seed("seed", seed)
        # wte (V, D) and wpe (block_size, D) are drawn in float64: arrays that can exist (the
        # blocks check their own)
        d_model = V.check_positive_int("d_model", d_model)
        V.check_array_bytes(["vocab_size", "d_model"], (vocab_size, d_model), 8, "the embedding wte")
        V.check_array_bytes(["block_size", "d_model"], (block_size, d_model), 8, "the positions wpe")
        seqs = seed_sequence(seed).spawn(n_layer + 2)
        # the blocks check d_model, n_head, d_ff, dropout, layer_norm_eps, bias, dtype and backend
        self.blocks = [
            TransformerBlock(d_model, n_head, d_ff, dropout=dropout, activation="gelu_tanh",
                             norm_first=True, layer_norm_eps=layer_norm_eps, bias=bias, dtype=dtype,
                             backend=backend, seed=int(s.generate_state(1)[0]))
            for s in seqs[:n_layer]
        ]
        b0 = self.blocks[0]
        self.xp, self.dtype = b0.xp, b0.dtype
        self.vocab_size, self.block_size = vocab_size, block_size
        self.d_model, self.n_layer, self.n_head = b0.d_model, n_layer, b0.n_head
        self.d_ff, self.dropout, self.bias = b0.d_ff, b0.dropout, b0.bias
        self.layer_norm_eps = b0.layer_norm_eps
        rng = np.random.default_rng(seqs[-2])
        own = {"wte": rng.normal(0.0, 0.02, size=(self.vocab_size, self.d_model)),  # GPT-2's init
               "wpe": rng.normal(0.0, 0.02, size=(self.block_size, self.d_model)),
               "ln_f.weight": np.ones(self.d_model)}
        if self.bias:
            own["ln_f.bias"] = np.zeros(self.d_model)
        self._own = {k: self.xp.astype(from_numpy(v, self.xp), self.dtype) for k, v in own.items()}
        self._rng = np.random.default_rng(seqs[-1])  # the dropout masks of every block
        self.training = True
        self.grads: dict = {}
        self._cache: Any = None

    def __repr__(self):
        return (f"GPT(vocab_size={self.vocab_size}, block_size={self.block_size}, "
                f"d_model={self.d_model}, n_layer={self.n_layer}, n_head={self.n_head}, "
                f"d_ff={self.d_ff}, dropout={self.dropout}, dtype={V.dtype_name(self.dtype)!r}, "
                f"backend={backend_name(self.xp)!r})")

    # ---------------------------------------------------------------- checks

    def _device(self) -> Any:
        return device_of(self._own["wte"])

    def _check_ids(self, name: str, ids: Any, start: int) -> None:
        V.check_ids(name, ids, self.vocab_size, self.xp, self._device(), what="token ids")
        if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise ValueError(f"{name}: expected shape (B, L) with B >= 1 and L >= 1, got {V.shape_of(ids)}")
        if start + ids.shape[1] > self.block_size:
            raise ValueError(f"{name}: expected at most {self.block_size - start} positions (block_size "
                             f"{self.block_size}, {start} already cached), got {ids.shape[1]}")

    def _block_masks(self, dropout_masks: Any, B: int, L: int) -> list:
        """Every block's keep-masks: the ones given, the others drawn from the model's generator."""
        if not (self.training and self.dropout > 0.0):
            return [None] * self.n_layer
        given = list(dropout_masks or [None] * self.n_layer)
        out = []
        for n in range(self.n_layer):
            masks = dict(given[n] or {})
            for site, shape in self.site_shapes(B, L).items():
                if masks.get(site) is None:
                    masks[site] = keep_mask(dropout_key(self._rng), self.dropout, shape, self.xp,
                                            self._device())
            out.append(masks)
        return out

    # ---------------------------------------------------------------- forward

    def forward(self, ids: Any, *, dropout_masks: Optional[Sequence] = None,
                kv_caches: Optional[Sequence[KVCache]] = None) -> Any:
        """Logits (B, L, V) of the next token at every position of ``ids`` (B, L).

        Parameters
        ----------
        ids : integer array, shape (B, L), values in [0, V)
        dropout_masks : list of N dicts, optional
            Keep-masks by site for each block (``TransformerBlock.forward``'s
            ``dropout_masks``); sites not given draw from the model's
            generator. Used only in training mode with ``dropout > 0``; None
            with ``kv_caches``.
        kv_caches : list of N KVCache, optional
            Decoding, forward only: ``ids`` are the next L tokens after the
            ``cache_seqlens`` cached ones (equal for every entry); their
            positions start there, each block appends its keys and values to
            its cache. ``backward`` after it is a ``RuntimeError``.

        Returns
        -------
        logits : array, shape (B, L, V), the model's dtype
        """
        start = 0 if kv_caches is None else self._check_kv_caches(kv_caches)
        self._check_ids("ids", ids, start)
        B, L = ids.shape
        if kv_caches is not None and self.training and self.dropout > 0.0:
            raise ValueError("kv_caches: decoding is forward only, without dropout; call eval() "
                             f"first (the model is in training mode with dropout {self.dropout})")
        if kv_caches is not None and dropout_masks is not None:  # as the blocks' dropout_masks
            raise ValueError(f"dropout_masks: expected None with kv_caches (decoding is forward only, "
                             f"without dropout), got {V.type_name(dropout_masks)}")
        self.check_dropout_masks(dropout_masks, B, L)
        if kv_caches is not None:
            for n, (block, cache) in enumerate(zip(self.blocks, kv_caches)):
                # every block's cache, before any is written: module.check_kv_cache (its
                # library, device, dtype, heads, batch size and room), naming kv_caches[n]
                with V.argument_names({"kv_cache": f"kv_caches[{n}]"}):
                    check_kv_cache(block.self_attn, cache, batch_size=B, n_new=L)
        self.check_blocks_impl((ids,), B, L, kv_caches=kv_caches)
        P = self._own
        state = self._rng.bit_generator.state
        lens = None if kv_caches is None else [[int(n) for n in c.cache_seqlens] for c in kv_caches]
        with blocks_put_back_on_failure(self.blocks):
            try:
                block_masks = self._block_masks(dropout_masks, B, L)
                e, e_c = nn.embedding_forward(ids, P["wte"])  # 1.                       [B, L, D]
                x, p_c = nn.add_positions_forward(e, P["wpe"][start:start + L, :])  # 2.  [B, L, D]
                for n, block in enumerate(self.blocks):  # 3.                            [B, L, D]
                    x = block.forward(x, is_causal=True, dropout_masks=block_masks[n],
                                      kv_cache=None if kv_caches is None else kv_caches[n])
                h, ln_c = Ly.layer_norm_forward(x, P["ln_f.weight"], P.get("ln_f.bias"),
                                                self.layer_norm_eps)  # 4.               [B, L, D]
                logits, head_c = F.linear_forward(h, P["wte"])  # 5.                     [B, L, V]
            except BaseException:
                # the checks above leave nothing that fails here; should something (memory) fail,
                # the generator, the blocks that ran (blocks_put_back_on_failure) and the KV
                # caches' lengths are put back: the previous forward stays the one cached, and
                # backward differentiates it
                self._rng.bit_generator.state = state
                for cache, held in zip(kv_caches or [], lens or []):  # (the blocks that ran appended)
                    cache.truncate(held)
                raise
        self._cache = GPTCache(e_c, p_c, start, ln_c, head_c, kv_caches is not None)
        return logits

    def _check_kv_caches(self, kv_caches: Any) -> int:
        if not isinstance(kv_caches, (list, tuple)) or not all(isinstance(c, KVCache) for c in kv_caches):
            raise TypeError(f"kv_caches: expected a list of {self.n_layer} npattn.KVCache (one per "
                            f"block, e.g. from new_caches), got {V.type_name(kv_caches)}")
        distinct = len({id(c) for c in kv_caches})
        if len(kv_caches) != self.n_layer or distinct != self.n_layer:
            shared = " (a list like [cache] * n_layer shares one cache)" if distinct < len(kv_caches) else ""
            raise ValueError(f"kv_caches: expected {self.n_layer} distinct KVCache objects, one per block "
                             f"(new_caches), got {len(kv_caches)} with {distinct} distinct{shared}")
        # the lengths alone: caches of another batch size are module.check_kv_cache's to name
        lens = [[int(n) for n in c.cache_seqlens] for c in kv_caches]
        if len({n for held in lens for n in held}) != 1:
            raise ValueError("kv_caches: expected the same cached length for every entry and block "
                             f"(positions are shared), got cache_seqlens {lens}")
        return lens[0][0]

    def new_caches(self, batch_size: int, capacity: Optional[int] = None) -> list:
        """One empty ``KVCache`` per block for ``batch_size`` sequences of up to ``capacity`` (T) tokens.

        Parameters
        ----------
        batch_size : int
            B, the sequences decoded together.
        capacity : int, optional
            The most tokens of each sequence, at most ``block_size``; default ``block_size``.

        Returns
        -------
        caches : list of N KVCache
            Keys and values (B, H, capacity, D / H) each, of the model's dtype, backend and
            device; pass them to ``forward(..., kv_caches=)``.
        """
        capacity = self.block_size if capacity is None else capacity
        capacity = V.check_size("capacity", capacity, minimum=1)
        if capacity > self.block_size:
            raise ValueError(f"capacity: expected at most block_size = {self.block_size}, got {capacity}")
        Dh = self.d_model // self.n_head
        return [KVCache(batch_size, capacity, self.n_head, Dh, dtype=V.dtype_name(self.dtype),
                        backend=self.xp, device=self._device()) for _ in self.blocks]

    # --------------------------------------------------------------- backward

    def backward(self, dlogits: Any) -> dict:
        """Backpropagate ``dlogits`` (B, L, V) through the last forward; fills and returns ``grads``.

        ``RuntimeError`` before any forward or after a decoding forward;
        ``ValueError`` / ``TypeError`` for ``dlogits`` of another shape / dtype
        than the logits'.

        Parameters
        ----------
        dlogits : array, shape (B, L, V)
            Upstream gradient of the logits, of the model's dtype, library and device.

        Returns
        -------
        grads : dict
            ``grads``: the keys and shapes of ``params``, in its order. ``wte`` (V, D) sums
            the embedding's and the tied head's terms; ``wpe`` (T, D) is zero on the rows
            the forward did not read.

        Raises
        ------
        RuntimeError
            Before any forward, or after a forward with ``kv_caches``.
        ValueError, TypeError
            For ``dlogits`` of another shape, dtype or library than the logits'.
        """
        c = self._cache
        if c is None:
            raise RuntimeError("backward: expected a forward call first (there is no cached forward)")
        if c.decoding:
            raise RuntimeError("backward: the last forward used kv_caches, and decoding is forward only; "
                               "run a forward without kv_caches before backward")
        V.check_array("dlogits", dlogits, self.xp, self._device())
        B, L = c.embed.onehot.shape[:2]
        if V.shape_of(dlogits) != (B, L, self.vocab_size):
            raise ValueError(f"dlogits: expected shape {(B, L, self.vocab_size)} (that of the last "
                             f"forward's logits), got {V.shape_of(dlogits)}")
        if dlogits.dtype != self.dtype:
            raise TypeError(f"dlogits: expected dtype {V.dtype_name(self.dtype)}, got "
                            f"{V.dtype_name(dlogits.dtype)}")
        xp = self.xp
        grads: dict = {}
        # 5. logits = h @ wte.T
        dh, dwte_head, _ = F.linear_backward(dlogits, c.head)  # [B, L, D], [V, D]
        # 4. h = layer_norm(x; ln_f)
        dx, grads["ln_f.weight"], db = Ly.layer_norm_backward(dh, c.ln_f)  # [B, L, D]
        if self.bias:
            grads["ln_f.bias"] = db
        # a failure from here on (memory) puts back the grads of the blocks whose backward ran
        with block_grads_put_back_on_failure(self.blocks):
            # 3. x = block_n(x), in reverse
            for n in reversed(range(self.n_layer)):
                dx = self.blocks[n].backward(dx)  # [B, L, D]
                grads.update({f"blocks.{n}.{k}": g for k, g in self.blocks[n].grads.items()})
            # 2. x = e + wpe[s:s+L]: the rows that were read get the gradient, the others zero
            de, dpos = nn.add_positions_backward(dx, c.pos)  # [B, L, D], [L, D]
            T, D = self.block_size, self.d_model
            dev = self._device()
            rows = [xp.zeros((c.start, D), dtype=self.dtype, device=dev), dpos,
                    xp.zeros((T - c.start - L, D), dtype=self.dtype, device=dev)]
            grads["wpe"] = xp.concat(rows, axis=0)  # [T, D]
            # 1. e = embedding(ids, wte); the tied head's term adds
            _, dwte_embed = nn.embedding_backward(de, c.embed)  # [V, D]
            grads["wte"] = dwte_embed + dwte_head
            grads = {k: grads[k] for k in self.params}  # (in params' order; a failure here puts back too)
        self.grads = grads
        return self.grads

    def loss(self, ids: Any, targets: Any, *, weight: Any = None, ignore_index: Optional[int] = None,
             label_smoothing: float = 0.0, reduction: str = "mean", **kwargs) -> tuple[float, Any]:
        """Forward and cross-entropy against ``targets`` (B, L): ``(loss, dlogits)`` for ``backward``.

        The loss is ``nn.cross_entropy_forward``'s, with its arguments and torch's
        ``cross_entropy``'s. ``weight`` (V,): the classes' weights, of the model's library,
        device and dtype; the mean then divides by the weights of the targets that count.
        ``ignore_index``: positions whose target equals it (padding) are left out of the mean
        and get zero ``dlogits`` (torch's default there is -100; here None, every target
        counts). ``label_smoothing``: the targets' one-hot rows mixed with the uniform
        distribution. ``reduction``: "mean" (default) or "sum" over the positions; ``loss``
        is one number and ``dlogits`` its gradient, so the per-position losses of "none" are
        ``nn.cross_entropy_forward``'s alone. ``kwargs`` go to ``forward``
        (``dropout_masks``, ``kv_caches``). Every argument is checked before the forward but
        one: weights of the counted targets that sum to 0 (the mean divides by them) are
        found by the cross-entropy. A call that fails after the forward (that, or memory)
        puts back the model's cached forward, its generators and the KV caches' lengths: a
        failed call changes nothing.

        Parameters
        ----------
        ids : integer array, shape (B, L), values in [0, V)
        targets : integer array, shape (B, L)
            The next token at each position, in [0, V) (or ``ignore_index``).
        weight : array, shape (V,), optional
        ignore_index : int, optional
        label_smoothing : float
            In [0, 1]; default 0.
        reduction : {"mean", "sum"}
        **kwargs
            ``forward``'s ``dropout_masks`` and ``kv_caches``.

        Returns
        -------
        loss : float
        dlogits : array, shape (B, L, V)
            The gradient of ``loss`` with respect to the logits, of the model's dtype.
        """
        loss, dlogits = self._loss(ids, targets, weight=weight, ignore_index=ignore_index,
                                   label_smoothing=label_smoothing, reduction=reduction, **kwargs)
        return float(loss), dlogits

    def _loss(self, ids: Any, targets: Any, *, weight: Any, ignore_index: Optional[int],
              label_smoothing: float, reduction: str, **kwargs) -> tuple[Any, Any]:
        """``loss``'s work, its loss left an array (0-d): on dask, still to be computed, so
        that ``training_step`` computes it in one graph with the gradients (read on its own
        it runs the forward, and the gradients' graph would run it again)."""
        self._check_ids("ids", ids, 0)
        # before the forward: a failed call changes nothing
        V.check_choice("reduction", reduction, ("mean", "sum"))
        self._check_targets(targets, V.shape_of(ids), ignore_index, count=reduction == "mean")
        if weight is not None:
            nn.check_class_weight(weight, self.vocab_size, self.xp, self._device(), self.dtype)
        nn.check_label_smoothing(label_smoothing)
        # what the forward changes, put back should the loss after it fail (memory): the
        # model's cached forward and generator, the blocks (blocks_put_back_on_failure) and
        # the KV caches' lengths
        cached, rng_state = self._cache, self._rng.bit_generator.state
        with blocks_put_back_on_failure(self.blocks):
            logits = self.forward(ids, **kwargs)
            try:
                loss, ce_c = nn.cross_entropy_forward(logits, targets, weight=weight,  # 6.
                                                      ignore_index=ignore_index,
                                                      label_smoothing=label_smoothing, reduction=reduction)
                dlogits, _ = nn.cross_entropy_backward(1.0, ce_c)
            except BaseException:
                self._cache = cached
                self._rng.bit_generator.state = rng_state
                for cache in kwargs.get("kv_caches") or []:  # the forward appended L positions
                    cache.truncate([int(n) - ids.shape[1] for n in cache.cache_seqlens])
                raise
        return loss, dlogits

    def _check_targets(self, targets: Any, shape: tuple, ignore_index: Any = None, *,
                       count: bool = True) -> None:
        ignore = nn.check_ignore_index(ignore_index)
        V.check_ids("targets", targets, self.vocab_size, self.xp, self._device(), what="token ids",
                    ignore=ignore)
        if V.shape_of(targets) != tuple(shape):
            raise ValueError(f"targets: expected shape {tuple(shape)} (that of ids), got "
                             f"{V.shape_of(targets)}")
        if count:  # a mean: at least one that counts
            nn.count_targets(self.xp, targets, ignore)

    # ----------------------------------------------------------- torch interop

    def to_torch(self) -> Any:
        """The same model in torch (CPU, the model's dtype, a copy of the weights): a ``torch.nn.Module``.

        ``module(ids)`` (a LongTensor (B, L)) returns the logits (B, L, V),
        computed by torch's own layers: ``nn.Embedding`` for ``wte`` and
        ``wpe``, ``nn.TransformerEncoderLayer(norm_first=True, batch_first=True,
        activation=partial(F.gelu, approximate="tanh"))`` per block with a causal
        mask, ``nn.LayerNorm``, and the head tied to ``wte``. In the model's
        mode, each layer in its block's and its ``self_attn`` in the block's
        attention module's. For checking npattn against torch's autograd, or the
        other way round. Needs torch.
        """
        import torch

        dtype = getattr(torch, V.dtype_name(self.dtype))
        cfg = self

        class TorchGPT(torch.nn.Module):
            def __init__(self):
                super().__init__()
                D = cfg.d_model
                self.wte = torch.nn.Embedding(cfg.vocab_size, D, dtype=dtype)
                self.wpe = torch.nn.Embedding(cfg.block_size, D, dtype=dtype)
                self.blocks = torch.nn.ModuleList(
                    torch.nn.TransformerEncoderLayer(
                        D, cfg.n_head, cfg.d_ff, dropout=cfg.dropout,
                        # a function, not nn.GELU: torch's fast inference path (eval + no_grad)
                        # takes any nn.GELU for the exact form and ignores approximate="tanh"
                        activation=functools.partial(torch.nn.functional.gelu, approximate="tanh"),
                        layer_norm_eps=cfg.layer_norm_eps,
                        batch_first=True, norm_first=True, bias=cfg.bias, dtype=dtype)
                    for _ in range(cfg.n_layer))
                self.ln_f = torch.nn.LayerNorm(D, eps=cfg.layer_norm_eps, bias=cfg.bias, dtype=dtype)

            def forward(self, ids):  # [B, L] -> [B, L, V]
                L = ids.shape[1]
                x = self.wte(ids) + self.wpe(torch.arange(L, device=ids.device))
                causal = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=x.dtype,
                                                                               device=x.device)
                for block in self.blocks:
                    x = block(x, src_mask=causal, is_causal=True)
                return torch.nn.functional.linear(self.ln_f(x), self.wte.weight)

        module = TorchGPT()
        with torch.no_grad():
            for name in ("wte", "wpe"):
                getattr(module, name).weight.copy_(torch.from_numpy(np.array(to_numpy(self._own[name]))))
            for block, layer in zip(self.blocks, module.blocks):
                layer.load_state_dict(block.torch_state_dict())
            module.ln_f.weight.copy_(torch.from_numpy(np.array(to_numpy(self._own["ln_f.weight"]))))
            if self.bias:
                module.ln_f.bias.copy_(torch.from_numpy(np.array(to_numpy(self._own["ln_f.bias"]))))
        module.train(self.training)
        layers: Any = module.blocks
        for block, layer in zip(self.blocks, layers):  # a block set apart keeps its modes
            layer.train(block.training)
            layer.self_attn.train(block.self_attn.training)
        return module

    # --------------------------------------------------------------- generate

    def generate(self, ids: Any, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: Optional[int] = None, greedy: bool = False, seed: Any = None,
                 return_logits: bool = False) -> Any:
        """Continue each prompt in ``ids`` (B, L0) by ``max_new_tokens`` tokens, with KV caches.

        The prompt runs through the model once (filling one ``KVCache`` per
        block); then each step feeds only the token just chosen, at position
        ``L0 + t``, and reads the logits of the next one. Dropout is off
        during generation (the modes are restored afterwards: the model's, each
        block's and its attention module's). The model's
        cached forward is dropped: ``backward`` needs a new forward after it.
        A call that fails (memory, say) changes nothing: the mode, the cached
        forwards and a ``seed`` Generator's or BitGenerator's state are put back. Logits with a NaN
        or +inf, or a row without a finite one, stop it with a ``ValueError`` that
        names the step.

        Parameters
        ----------
        ids : integer array, shape (B, L0), 1 <= L0 <= block_size
        max_new_tokens : int >= 0
            ``L0 + max_new_tokens - 1 <= block_size``: the last token chosen is
            not fed back, and a KV cache does not slide.
        temperature : float > 0
            Logits are divided by it before sampling.
        top_k : int, optional
            Sample among the ``top_k`` largest logits only (ties at the k-th
            value are kept).
        greedy : bool
            Take the largest logit (the first on ties); ``temperature``,
            ``top_k`` and ``seed`` are then unused.
        seed : int, SeedSequence, BitGenerator, Generator or None
            The host ``numpy.random`` generator (or its seed) sampling draws from
            (``check_rng``'s seeds, as the dropout functions' ``rng``).
        return_logits : bool
            Also return the logits each new token was chosen from, (B, n, V).

        Returns
        -------
        ids : integer array, shape (B, L0 + max_new_tokens), the backend's int64 (int32 on
            JAX without x64)
        logits : array, shape (B, max_new_tokens, V), only with ``return_logits``
        """
        max_new_tokens = V.check_size("max_new_tokens", max_new_tokens)  # a Python int
        self._check_ids("ids", ids, 0)
        B, L0 = ids.shape
        if L0 + max_new_tokens - 1 > self.block_size:
            raise ValueError(f"max_new_tokens: expected at most block_size - L0 + 1 = "
                             f"{self.block_size - L0 + 1}, got {max_new_tokens}")
        check_sampling(temperature, top_k, self.vocab_size)
        V.check_bool("greedy", greedy)
        V.check_bool("return_logits", return_logits)
        rng = make_rng(seed)  # checked by check_rng, naming seed
        # put back should a step fail (memory): the mode, the model's cached forward, the
        # blocks' (blocks_put_back_on_failure) and the caller's sampling generator
        mode, cached, drawn = self.training, self._cache, rng.bit_generator.state
        # each block's mode and its attention's too: one set apart (block.eval()) keeps its own
        modes = [block.modes for block in self.blocks]

        def put_back_modes():
            self.train(mode)
            for block, block_modes in zip(self.blocks, modes):
                block.modes = block_modes

        try:
            self.eval()  # inside: a failure after some blocks were switched puts their modes back
            with blocks_put_back_on_failure(self.blocks):
                tokens, steps = self._sample(ids, max_new_tokens, rng, temperature=temperature,
                                             top_k=top_k, greedy=greedy)
                # the results made before anything is kept: a failure here changes nothing too
                out = from_numpy(np.concatenate(tokens, axis=1), self.xp, self._device())
                logits = None
                if return_logits and steps:
                    logits = self.xp.stack(steps, axis=1)  # [B, n, V]
                elif return_logits:
                    logits = self.xp.zeros((B, 0, self.vocab_size), dtype=self.dtype,
                                           device=self._device())
                put_back_modes()  # still guarded: should it fail, everything else is put back too
        except BaseException:
            self._cache = cached
            rng.bit_generator.state = drawn
            put_back_modes()
            raise
        self._cache = None  # the last forward was a decoding one: nothing to differentiate
        return (out, logits) if return_logits else out

    def _sample(self, ids: Any, max_new_tokens: int, rng: np.random.Generator, *,
                temperature: float, top_k: Optional[int], greedy: bool) -> tuple:
        """``generate``'s loop, in eval mode: the host tokens [(B, L0), (B, 1), ...] and the
        logits each new token was chosen from [(B, V), ...]."""
        B, L0 = ids.shape
        caches = self.new_caches(B, L0 + max(max_new_tokens - 1, 0))
        tokens = [to_numpy(ids).astype(np.int64)]  # host [B, L0]
        steps = []
        feed = self.xp.astype(ids, widest_int(self.xp))
        for t in range(max_new_tokens):
            last = self.forward(feed, kv_caches=caches)[:, -1, :]  # [B, V]
            # dask: the next step's graph starts from computed keys, and the logits are computed
            # with them (one persist per cache and the read below ran the blocks again for each)
            last, = persist_with(caches, last)
            steps.append(last)
            host = np.asarray(to_numpy(last), dtype=np.float64)  # (bfloat16 included)
            _check_step_logits(host, t, max_new_tokens)
            nxt = sample_next(host, rng, temperature=temperature, top_k=top_k,
                              greedy=greedy)  # host [B]
            tokens.append(nxt[:, None])
            if t < max_new_tokens - 1:
                feed = from_numpy(nxt[:, None], self.xp, self._device())  # [B, 1]
        return tokens, steps


def _logit_faults(z: np.ndarray) -> tuple:
    """The rows of host logits (B, V) that no token can be drawn from, by what they hold:
    ``(("NaN", rows), ("+inf", rows), ("only -inf", rows))``, each ``rows`` a [B] bool array
    (a row is counted under the first that applies)."""
    nan, posinf = np.isnan(z).any(axis=-1), np.isposinf(z).any(axis=-1)  # [B]
    none = ~nan & ~posinf & ~np.isfinite(z.max(axis=-1))  # [B] every entry -inf
    return (("NaN", nan), ("+inf", posinf), ("only -inf", none))


def _check_step_logits(host: np.ndarray, t: int, max_new_tokens: int) -> None:
    """What ``sample_next`` refuses in logits (B, V), said in ``generate``'s terms: the model
    produced them at step ``t`` (0-based), not an argument of the caller."""
    for what, rows in _logit_faults(host):
        if rows.any():
            raise ValueError(
                f"generate: the model produced logits with {what} at step {t + 1} of "
                f"{max_new_tokens} (in {int(rows.sum())} of {host.shape[0]} rows), so no token "
                "can be drawn: its parameters or the activations they give are not finite")


def check_sampling(temperature: Any, top_k: Any, vocab_size: int) -> None:
    """The sampling options' checks (``GPT.generate``, ``sample_next``)."""
    V.check_number("temperature", temperature)
    if top_k is not None and V.check_size("top_k", top_k, minimum=1) > vocab_size:
        raise ValueError(f"top_k: expected at most vocab_size = {vocab_size}, got {top_k}")


def sample_next(logits: np.ndarray, rng: np.random.Generator, *, temperature: float = 1.0,
                top_k: Optional[int] = None, greedy: bool = False) -> np.ndarray:
    """One token per row of host ``logits`` (B, V): greedy (``greedy=True``: the first largest
    logit), or sampled with ``temperature`` and, with ``top_k``, among the k largest.

    1. ``z = (logits - max(logits)) / temperature`` in float64 (the shift
       first: no overflow however small the temperature, which tends to greedy)
    2. top-k: entries below the k-th largest of their row -> -inf
    3. ``p = exp(z)`` (unnormalised softmax); ``u ~ U[0, 1)`` from ``rng``, one per row
    4. the token is the first ``v`` with ``cumsum(p)[v] > u * sum(p)`` (inverse CDF)

    Shapes: ``logits`` (B, V) -> tokens (B,) int64. Each row needs a finite
    largest logit (entries may be -inf, none NaN or +inf).

    Parameters
    ----------
    logits : numpy.ndarray, shape (B, V)
        Real floating, on the host; computed in float64.
    rng : numpy.random.Generator
        Draws ``u``; checked with ``greedy`` too, which draws nothing.
    temperature : float
        A finite number > 0 that divides the shifted logits (step 1); default 1.
    top_k : int, optional
        In [1, V]; None: every token.
    greedy : bool
        The first largest logit of each row, nothing drawn; ``temperature`` and
        ``top_k`` are still checked.

    Returns
    -------
    tokens : numpy.ndarray of int64, shape (B,)
    """
    # [B, V] -> [B]
    if isinstance(logits, (np.ma.MaskedArray, np.matrix)):  # a mask would be ignored
        raise TypeError(f"logits: expected a plain numpy.ndarray, got {V.type_name(logits)} "
                        "(to leave tokens out, set their logits to -inf)")
    if not isinstance(logits, np.ndarray) or logits.dtype.kind != "f":  # (complex, object, bool,
        # strings and other libraries' arrays were converted, or failed in the conversion)
        raise TypeError(f"logits: expected a real floating NumPy array (B, V) on the host, got "
                        f"{V.type_name(logits)}"
                        + (f" of dtype {logits.dtype}" if isinstance(logits, np.ndarray) else ""))
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim != 2 or z.shape[0] < 1 or z.shape[1] < 1:
        raise ValueError(f"logits: expected shape (B, V) with B, V >= 1, got {z.shape}")
    faults = _logit_faults(z)
    bad = faults[0][1] | faults[1][1] | faults[2][1]  # [B]
    if bad.any():
        b = int(np.argmax(bad))  # the first bad row, named with what it holds
        got = next(what for what, rows in faults if rows[b])
        raise ValueError("logits: expected no NaN or +inf and a finite largest entry in every row, "
                         f"got {got} in row {b}")
    V.check_bool("greedy", greedy)
    # checked with greedy too, as generate checks them: a bad option is an error, not ignored
    check_sampling(temperature, top_k, z.shape[-1])
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng: expected a numpy.random.Generator, got {V.type_name(rng)}")
    if greedy:
        return np.argmax(z, axis=-1).astype(np.int64)
    with np.errstate(over="ignore"):  # a tiny temperature sends the others to -inf, as intended
        z = (z - np.max(z, axis=-1, keepdims=True)) / float(temperature)  # 1.  [B, V], max 0
    if top_k is not None:  # 2.
        kth = np.sort(z, axis=-1)[:, -int(top_k)][:, None]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z)  # 3.                                                      [B, V]
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(z.shape[0]) * cdf[:, -1]
    return np.minimum((cdf <= u[:, None]).sum(axis=-1), z.shape[-1] - 1).astype(np.int64)  # 4.


def check_training_options(model: GPT, state: Any, *, lr: Any, max_grad_norm: Any, betas: Any,
                           eps: Any, weight_decay: Any) -> None:
    """``training_step``'s own arguments, checked before the forward (a failed step changes nothing)."""
    if not isinstance(model, GPT):
        raise TypeError(f"model: expected an npattn.gpt.GPT, got {V.type_name(model)}")
    V.check_number("max_grad_norm", max_grad_norm, allow_none=True)
    nn.check_adam(model.params, model.params, state, lr=lr, betas=betas, eps=eps,
                  weight_decay=weight_decay)


def training_step(model: GPT, state: nn.AdamState, ids: Any, targets: Any, *, lr: float,
                  max_grad_norm: Optional[float] = 1.0, betas: tuple[float, float] = (0.9, 0.999),
                  eps: float = 1e-8, weight_decay: float = 0.0,
                  dropout_masks: Optional[Sequence] = None,
                  weight: Any = None, ignore_index: Optional[int] = None,
                  label_smoothing: float = 0.0, reduction: str = "mean") -> tuple[float, float, nn.AdamState]:
    """One training step: forward, loss, backward, clipping, Adam; returns ``(loss, grad_norm, state)``.

    ``ids`` and ``targets`` (B, L) are token ids and the next tokens
    (``GPT.loss``, as its ``weight``, ``ignore_index``, ``label_smoothing`` and
    ``reduction``); ``dropout_masks`` as
    ``GPT.forward``'s. ``state`` from
    ``nn.adam_init(model.params)``; ``lr``, ``betas``, ``eps`` and
    ``weight_decay`` are ``nn.adam_step``'s. The model's ``params`` are
    replaced by the updated ones. ``grad_norm`` is the global norm before
    clipping to ``max_grad_norm`` (None: no clipping), ``nn.global_norm``.
    ``model.grads`` keeps the gradients as the backward gave them, before
    clipping (torch's ``clip_grad_norm_`` scales ``.grad`` in place; the clipped
    ones are ``nn.clip_grad_norm(model.grads, max_grad_norm)[0]``). Every
    argument is checked before the forward but one, as in ``GPT.loss``: class
    weights of the counted targets that sum to 0 are found by the cross-entropy.
    Should the step fail after the forward (that, or memory, say), the model is
    put back as it was before the call (its forward's cache, its and its blocks'
    generators, its grads): a failed step changes nothing, and running it again
    draws the same dropout masks.

    Parameters
    ----------
    model : GPT
    state : nn.AdamState
        The optimiser's state before the step.
    ids, targets : integer arrays, shape (B, L)
    lr : float
    max_grad_norm : float, optional
        A finite number > 0 to clip the gradients' global norm to (default 1.0); None: no
        clipping.
    betas : (float, float)
        Default (0.9, 0.999).
    eps, weight_decay : float
        Defaults 1e-8 and 0.
    dropout_masks : list of N dicts, optional
    weight, ignore_index, label_smoothing, reduction
        As ``GPT.loss``'s.

    Returns
    -------
    loss : float
        The loss of the forward, before the update.
    grad_norm : float
        The gradients' global norm before clipping.
    state : nn.AdamState
        The optimiser's next state.
    """
    check_training_options(model, state, lr=lr, max_grad_norm=max_grad_norm, betas=betas, eps=eps,
                           weight_decay=weight_decay)
    # what the forward and backward below change, put back should a later step fail
    before = (model._cache, model._rng.bit_generator.state, model.grads,
              [(b.forward_state(), b.backward_state()) for b in model.blocks])
    try:
        loss, dlogits = model._loss(ids, targets, dropout_masks=dropout_masks, weight=weight,
                                    ignore_index=ignore_index, label_smoothing=label_smoothing,
                                    reduction=reduction)
        grads = model.backward(dlogits)
        # dask: the loss and the gradients computed in one graph, the forward once, and kept
        # for the norm and the step (each of the norm's sums would compute the backward again)
        loss, *values = persisted(loss, *grads.values())
        grads = model.grads = dict(zip(grads, values))  # (the same numbers; on dask, computed)
        loss = float(loss)
        if max_grad_norm is not None:
            grads, norm = nn.clip_grad_norm(grads, float(max_grad_norm))
        else:
            norm = nn.global_norm(grads)  # clip_grad_norm's total
        new, state = nn.adam_step(model.params, grads, state, lr=lr, betas=betas, eps=eps,
                                  weight_decay=weight_decay)
        model.params = new  # checked; a failure in it (an interrupt) puts every block back
    except BaseException:
        model._cache, rng_state, model.grads, blocks = before
        model._rng.bit_generator.state = rng_state
        for block, (fwd, bwd) in zip(model.blocks, blocks):
            block.restore_backward_state(bwd)
            block.restore_forward_state(fwd)  # (the attention modules' caches: the forward's)
        raise
    return loss, norm, state
