"""A NumPy integer where an int is taken behaves as the same Python int.

npattn accepts Python or NumPy integers for its size-like arguments. A NumPy
integer that passed its check and then took part in arithmetic in its own dtype
wrapped (``np.uint8(255) + 2`` is 1) or overflowed (``np.uint8(3) - 5``, or ``510 //
np.uint8(2)``, raise): the checks hand back Python ints and the entry points use
them, on the objects they build too. Each case below is called with a Python int and
with each small NumPy integer type holding the same value, at values near the types'
wrap points; the outcomes must agree (the same result with the same types, or the same
error naming the same argument).
"""

import warnings

import numpy as np
import pytest

from npattn import KVCache, MultiHeadAttention
from npattn import functional as F
from npattn import masks, nn
from npattn import positions as P
from npattn.backend import keyed_keep_mask
from npattn.classifier import TransformerClassifier
from npattn.gpt import GPT
from npattn.transformer import TransformerBlock

NUMPY_INTS = (np.uint8, np.int8, np.int16, np.uint64)


def _plain(x):
    """A comparable form of a result: arrays by dtype, shape and entries, numbers with their type."""
    if isinstance(x, np.ndarray):
        return ("array", str(x.dtype), x.shape, x.tolist())
    if isinstance(x, (tuple, list)):
        return tuple(_plain(e) for e in x)
    if isinstance(x, dict):
        return tuple((k, _plain(v)) for k, v in sorted(x.items()))
    return (type(x).__name__, x)


def _outcome(fn, n):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NumPy's "overflow encountered"
        try:
            return _plain(fn(n))
        except (TypeError, ValueError, OverflowError) as e:
            return ("raised", type(e).__name__, str(e).split(":")[0])  # the argument it names


def _kv_cache(capacity=5, held=3):
    c = KVCache(1, capacity, 1, 2, dtype="float64")
    c.append(np.ones((1, 1, held, 2)), np.ones((1, 1, held, 2)))
    return c


def _check_room(n):
    _kv_cache().check_room(n)  # 3 held of capacity 5: room for 2
    return "room"


def _kv_attributes(n):
    c = KVCache(n, n, 1, 2, value_dim=n, dtype="float64")
    return c.batch_size, c.capacity, c.head_dim, c.value_dim


def _truncate(n):
    c = _kv_cache(capacity=300, held=260)
    c.truncate(n)
    c.append(np.ones((1, 1, 40, 2)), np.ones((1, 1, 40, 2)))  # n + 40 must not wrap
    return c.cache_seqlens


def _generate(n):
    model = GPT(vocab_size=5, block_size=4, d_model=4, n_layer=1, n_head=1, seed=0)
    ids = np.array([[1, 2]])  # L0 = 2: at most 3 new tokens
    return model.generate(ids, max_new_tokens=n, seed=0, greedy=True)


def _gpt(n):
    model = GPT(vocab_size=n, block_size=n, d_model=4, n_layer=1, n_head=1, seed=0)
    return model.vocab_size, model.block_size, model.n_layer, model.params["wpe"][:2]


def _mha(n):
    m = MultiHeadAttention(8, 2, kdim=n, vdim=n, seed=0)  # Xavier's a = sqrt(6 / (kdim + 8))
    return m.kdim, m.vdim, m.d_model, m.params["w_k"][:, :3]


def _mha_sizes(n):
    m = MultiHeadAttention(n, 1, block_q=n, block_k=n, seed=0)
    return m.d_model, m.n_head, m.head_dim, m.n_kv_head, m.block_q, m.block_k, m.params["w_o"][:2, :2]


def _block(n):
    b = TransformerBlock(4, 1, d_ff=n, seed=n)
    return b.d_ff, b.d_model, b.params["linear1.weight"][:2]


def _classifier(n):
    c = TransformerClassifier(n_features=2, seq_len=n, n_classes=n, d_model=4, n_head=1, seed=n)
    return c.seq_len, c.n_classes, c.n_features, c.n_layers


def _relative_distances(n):
    return P.relative_distances("numpy", n, n)  # Lq + Lk - 1 positions


def _relative_offset(n):
    return P.relative_distances("numpy", n, 3, offset=-5)  # Lq - 1 + offset


def _split_heads(n):
    return F.split_heads_forward(np.zeros((1, 1, 510)), n)[0].shape  # D // n_head, D = 2 * 255


def _window(n):
    return masks.window(n, 3, 1, 0, "bottom_right")  # o = Lk - Lq


def _adam(n):
    params = {"w": np.array([1.0, -2.0])}
    state = nn.AdamState({"w": np.array([0.1, 0.2])}, {"w": np.array([0.01, 0.02])}, n)
    new, state = nn.adam_step(params, {"w": np.array([0.5, 0.5])}, state, lr=0.1)
    return new, state.t  # bias corrections 1 - b^(t + 1)


def _keep_mask(n):
    return keyed_keep_mask(n, 0.5, [], np.arange(2), np.arange(3))  # key & 0xFFFFFFFF


CASES = {
    "KVCache.check_room": (_check_room, (1, 2, 3, 127, 255, 32767, 2**63 - 1)),
    "KVCache attributes": (_kv_attributes, (1, 127, 255)),
    "KVCache.truncate": (_truncate, (0, 127, 255, 260, 261)),
    "GPT.generate max_new_tokens": (_generate, (0, 3, 4, 127, 255, 32767, 2**63 - 1)),
    "GPT sizes": (_gpt, (1, 127, 255)),
    "MultiHeadAttention kdim, vdim": (_mha, (127, 200, 255)),
    "MultiHeadAttention sizes": (_mha_sizes, (1, 127, 255)),
    "TransformerBlock d_ff, seed": (_block, (1, 127, 255)),
    "TransformerClassifier sizes": (_classifier, (1, 127, 255)),
    "positions.relative_distances Lq, Lk": (_relative_distances, (1, 127, 200, 255, 32767)),
    "positions.relative_distances offset": (_relative_offset, (1, 3, 127, 255)),
    "functional.split_heads_forward n_head": (_split_heads, (2, 127, 255)),
    "masks.window Lq": (_window, (1, 127, 255)),
    "nn.adam_step state.t": (_adam, (0, 126, 127, 254, 255, 32767)),
    "backend.keyed_keep_mask key": (_keep_mask, (0, 127, 255, 32767, 2**63)),
}


def _fits(t, n):
    info = np.iinfo(t)
    return info.min <= n <= info.max


@pytest.mark.parametrize("t", NUMPY_INTS, ids=lambda t: t.__name__)
@pytest.mark.parametrize("case", sorted(CASES))
def test_numpy_integer_arguments_behave_as_python_ints(case, t):
    fn, values = CASES[case]
    tried = [n for n in values if _fits(t, n)]
    assert tried
    for n in tried:
        assert _outcome(fn, t(n)) == _outcome(fn, n), f"{case} with {t.__name__}({n})"
