"""npattn.tools.audit: each configuration of the panel is what its name says, and the report
(table, summary line, JSON) says what the rows say."""

import numpy as np
import pytest

from npattn import attention as A
from npattn.backend import namespace
from npattn.tools import audit


def _sdpa_arguments(check, dtype, monkeypatch):
    """The arguments of the first (outermost) ``attention.sdpa_forward`` or
    ``functional.sdpa_forward`` call that one forward of ``check`` makes, with the shapes of
    q and k; plus the check's input names."""
    from npattn import functional as F

    calls = []

    def recording(original):
        def sdpa_forward(q, k, v, **kw):
            calls.append(dict(kw, q_shape=tuple(q.shape), k_shape=tuple(k.shape)))
            return original(q, k, v, **kw)

        return sdpa_forward

    monkeypatch.setattr(A, "sdpa_forward", recording(A.sdpa_forward))
    monkeypatch.setattr(F, "sdpa_forward", recording(F.sdpa_forward))
    xp = namespace(np.zeros(1))
    args = (xp, getattr(xp, dtype), np.random.default_rng(0))
    fwd, _, inputs, names = check.build(*args) if check.impl is None else check.build(
        *args, impl=check.impl)
    fwd(*inputs)
    monkeypatch.undo()
    assert calls, check.name
    return calls[0], names


def _attends_nothing(mask):
    """True where a row of ``mask`` (bool: True = may attend, or additive float) has no key."""
    m = np.asarray(mask)
    return np.all(~m if m.dtype == bool else np.isneginf(m), axis=-1)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_each_attention_configuration_is_what_its_name_says(monkeypatch, dtype):
    """The panel's names are its coverage claims (docs/check.md lists them): a configuration
    named causal runs causal, one with dropout drops with a fixed keep-mask that drops
    something, one with sinks has sinks, a cross or Lq != Lk one has different lengths, a
    fully masked row is in the mask that reaches attention (the module's mask is no input of
    the check, so test_cli's look at the inputs does not see it), in float32 as in float64
    (where the module audited is a second one, built for float32)."""
    seen = 0
    for c in audit.panel("numpy"):
        if not c.name.startswith(("sdpa", "mha")):
            continue
        kw, names = _sdpa_arguments(c, dtype, monkeypatch)
        name, (Lq, Lk) = c.name, (kw["q_shape"][-2], kw["k_shape"][-2])
        mask = kw.get("mask")
        if "causal" in name:
            assert kw.get("is_causal") is True, name
        if "dropout" in name:
            keep = kw.get("dropout_mask")
            assert kw.get("dropout_p", 0.0) > 0.0 and keep is not None, name
            assert not np.all(np.asarray(keep)), name
        if "sinks" in name:
            sinks = kw.get("sinks")
            assert sinks is not None and "sinks" in names, name
        if "GQA" in name:
            assert kw["q_shape"][1] != kw["k_shape"][1] and kw.get("enable_gqa"), name
        if "Lq!=Lk" in name or "cross" in name:
            assert Lq != Lk, name
        if "Lq > Lk" in name:
            assert Lq > Lk, name
        if "no mask" in name:
            assert mask is None, name
        if "float mask" in name:
            assert mask is not None and np.asarray(mask).dtype.kind == "f", name
        if "bool" in name:
            assert mask is not None and np.asarray(mask).dtype == bool, name
        if "fully masked row" in name:
            assert np.any(_attends_nothing(mask)), name
        if "bottom-right" in name:
            assert kw.get("align") == "bottom_right", name
        if "segments" in name:  # and a query whose segment has no key
            qs, ks = np.asarray(kw["q_segments"]), np.asarray(kw["k_segments"])
            assert np.any(~np.isin(qs, ks)), name
        if c.kind == "module":
            assert ("b_q" in names) == ("no bias" not in name), name
        seen += 1
    assert seen >= 30
