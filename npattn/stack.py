"""What a model made of Transformer blocks and parameters of its own shares.

``GPT`` (``npattn.gpt``) and ``TransformerClassifier`` (``npattn.classifier``)
are each a list of ``TransformerBlock``s between parameters of their own
(embeddings, a final norm, a head). ``BlockStack`` holds what is the same
in both: the flat ``params`` dict (the model's own names, then
``blocks.{n}.{name}``), its checked assignment, the training mode, copies.
The forward and backward are the models' own.
"""

from __future__ import annotations

import math
from typing import Any

from . import validation as V
from .module import check_param, picklable_state, restore_state

__all__ = ["BlockStack"]


class BlockStack:
    """Base of a model with ``blocks`` (TransformerBlocks) and its own parameters ``_own``.

    A subclass sets ``blocks``, ``_own`` (a dict of arrays), ``xp``, ``dtype``,
    ``training`` and ``_cache``, and names in ``LEADING`` the own parameters
    listed before the blocks' in ``params`` (the others come after them).
    """

    LEADING: tuple = ()
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
        current = self.params
        if not isinstance(new, dict) or set(new) != set(current):
            got = sorted(new) if isinstance(new, dict) else type(new).__name__
            raise ValueError(f"params: expected the keys {list(current)}, got {got}")
        for name, like in current.items():
            check_param(name, new[name], like=like, xp=self.xp)
        for n, block in enumerate(self.blocks):  # all checked: nothing below fails
            prefix = f"blocks.{n}."
            block.params = {k[len(prefix):]: v for k, v in new.items() if k.startswith(prefix)}
        self._own = {k: new[k] for k in self._own}

    def n_params(self) -> int:
        """The number of scalar parameters (a tied weight counted once)."""
        return sum(math.prod(p.shape) for p in self.params.values())

    def train(self, mode: bool = True) -> Any:
        """Training mode: dropout acts (when ``dropout > 0``). Returns self."""
        V.check_bool("mode", mode)
        self.training = bool(mode)
        for block in self.blocks:
            block.train(mode)
        return self

    def eval(self) -> Any:
        """Evaluation mode: dropout is off. Returns self."""
        return self.train(False)

    def __call__(self, *args, **kwargs):
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
