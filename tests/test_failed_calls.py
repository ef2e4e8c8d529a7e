"""A failed call changes nothing, checked at every step: each stateful call is run once to
count the steps it takes (npattn's own functions and the array namespace's), then again
from the same start with one step raising a MemoryError, for a spread of steps from the
first to the last. Afterwards every object holds what it held before (its parameters,
grads, cached forward, mode, generators, a KV cache's keys and lengths, an optimizer's
state, the caller's arrays (flash-attn's KV caches included) and generator: compared bit for
bit with copies taken before), and the next call gives what it gives on a twin that never
failed.
"""

import sys
import types

import array_api_compat.numpy as xp_numpy
import numpy as np
import pytest

import npattn
from npattn import compat, functional, layers, nn
from npattn.classifier import TransformerClassifier
from npattn.gpt import GPT, training_step
from npattn.kvcache import KVCache
from npattn.transformer import TransformerBlock, TransformerDecoderBlock, sublayer_forward

B, L, D, H, VOCAB, T = 2, 4, 8, 2, 11, 8
STEPS = 40  # failing steps tried per call, spread over all of its steps
#: A method that runs once a call has succeeded, to put things away: the module lends its
#: previous cache's arrays to its workspace (``Workspace.give``) after keeping the new one
#: (lent before, a failure after it would leave them both lent and kept).
AFTER_SUCCESS = {"give"}


class Steps:
    """Counts the wrapped calls while armed; raises a MemoryError at call number ``fail_at``."""

    def __init__(self):
        self.count, self.fail_at, self.armed = 0, None, False

    def hit(self):
        if self.armed:
            self.count += 1
            if self.count == self.fail_at:
                raise MemoryError(f"step {self.count}")


def _counted(steps, f):
    def counted(*args, **kwargs):
        steps.hit()
        return f(*args, **kwargs)
    return counted


@pytest.fixture
def steps(monkeypatch):
    """Every module-level function of npattn's modules (but validation's), every method and
    property of their classes and every function of NumPy's array namespace, counted."""
    steps, done = Steps(), {}
    modules = [m for n, m in list(sys.modules.items())
               if n.startswith("npattn.") and not n.startswith(("npattn.tools", "npattn.validation"))]
    for mod in modules:
        for name, f in list(vars(mod).items()):
            if (isinstance(f, types.FunctionType) and not name.startswith("__")
                    and f.__module__.startswith("npattn") and f.__module__ != "npattn.validation"):
                done.setdefault(id(f), _counted(steps, f))
                monkeypatch.setattr(mod, name, done[id(f)])
    for mod in modules:  # and the methods and property reads of npattn's classes
        for cls in [c for c in vars(mod).values() if isinstance(c, type) and c.__module__ == mod.__name__]:
            for name, f in list(vars(cls).items()):
                if name in AFTER_SUCCESS:
                    continue
                if isinstance(f, types.FunctionType) and not name.startswith("__"):
                    monkeypatch.setattr(cls, name, _counted(steps, f))
                elif isinstance(f, property) and f.fget is not None:
                    counted = property(_counted(steps, f.fget), f.fset, f.fdel, f.__doc__)
                    monkeypatch.setattr(cls, name, counted)
    for name, f in list(vars(xp_numpy).items()):
        if callable(f) and not isinstance(f, type) and not name.startswith("_"):
            monkeypatch.setattr(xp_numpy, name, _counted(steps, f))
    return steps


def state_of(obj, seen=None):
    """Everything ``obj`` holds, as plain values: arrays by their bytes, generators by their
    state, objects by their attributes (a KV cache by the keys within each entry's length,
    all it holds)."""
    seen = set() if seen is None else seen
    if obj is None or isinstance(obj, (bool, int, float, str, complex, np.generic, np.dtype)):
        return repr(obj)
    if isinstance(obj, np.ndarray):
        return ("array", obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, np.random.Generator):
        return ("generator", repr(obj.bit_generator.state))
    if isinstance(obj, (types.ModuleType, types.FunctionType, type)) or id(obj) in seen:
        return ("seen", type(obj).__name__)
    seen.add(id(obj))
    if isinstance(obj, KVCache):
        n = obj.cache_seqlens
        held = [np.asarray(a)[b, :, :n[b]] for b in range(len(n)) for a in (obj.k, obj.v)]
        return ("kv", tuple(n), [state_of(a) for a in held])
    if isinstance(obj, npattn.attention.Workspace):  # arrays free for reuse, holding nothing
        return ("workspace",)
    if isinstance(obj, dict):
        return ("dict", [(repr(k), state_of(v, seen)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [state_of(v, seen) for v in obj])
    if hasattr(obj, "__dict__"):
        return (type(obj).__name__, [(k, state_of(v, seen)) for k, v in sorted(vars(obj).items())])
    return ("other", type(obj).__name__)


def rnd(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape)


def mha(impl, need_weights):
    """A module with a cache, grads and a generator to keep; a forward (with a boolean mask
    that leaves a row fully masked, dropout drawn) to fail."""
    def start():
        kw = dict(block_q=2, block_k=3) if impl == "blocked" else {}
        m = npattn.MultiHeadAttention(D, H, dropout=0.25, n_kv_head=1, dtype="float64", seed=0,
                                      impl=impl, **kw)
        x, kv = rnd(1, (B, L, D)), rnd(2, (B, L + 1, D))
        mask = np.random.default_rng(3).random((B, 1, L, L + 1)) > 0.3
        mask[0, 0, 1] = False
        out, _ = m(x, kv, kv, mask=mask)
        m.backward(rnd(4, out.shape))
        m(rnd(5, (B, L, D)), kv, kv, mask=mask)
        return dict(m=m, x=x, kv=kv, mask=mask)

    def call(s):
        return s["m"](s["x"], s["kv"], s["kv"], mask=s["mask"], need_weights=need_weights)
    return start, call


def mha_backward():
    start, _ = mha("reference", False)
    return start, lambda s: s["m"].backward(rnd(6, (B, L, D)))


def mha_decoding():
    def start():
        m = npattn.MultiHeadAttention(D, H, dtype="float64", seed=0).eval()
        cache = m.new_cache(B, 6)
        x = rnd(1, (B, 2, D))
        m(x, x, x, kv_cache=cache)
        return dict(m=m, cache=cache, y=rnd(2, (B, 1, D)))
    return start, lambda s: s["m"](s["y"], s["y"], s["y"], kv_cache=s["cache"], need_weights=True)


def block(decoder, norm_first, what):
    def start():
        kind = TransformerDecoderBlock if decoder else TransformerBlock
        b = kind(D, H, 16, dropout=0.2, norm_first=norm_first, dtype="float64", seed=0)
        args = (rnd(1, (B, L, D)),) + ((rnd(2, (B, L + 1, D)),) if decoder else ())
        b(*args, is_causal=True)
        b.backward(rnd(3, (B, L, D)))
        b(rnd(4, (B, L, D)), *args[1:], is_causal=True)
        return dict(b=b, args=args, new={k: 0.5 * v for k, v in b.params.items()})

    def call(s):
        if what == "forward":
            return s["b"](*s["args"], is_causal=True)
        if what == "backward":
            return s["b"].backward(rnd(5, (B, L, D)))
        s["b"].params = s["new"]
    return start, call


def gpt(what):
    def start():
        g = GPT(VOCAB, T, D, 2, H, 16, dropout=0.2, dtype="float64", seed=0)
        ids = np.random.default_rng(1).integers(0, VOCAB, (B, L))
        tgt = np.random.default_rng(2).integers(0, VOCAB, (B, L))
        state = nn.adam_init(g.params)
        _, _, state = training_step(g, state, ids, tgt, lr=0.05)
        g(np.random.default_rng(3).integers(0, VOCAB, (B, L)))
        return dict(g=g, ids=ids, tgt=tgt, state=state, rng=np.random.default_rng(4))

    def call(s):
        if what == "training_step":
            return training_step(s["g"], s["state"], s["ids"], s["tgt"], lr=0.05)
        if what == "generate":
            return s["g"].generate(s["ids"][:, :2], 3, seed=s["rng"], top_k=4, return_logits=True)
        return s["g"].backward(rnd(5, (B, L, VOCAB)))
    return start, call


def gpt_decoding():
    def start():
        g = GPT(VOCAB, T, D, 2, H, 16, dtype="float64", seed=0).eval()
        caches = g.new_caches(B)
        g(np.random.default_rng(1).integers(0, VOCAB, (B, 2)), kv_caches=caches)
        return dict(g=g, caches=caches)
    return start, lambda s: s["g"](np.random.default_rng(2).integers(0, VOCAB, (B, 1)), kv_caches=s["caches"])


def classifier(what):
    def start():
        c = TransformerClassifier(4, L, 3, d_model=D, n_head=H, n_layers=2, d_ff=16, dropout=0.2,
                                  dtype="float64", seed=0)
        c(rnd(1, (B, L, 4)))
        c.backward(rnd(2, (B, 3)))
        c(rnd(3, (B, L, 4)))
        return dict(c=c, new={k: 0.5 * v for k, v in c.params.items()})

    def call(s):
        if what == "backward":
            return s["c"].backward(rnd(4, (B, 3)))
        s["c"].params = s["new"]
    return start, call


def flash_kvcache():
    """flash-attn's decoding step writes the new keys and values into the caller's caches, then
    attends: a failure after the write puts back what it overwrote."""
    def start():
        k_cache, v_cache = rnd(1, (B + 1, 6, 1, D)), rnd(2, (B + 1, 6, 1, D))
        return dict(q=rnd(3, (B, 2, H, D)), k_cache=k_cache, v_cache=v_cache,
                    k=rnd(4, (B, 2, 1, D)), v=rnd(5, (B, 2, 1, D)), seqlens=np.array([3, 0]))

    def call(s):
        return compat.flash_attn_with_kvcache(s["q"], s["k_cache"], s["v_cache"], s["k"], s["v"],
                                              cache_seqlens=s["seqlens"], causal=True,
                                              return_softmax_lse=True)
    return start, call


def flash_dropout(varlen):
    """flash-attn's forwards with dropout drawn from the caller's generator: one draw for the
    batch, or one per packed sequence; forming S_dmask (``return_attn_probs``) comes after."""
    def start():
        return dict(q=rnd(1, (B, L, H, D)), k=rnd(2, (B, L + 1, 1, D)), v=rnd(3, (B, L + 1, 1, D)),
                    rng=np.random.default_rng(4))

    def call(s):
        if not varlen:
            return compat.flash_attn_func(s["q"], s["k"], s["v"], dropout_p=0.3, causal=True,
                                          rng=s["rng"], return_attn_probs=True)
        q, k, v = (s[n].reshape((-1,) + s[n].shape[2:]) for n in "qkv")  # sequences of L, L + 1
        cu_q, cu_k = np.array([0, L, 2 * L], np.int32), np.array([0, L + 1, 2 * L + 2], np.int32)
        return compat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, L, L + 1, dropout_p=0.3,
                                             causal=True, rng=s["rng"], return_attn_probs=True)
    return start, call


def packed_and_jax_dropout(which):
    """A packed form and JAX's signature, with dropout: steps after the draw (the packed
    array's namespace, the residual's layout) may fail too."""
    def start():
        return dict(qkv=rnd(1, (B, L, 3, H, D)), rng=np.random.default_rng(4))

    def call(s):
        if which == "qkvpacked":
            return compat.flash_attn_qkvpacked_func(s["qkv"], dropout_p=0.3, causal=True,
                                                    rng=s["rng"], return_attn_probs=True)
        q, k, v = (s["qkv"][:, :, i] for i in range(3))
        return compat.dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True, rng=s["rng"],
                                            return_residual=True)
    return start, call


def dropout_layer(which):
    """The stateless layers with dropout drawn from the caller's generator, and steps after
    the draw (the second linear; the residual and the norm) that may fail."""
    def start():
        return dict(x=rnd(1, (B, L, D)), w1=rnd(2, (16, D)), b1=rnd(3, (16,)), w2=rnd(4, (D, 16)),
                    b2=rnd(5, (D,)), rng=np.random.default_rng(6))

    def call(s):
        if which == "ffn":
            return layers.feed_forward_forward(s["x"], s["w1"], s["b1"], s["w2"], s["b2"],
                                               dropout_p=0.3, rng=s["rng"])[0]
        return sublayer_forward(s["x"], lambda n: functional.linear_forward(n, s["w2"][:, :D], None),
                                norm_weight=s["b2"], norm_bias=s["b1"][:D], eps=1e-5,
                                norm_first=which == "pre-norm sublayer", dropout_p=0.3,
                                rng=s["rng"])[0]
    return start, call


CALLS = {
    "mha reference forward, weights": mha("reference", True),
    "mha blocked forward": mha("blocked", False),
    "mha backward": mha_backward(),
    "mha decoding, weights": mha_decoding(),
    "encoder post-norm forward": block(False, False, "forward"),
    "decoder pre-norm backward": block(True, True, "backward"),
    "decoder params assignment": block(True, False, "params"),
    "gpt training_step": gpt("training_step"),
    "gpt generate": gpt("generate"),
    "gpt backward": gpt("backward"),
    "encoder pre-norm backward": block(False, True, "backward"),
    "gpt decoding": gpt_decoding(),
    "classifier backward": classifier("backward"),
    "classifier params assignment": classifier("params"),
    "flash_attn_with_kvcache with new keys": flash_kvcache(),
    "flash_attn_func with dropout": flash_dropout(False),
    "flash_attn_varlen_func with dropout": flash_dropout(True),
    "flash_attn_qkvpacked_func with dropout": packed_and_jax_dropout("qkvpacked"),
    "dot_product_attention with dropout": packed_and_jax_dropout("jax"),
    "feed_forward_forward with dropout": dropout_layer("ffn"),
    "post-norm sublayer_forward with dropout": dropout_layer("post-norm sublayer"),
    "pre-norm sublayer_forward with dropout": dropout_layer("pre-norm sublayer"),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_a_call_failing_at_any_step_changes_nothing(steps, name):
    start, call = CALLS[name]
    s = start()
    steps.count, steps.armed = 0, True
    call(s)
    steps.armed = False
    n = steps.count
    assert n > 10, f"{name}: only {n} steps counted"
    tried = sorted({1, n} | {1 + (n - 1) * i // (STEPS - 1) for i in range(STEPS)})
    for k in tried:
        s = start()
        before = state_of(s)
        steps.count, steps.fail_at, steps.armed = 0, k, True
        try:
            with pytest.raises(MemoryError, match=f"^step {k}$"):
                call(s)
        finally:
            steps.armed, steps.fail_at = False, None
        assert state_of(s) == before, f"{name}: the state changed when step {k} of {n} failed"
        twin = start()
        assert state_of(call(s)) == state_of(call(twin)), f"{name}: the call after step {k} failed"
        assert state_of(s) == state_of(twin), f"{name}: the state after the call after step {k} failed"
