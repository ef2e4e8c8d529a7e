"""What a model made of Transformer blocks and parameters of its own shares.

``GPT`` (``npattn.gpt``) and ``TransformerClassifier`` (``npattn.classifier``)
are each a list of ``TransformerBlock``s between parameters of their own
(embeddings, a final norm, a head). ``BlockStack`` holds what is the same
in both: the flat ``params`` dict (the model's own names, then
``blocks.{n}.{name}``), its checked assignment, the training mode, copies
and files. The forward and backward are the models' own.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

from . import validation as V
from .backend import backend_name, device_of
from .transformer import ENCODER_DROPOUT_SITES, SITE_SHAPES
from .module import (check_forward_impl, check_params_assignment, check_path, model_from_save_file,
                     picklable_state, restore_state, set_rng_state, write_save_file)

__all__ = ["BlockStack", "blocks_put_back_on_failure", "block_grads_put_back_on_failure"]


@contextlib.contextmanager
def _put_back_on_failure(blocks: Any, read: Callable[[Any], Any],
                         restore: Callable[[Any, Any], None]) -> Iterator[None]:
    """Run the body; should it raise, put every block back with ``restore(block, state)``
    from the ``read(block)`` taken before it, then let the error go on."""
    before = [read(block) for block in blocks]
    try:
        yield
    except BaseException:
        for block, state in zip(blocks, before):
            restore(block, state)
        raise


def blocks_put_back_on_failure(blocks: Any) -> contextlib.AbstractContextManager:
    """Run a model's forward inside; should it raise (memory, say), every block is put back as
    it was before (``TransformerBlock.forward_state``: its caches and generators), then the
    error goes on: the blocks that ran keep the previous forward for ``backward``."""
    return _put_back_on_failure(blocks, lambda b: b.forward_state(),
                                lambda b, state: b.restore_forward_state(state))


def block_grads_put_back_on_failure(blocks: Any) -> contextlib.AbstractContextManager:
    """Run a model's backward inside; should it raise (memory, say) after some blocks'
    backwards ran, every block's grads and its attention modules' are put back as they were
    (``TransformerBlock.backward_state``), then the error goes on: a failed call changes nothing."""
    return _put_back_on_failure(blocks, lambda b: b.backward_state(),
                                lambda b, state: b.restore_backward_state(state))


def set_per_block(label: str, blocks: Any, header: dict, key: str, attr: str, what: str) -> None:
    """Set ``attr`` of each block from the list ``header[key]`` (one entry per block) of a
    saved model; nothing where the key is null or missing. A list of another length, or an
    entry the block's setter refuses, is a ValueError naming the file (``label``) and the key."""
    values = header.get(key)
    if values is None:
        return
    if not isinstance(values, list) or len(values) != len(blocks):
        got = (f"a list of {len(values)}" if isinstance(values, list)
               else f"{values!r} ({V.type_name(values)})")
        raise ValueError(f"{label}: expected '{key}' in the header to be null or a list of "
                         f"{len(blocks)} {what} (one per block), got {got}")
    for n, (block, value) in enumerate(zip(blocks, values)):
        try:
            setattr(block, attr, value)
        except (TypeError, ValueError) as exc:  # the setter's message names its argument, attr
            reason = str(exc).removeprefix(f"{attr}: ")
            raise ValueError(f"{label}: {key}[{n}]: {reason}") from exc


class BlockStack:
    """Base of a model with ``blocks`` (TransformerBlocks) and its own parameters ``_own``.

    A subclass sets ``blocks``, ``_own`` (a dict of arrays), ``xp``, ``dtype``,
    ``training`` and ``_cache``, and names in ``LEADING`` the own parameters
    listed before the blocks' in ``params`` (the others come after them).
    """

    #: The own parameters that ``params`` lists before the blocks' (the others come after
    #: them): set by each subclass.
    LEADING: tuple = ()
    #: The ``format`` of the subclass's ``save`` files, which ``load`` checks: set by each subclass.
    SAVE_FORMAT: str = ""
    #: The ``format_version`` of the subclass's ``save`` files, which ``load`` checks.
    SAVE_VERSION: int = 1
    #: The constructor arguments a ``save`` file holds (with ``dtype``) and ``load`` passes
    #: back: set by each subclass.
    CONFIG_KEYS: tuple = ()
    blocks: list
    _own: dict
    xp: Any
    dtype: Any
    training: bool

    @property
    def params(self) -> dict:
        """A new dict of every parameter: the model's own (``LEADING`` first), then ``blocks.{n}.{name}``, then the rest.

        Assign a whole dict to replace them (every array checked first:
        library, device, dtype, shape); writing into the returned dict
        changes nothing.
        """
        own = self._own
        out = {k: own[k] for k in self.LEADING if k in own}
        for n, block in enumerate(self.blocks):
            out.update({f"blocks.{n}.{k}": v for k, v in block.params.items()})
        out.update({k: v for k, v in own.items() if k not in self.LEADING})
        return out

    @params.setter
    def params(self, new: dict):
        check_params_assignment(new, self.params, self.xp)
        # all checked; should a block's assignment fail all the same (an interrupt, memory),
        # the blocks assigned before it are put back: a failed assignment changes nothing
        with _put_back_on_failure(self.blocks, lambda b: b.params,
                                  lambda b, params: setattr(b, "params", params)):
            for n, block in enumerate(self.blocks):
                prefix = f"blocks.{n}."
                block.params = {k[len(prefix):]: v for k, v in new.items() if k.startswith(prefix)}
        self._own = {k: new[k] for k in self._own}

    # ---------------------------------------------------------------- dropout

    def site_shapes(self, B: int, L: int) -> dict:
        """The shape of each block's dropout site (``ENCODER_DROPOUT_SITES``) for a batch of B sequences of L.

        Parameters
        ----------
        B, L : int
            Batch size and sequence length.

        Returns
        -------
        shapes : dict
            ``"self_attn"`` (B, H, L, L), ``"dropout1"`` (B, L, D), ``"dropout"``
            (B, L, d_ff), ``"dropout2"`` (B, L, D), of the blocks' H, D and d_ff.
        """
        b = self.blocks[0]
        shapes = {"self_attn": (B, b.n_head, L, L), "dropout1": (B, L, b.d_model),
                  "dropout": (B, L, b.d_ff), "dropout2": (B, L, b.d_model)}
        assert tuple(shapes) == ENCODER_DROPOUT_SITES
        return shapes

    def check_dropout_masks(self, dropout_masks: Any, B: int, L: int) -> None:
        """Every block's keep-masks, before block 0 runs (a block checks only its own).

        None, or a list with one dict (or None) per block whose keys are among
        ``ENCODER_DROPOUT_SITES`` and whose values are bool masks broadcastable
        to ``site_shapes(B, L)``: ``TypeError`` for another kind, ``ValueError``
        for another length, key or shape.
        """
        if dropout_masks is None:
            return
        n_layers = len(self.blocks)
        if not isinstance(dropout_masks, (list, tuple)):
            raise TypeError(f"dropout_masks: expected a list of {n_layers} dicts or None (one per "
                            f"block), got {V.type_name(dropout_masks)}")
        if len(dropout_masks) != n_layers:
            raise ValueError(f"dropout_masks: expected a list of {n_layers} dicts or None (one per "
                             f"block), got a {V.type_name(dropout_masks)} of length {len(dropout_masks)}")
        shapes = self.site_shapes(B, L)
        device = device_of(next(iter(self._own.values())))
        for n, masks in enumerate(dropout_masks):
            if masks is None:
                continue
            if not isinstance(masks, dict):
                raise TypeError(f"dropout_masks[{n}]: expected a dict or None, got {V.type_name(masks)}")
            unknown = sorted(set(masks) - set(shapes), key=str)
            if unknown:
                raise ValueError(f"dropout_masks[{n}]: expected keys among {list(shapes)}, got {unknown}")
            for site, keep in masks.items():
                V.check_mask(f"dropout_masks[{n}][{site!r}]", keep, self.xp, target=shapes[site],
                             target_text=SITE_SHAPES[site], dtype=self.dtype, device=device,
                             bool_only=True)

    def check_blocks_impl(self, arrays: Any, B: int, L: int, *, need_weights: bool = False,
                          kv_caches: Any = None) -> None:
        """That every block's attention implementation (``self_attn.impl``) takes a forward of
        B sequences of L computed from ``arrays`` (the model's inputs), before block 0 runs
        (``module.check_forward_impl``; a block checks only its own)."""
        for n, block in enumerate(self.blocks):
            check_forward_impl(block.self_attn, block.self_attn.impl, arrays, lengths=(B, L, L),
                               need_weights=need_weights,
                               kv_cache=None if kv_caches is None else kv_caches[n])

    def n_params(self) -> int:
        """The number of scalar parameters (a tied weight counted once)."""
        return sum(math.prod(p.shape) for p in self.params.values())

    def train(self, mode: bool = True) -> Any:
        """Training mode: dropout acts (when ``dropout > 0``). Returns self.

        Parameters
        ----------
        mode : bool
            True (default) for training, False for evaluation (``eval``); every
            block is set to it too.

        Returns
        -------
        self : BlockStack
        """
        V.check_bool("mode", mode)
        self.training = bool(mode)
        for block in self.blocks:
            block.train(mode)
        return self

    def eval(self) -> Any:
        """Evaluation mode: dropout is off. Returns self."""
        return self.train(False)

    def __call__(self, *args, **kwargs):
        """``forward(*args, **kwargs)``, as a torch module is called."""
        return getattr(self, "forward")(*args, **kwargs)

    def __getstate__(self) -> dict:
        """What ``pickle`` and ``copy.deepcopy`` keep: everything but the namespace and the cache.

        As the blocks': the backend travels by name and is resolved again;
        parameters, ``grads``, the mode and the dropout generators' states are
        kept (the blocks pickle themselves), so a copy draws the same next
        dropout masks as the original and then goes its own way. The last
        forward's activations are not: ``backward`` on a copy needs a forward.
        """
        return picklable_state(self)

    def __setstate__(self, state: dict) -> None:
        restore_state(self, state)

    # --------------------------------------------------------------- files

    def save(self, path: Any) -> None:
        """Write the model to ``path``, a portable ``.npz`` file (``MultiHeadAttention.save``'s layout).

        One array per parameter (``param/`` + the ``params`` names; bfloat16
        stored as float32) and an entry ``config`` holding one JSON string:
        ``format`` (the class's ``SAVE_FORMAT``), ``format_version``, the
        constructor arguments (``CONFIG_KEYS`` and ``dtype``), the mode
        (``training``), each block's modes (``block_modes``, a list of
        ``TransformerBlock.modes``: a block set apart with ``blocks[n].eval()``,
        or its attention with ``blocks[n].self_attn.eval()``, stays apart) and
        the states of the dropout generators (the model's own, ``rng_state``,
        and each block's, ``block_rng_states``), so the next training forward
        after ``load`` draws the masks this model would. Nothing is pickled.

        Parameters
        ----------
        path : str, os.PathLike or binary file object
            A file name (not a directory's), or an object with ``write``.
        """
        check_path(path)
        config = {k: getattr(self, k) for k in self.CONFIG_KEYS}
        config["dtype"] = V.dtype_name(self.dtype)
        own_rng = getattr(self, "_rng", None)
        header = {"format": self.SAVE_FORMAT, "format_version": self.SAVE_VERSION, "config": config,
                  "training": self.training,
                  "rng_state": None if own_rng is None else own_rng.bit_generator.state,
                  "block_rng_states": [block.rng_state for block in self.blocks],
                  "block_modes": [block.modes for block in self.blocks],
                  "saved_from_backend": backend_name(self.xp)}
        write_save_file(path, header, self.params, xp=self.xp, dtype=self.dtype)

    @classmethod
    def load(cls, path: Any, *, backend: Any = "numpy") -> Any:
        """A model rebuilt from a file of ``save`` on ``backend``: parameters bit for bit, modes, generators.

        A file without ``block_modes`` puts every block in the model's mode.
        ``ValueError`` naming what was expected and what the file holds for
        another kind of file (another model's, a block's, a
        ``MultiHeadAttention``'s), another version, configuration keys or
        parameters missing or unexpected, malformed modes or generator states. A
        ``path`` that names a directory is an ``IsADirectoryError``, a
        missing file a ``FileNotFoundError``.

        Parameters
        ----------
        path : str, os.PathLike or binary file object
            A file written by this class's ``save``, or an object with ``read``.
        backend : str or namespace module
            npattn backend of the model (default "numpy").

        Returns
        -------
        model : GPT or TransformerClassifier
            An instance of the class ``load`` is called on.

        Raises
        ------
        ValueError
            For a file that is not one this class's ``save`` wrote, as above.
        IsADirectoryError, FileNotFoundError
            For a ``path`` that names a directory, or no file.
        """
        model, header, label = model_from_save_file(cls, path, backend=backend, fmt=cls.SAVE_FORMAT,
                                                    version=cls.SAVE_VERSION,
                                                    config_keys=(*cls.CONFIG_KEYS, "dtype"))
        own_rng = getattr(model, "_rng", None)
        if own_rng is not None:
            set_rng_state(f"{label}: rng_state", own_rng, header.get("rng_state"))
        # a file without them: every block in the model's mode, with its generator as made
        set_per_block(label, model.blocks, header, "block_modes", "modes", "dicts of modes")
        set_per_block(label, model.blocks, header, "block_rng_states", "rng_state", "generator states")
        return model
