"""npattn: multi-head attention with hand-derived gradients, on any Array API backend.

* ``npattn.functional``: stateless ``*_forward -> (out, cache)`` /
  ``*_backward(dout, cache) -> grads`` pairs for every step;
* ``npattn.attention``: the one dispatcher, ``sdpa_forward(..., impl=)``
  over the reference, the blocked (FlashAttention-2 style) algorithm
  (``npattn.blocked``) and the NumPy kernel (``npattn.numpy_kernel``);
* ``npattn.MultiHeadAttention``: the module, a thin composition of them;
* ``npattn.KVCache``: preallocated keys and values for incremental decoding
  with the module (``forward(..., kv_cache=)``);
* ``npattn.gradcheck``: central finite-difference checks for your own code
  (the module; its ``gradcheck`` function is also ``npattn.check_gradients``);
* ``npattn.masks``: causal, window, segment and padding masks, and torch MHA's
  masks converted;
* ``npattn.compat``: flash-attn's, torch SDPA's and JAX's attention entry
  points with their signatures, and ``vjp`` for their gradients;
* ``npattn.verify``: check someone else's attention kernel against npattn
  with error budgets (``npattn.testing`` for test suites);
* ``npattn.backend``: the one seam between npattn and array libraries.
"""

from . import attention, backend, blocked, compat, functional, gradcheck, masks
from .gradcheck import gradcheck as check_gradients
from .kvcache import KVCache
from .module import MultiHeadAttention
from .verifier import verify

__version__ = "0.1.0"

__all__ = [
    "KVCache", "MultiHeadAttention", "attention", "backend", "blocked", "check_gradients",
    "functional", "compat", "gradcheck", "masks", "verify", "__version__",
]
from . import positions; __all__ += ["positions"]  # noqa: E402,E702  RoPE and relative positions
from . import layers; __all__ += ["layers"]  # noqa: E402,E702  layer norm, GELU/ReLU, feed-forward, residual
from . import transformer; __all__ += ["transformer"]  # noqa: E402,E702  encoder and decoder blocks
from . import gpt; __all__ += ["gpt"]  # noqa: E402,E702  a GPT: training step, generation with KV caches
from . import classifier; __all__ += ["classifier"]  # noqa: E402,E702  TransformerClassifier: blocks, mean pooling, a head
