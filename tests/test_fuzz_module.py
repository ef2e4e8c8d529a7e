"""A stateful fuzz test: random sequences of valid and invalid calls on one module.

Only the documented exceptions may come out (TypeError and ValueError for bad
arguments, RuntimeError for backward before forward); an IndexError,
AssertionError, AttributeError or any other exception fails the test, as does
a NaN in an output or a gradient. Each refusal names the argument
("query: expected ..., got ..."), not an array inside the computation (a ``v`` or an
``x`` the caller never passed). A failed call leaves the module as it was and usable.
"""

import importlib.util
import re

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from npattn import MultiHeadAttention
from npattn.backend import from_numpy, resolve_backend, to_numpy

BACKENDS = [n for n in ("numpy", "array_api_strict", "torch") if importlib.util.find_spec(n)]
DOCUMENTED = (TypeError, ValueError)
#: the argument each forward corruption must be refused by name
NAMED = {
    "query 2-D": "query", "key batch": "key", "value length": "value", "query width": "query",
    "key width": "key", "value width": "value", "dtype": "value", "int mask": "mask",
    "3-D mask": "mask", "mask shape": "mask", "float keep mask": "dropout_mask",
    "keep shape": "dropout_mask", "nan checked": "key", "list": "query", "empty": "query",
    "flag": "is_causal", "mask dtype": "mask", "other backend": "query", "other mask": "mask",
}


def _finite(a):
    return bool(np.all(np.isfinite(to_numpy(a).astype(np.float64))))


class ModuleMachine(RuleBasedStateMachine):
    @initialize(
        backend=st.sampled_from(BACKENDS),
        n_head=st.sampled_from([1, 2]),
        head_dim=st.sampled_from([2, 3]),
        kdim=st.sampled_from([None, 5]),
        vdim=st.sampled_from([None, 3]),
        dtype=st.sampled_from(["float64", "float32"]),
        dropout=st.sampled_from([0.0, 0.3]),
        bias=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def setup(self, backend, n_head, head_dim, kdim, vdim, dtype, dropout, bias, seed):
        D = n_head * head_dim
        self.m = MultiHeadAttention(D, n_head, kdim=kdim, vdim=vdim, dtype=dtype,
                                    dropout=dropout, bias=bias, seed=seed, backend=backend)
        self.xp = self.m.xp
        self.np_dtype = np.dtype(dtype)
        self.other = resolve_backend("numpy" if backend != "numpy" else BACKENDS[-1])
        self.rng = np.random.default_rng(seed)
        self.shapes = {n: tuple(p.shape) for n, p in self.m.params.items()}
        self.out_shape = None  # shape of the last successful forward's output

    # ------------------------------------------------------------ helpers

    def _arr(self, shape, xp=None, dtype=None, scale=1.0):
        a = (scale * self.rng.standard_normal(shape)).astype(dtype or self.np_dtype)
        return from_numpy(a, xp or self.xp)

    def _inputs(self, B, Lq, Lk):
        m = self.m
        return (self._arr((B, Lq, m.d_model)), self._arr((B, Lk, m.kdim)),
                self._arr((B, Lk, m.vdim)))

    def _expect_failure(self, call, name, exceptions=DOCUMENTED, match=None):
        """``call`` must raise one of ``exceptions`` with a message that names ``name``, says what
        was expected and what it got (or matches ``match``), and change nothing."""
        cache, params, training = self.m._cache, dict(self.m.params), self.m.training
        rng_state = self.m._rng.bit_generator.state
        pattern = match or rf"^{re.escape(name)}: expected .+, got "
        try:
            call()
        except exceptions as e:
            assert re.search(pattern, str(e), re.DOTALL), f"{pattern!r} not in {type(e).__name__}: {e}"
        else:
            raise AssertionError("a bad call did not raise")
        assert self.m._cache is cache and self.m.training == training
        assert all(self.m.params[n] is p for n, p in params.items())
        assert self.m._rng.bit_generator.state == rng_state

    # ------------------------------------------------------------ forward

    @rule(
        B=st.integers(1, 2), Lq=st.integers(1, 4), Lk=st.integers(1, 4),
        mask_kind=st.sampled_from(["none", "bool", "additive"]),
        mask_shape=st.sampled_from(["LqLk", "11LqLk", "B1LqLk", "B11Lk", "BHLqLk"]),
        is_causal=st.booleans(), need_weights=st.booleans(), keep=st.booleans(),
        check_finite=st.booleans(), average=st.booleans(),
    )
    def forward_valid(self, B, Lq, Lk, mask_kind, mask_shape, is_causal, need_weights, keep,
                      check_finite, average):
        H = self.m.n_head
        shape = {"LqLk": (Lq, Lk), "11LqLk": (1, 1, Lq, Lk), "B1LqLk": (B, 1, Lq, Lk),
                 "B11Lk": (B, 1, 1, Lk), "BHLqLk": (B, H, Lq, Lk)}[mask_shape]
        mask = None
        if mask_kind != "none":
            allowed = self.rng.random(shape) > 0.4  # fully masked rows happen
            if mask_kind == "bool":
                mask = from_numpy(allowed, self.xp)
            else:
                add = np.where(allowed, self.rng.standard_normal(shape), -np.inf)
                mask = from_numpy(add.astype(self.np_dtype), self.xp)
        dropout_mask = from_numpy(self.rng.random((B, H, Lq, Lk)) > 0.3, self.xp) if keep else None
        out, w = self.m(*self._inputs(B, Lq, Lk), mask=mask, is_causal=is_causal,
                        dropout_mask=dropout_mask, need_weights=need_weights,
                        check_finite=check_finite, average_attn_weights=average)
        assert tuple(out.shape) == (B, Lq, self.m.d_model)
        assert out.dtype == self.m.dtype
        assert _finite(out)
        assert (w is not None) == need_weights
        if w is not None and not average:
            assert tuple(w.shape) == (B, H, Lq, Lk) and _finite(w)
            sums = to_numpy(w).astype(np.float64).sum(-1)
            assert np.all((np.abs(sums - 1.0) < 1e-4) | (sums == 0.0))
        elif w is not None:  # the mean over heads: rows sum to (heads with a key to attend) / H
            assert tuple(w.shape) == (B, Lq, Lk) and _finite(w)
            sums = to_numpy(w).astype(np.float64).sum(-1) * H
            assert np.all(np.abs(sums - np.round(sums)) < 1e-4 * H)
        self.out_shape = (B, Lq, self.m.d_model)

    @rule(corruption=st.sampled_from([
        "query 2-D", "key batch", "value length", "query width", "key width", "value width",
        "dtype", "int mask", "3-D mask", "mask shape", "float keep mask", "keep shape",
        "nan checked", "list", "empty", "flag", "mask dtype", "other backend", "other mask",
    ]))
    def forward_invalid(self, corruption):
        m, xp = self.m, self.xp
        B, Lq, Lk = 2, 3, 4
        q, k, v = self._inputs(B, Lq, Lk)
        kw = {}
        other_dtype = np.float32 if self.np_dtype == np.float64 else np.float64
        if corruption == "query 2-D":
            q = q[0, ...]
        elif corruption == "key batch":
            k = k[:1, ...]
        elif corruption == "value length":
            v = v[:, :2, :]
        elif corruption == "query width":
            q = self._arr((B, Lq, m.d_model + 1))
        elif corruption == "key width":
            k = self._arr((B, Lk, m.kdim + 1))
        elif corruption == "value width":
            v = self._arr((B, Lk, m.vdim + 2))
        elif corruption == "dtype":
            v = self._arr((B, Lk, m.vdim), dtype=other_dtype)
        elif corruption == "int mask":
            kw["mask"] = from_numpy(np.ones((Lq, Lk), dtype=np.int32), xp)
        elif corruption == "3-D mask":
            # (H, Lq, Lk) would broadcast silently as (1, H, Lq, Lk): still refused
            kw["mask"] = from_numpy(np.ones((m.n_head, Lq, Lk), dtype=bool), xp)
        elif corruption == "mask shape":
            kw["mask"] = from_numpy(np.ones((Lk, Lq), dtype=bool), xp)
        elif corruption == "mask dtype":
            kw["mask"] = self._arr((Lq, Lk), dtype=other_dtype)
        elif corruption == "float keep mask":
            kw["dropout_mask"] = self._arr((Lq, Lk))
        elif corruption == "keep shape":
            kw["dropout_mask"] = from_numpy(np.ones((B + 1, 1, Lq, Lk), dtype=bool), xp)
        elif corruption == "nan checked":
            h = to_numpy(k)
            h[0, 0, 0] = np.nan
            k = from_numpy(h, xp)
            kw["check_finite"] = True
        elif corruption == "list":
            q = to_numpy(q).tolist()
        elif corruption == "empty":
            q = q[:, :0, :]
        elif corruption == "flag":
            kw["is_causal"] = "no"
        elif corruption == "other backend":
            q = from_numpy(to_numpy(q), self.other)
        elif corruption == "other mask":
            kw["mask"] = from_numpy(np.ones((Lq, Lk), dtype=bool), self.other)
        self._expect_failure(lambda: m(q, k, v, **kw), NAMED[corruption])

    # ----------------------------------------------------------- backward

    @precondition(lambda self: self.out_shape is not None)
    @rule(readonly=st.booleans())
    def backward_valid(self, readonly):
        d = self.rng.standard_normal(self.out_shape).astype(self.np_dtype)
        if readonly and self.xp.__name__.endswith("numpy"):
            d.setflags(write=False)
        grads = self.m.backward(from_numpy(d, self.xp))
        B, Lq, _ = self.out_shape
        assert tuple(grads[0].shape) == (B, Lq, self.m.d_model)
        assert tuple(grads[1].shape)[::2] == (B, self.m.kdim)
        assert tuple(grads[2].shape)[::2] == (B, self.m.vdim)
        assert set(self.m.grads) == set(self.m.params)
        for n, g in self.m.grads.items():
            assert tuple(g.shape) == self.shapes[n] and g.dtype == self.m.dtype
        assert all(_finite(g) for g in (*grads, *self.m.grads.values()))

    @rule(kind=st.sampled_from(["shape", "dtype", "other backend", "list"]))
    def backward_invalid(self, kind):
        if self.out_shape is None:
            self._expect_failure(lambda: self.m.backward(self._arr((1, 1, self.m.d_model))),
                                 "backward", RuntimeError, match="^backward: expected a forward call first")
            return
        shape = self.out_shape
        other_dtype = np.float32 if self.np_dtype == np.float64 else np.float64
        d = {
            "shape": lambda: self._arr((shape[0], shape[1] + 1, shape[2])),
            "dtype": lambda: self._arr(shape, dtype=other_dtype),
            "other backend": lambda: self._arr(shape, xp=self.other),
            "list": lambda: np.zeros(shape).tolist(),
        }[kind]()
        grads_before = dict(self.m.grads)
        self._expect_failure(lambda: self.m.backward(d), "dout")
        assert all(self.m.grads[n] is g for n, g in grads_before.items())

    # ------------------------------------------------------ mode, params

    @rule(mode=st.booleans())
    def set_mode(self, mode):
        (self.m.train() if mode else self.m.eval())
        assert self.m.training is mode

    @rule(name=st.sampled_from(["w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"]),
          kind=st.sampled_from(["valid", "valid", "shape", "dtype", "other backend", "unknown",
                                "list", "delete", "replace all"]))
    def assign_param(self, name, kind):
        m = self.m
        if name not in m.params:  # no biases
            self._expect_failure(lambda: m.params.__setitem__(name, self._arr((m.d_model,))), "params")
            return
        shape = self.shapes[name]
        other_dtype = np.float32 if self.np_dtype == np.float64 else np.float64
        if kind == "valid":
            new = self._arr(shape, scale=0.3)
            m.params[name] = new
            assert m.params[name] is new
            return
        if kind == "replace all":
            new = dict(m.params)
            new.pop(name)
            self._expect_failure(lambda: setattr(m, "params", new), "params")
            return
        if kind == "delete":
            self._expect_failure(lambda: m.params.pop(name), "params",
                                 match=rf"^params: expected every parameter to stay \(the names are "
                                       rf"fixed: .*\), got params.pop\({name!r}\); parameters cannot be "
                                       rf"removed")
            return
        bad = {
            "shape": lambda: self._arr(shape[:-1] + (shape[-1] + 1,)),
            "dtype": lambda: self._arr(shape, dtype=other_dtype),
            "other backend": lambda: self._arr(shape, xp=self.other),
            "unknown": lambda: self._arr(shape),
            "list": lambda: np.zeros(shape).tolist(),
        }[kind]()
        key = name + "_x" if kind == "unknown" else name
        self._expect_failure(lambda: m.params.__setitem__(key, bad),
                             "params" if kind == "unknown" else f"params[{name!r}]")

    # ---------------------------------------------------------- invariant

    @invariant()
    def params_intact(self):
        if not hasattr(self, "m"):
            return
        assert isinstance(self.m.params, dict)
        assert {n: tuple(p.shape) for n, p in self.m.params.items()} == self.shapes
        for p in self.m.params.values():
            assert p.dtype == self.m.dtype and _finite(p)


TestModuleMachine = ModuleMachine.TestCase
TestModuleMachine.settings = settings(
    settings.default,
    max_examples=min(settings.default.max_examples, 20),
    stateful_step_count=12,
    deadline=None,
)
