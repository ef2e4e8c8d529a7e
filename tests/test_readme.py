"""The README's quickstart runs, and CI runs the README's test command."""

import pathlib
import re

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _quickstart():
    (quickstart,) = [b for b in _blocks("python") if "npattn.MultiHeadAttention" in b][:1]
    return quickstart


def test_quickstart_runs(capsys):
    exec(compile(_quickstart(), "README quickstart", "exec"), {})
    assert capsys.readouterr().out.strip() == "(2, 5, 16) (2, 5, 5) (16, 16)"


def test_quickstart_prints_what_its_comment_says(capsys):
    # the comment on the print line quotes the output: it must be what a reader gets
    (line,) = [ln for ln in _quickstart().splitlines() if ln.startswith("print(")]
    quoted = line.split("#", 1)[1].strip()
    exec(compile(_quickstart(), "README quickstart", "exec"), {})
    assert capsys.readouterr().out.strip() == quoted


def test_quickstart_dx_is_the_gradient_of_the_self_attention():
    # "dout = dL/dout" and "self-attention: sum the three": dx is the gradient of
    # <out(x), dout> with respect to x, checked by central differences in one random direction
    ns = {}
    exec(compile(_quickstart(), "README quickstart", "exec"), ns)
    rng = np.random.default_rng(0)  # the quickstart's draws, in its order: x, then dout
    x = rng.standard_normal((2, 5, 16))
    dout = rng.standard_normal((2, 5, 16))
    np.testing.assert_array_equal(x, ns["x"])
    mha, dx = ns["mha"], ns["dx"]

    def loss(x):
        return float(np.sum(mha(x, x, x, is_causal=True)[0] * dout))

    t, eps = np.random.default_rng(1).standard_normal(x.shape), 1e-6
    numeric = (loss(x + eps * t) - loss(x - eps * t)) / (2 * eps)
    assert abs(numeric - np.sum(dx * t)) <= 1e-7 * max(1.0, abs(numeric))
    # the causal mask: the first query attends only itself, weights [1, 0, 0, 0, 0]
    np.testing.assert_allclose(ns["weights"][:, 0], np.eye(5)[[0, 0]], atol=0)
    np.testing.assert_allclose(ns["weights"].sum(axis=-1), 1.0, rtol=1e-12)
    # "weights ... averaged over the heads, (B, Lq, Lk), unless average_attn_weights=False
    # gives them per head, (B, H, Lq, Lk)"
    _, per_head = mha(x, x, x, is_causal=True, need_weights=True, average_attn_weights=False)
    assert per_head.shape == (2, 4, 5, 5)
    np.testing.assert_allclose(ns["weights"], per_head.mean(axis=1), rtol=1e-12, atol=1e-15)
    assert not np.allclose(per_head[:, 0], per_head[:, 1])  # heads that differ: a mean to take


def test_the_errors_section_holds():
    # "Errors and edge cases": the quoted message, the table's examples, and "a call that
    # fails changes nothing"
    import pytest

    import npattn
    from npattn import masks

    section = README.split("## Errors and edge cases", 1)[1]
    quoted = re.search(r"for example\n`([^`]+)`", section).group(1)
    assert quoted.startswith("key: expected dtype float32")
    mha = npattn.MultiHeadAttention(8, 2, seed=0)  # float32 by default
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    out, _ = mha(x, x, x)
    params = {k: v.copy() for k, v in mha.params.items()}
    with pytest.raises(TypeError) as info:
        mha(x, x.astype(np.float64), x)
    assert str(info.value).startswith(quoted)
    # a non-bool flag (train("no") included) is a TypeError naming the flag, and changes nothing
    for flag in ("is_causal", "need_weights", "average_attn_weights", "check_finite"):
        with pytest.raises(TypeError, match=rf"^{flag}: expected a bool, got str 'no'"):
            mha(x, x, x, **{flag: "no"})
    with pytest.raises(TypeError, match="expected a bool"):
        mha.train("no")
    assert mha.training and all(np.array_equal(mha.params[k], params[k]) for k in params)
    dout = np.random.default_rng(1).standard_normal(out.shape).astype(np.float32)
    first = mha.backward(dout)  # the cache is still the first forward's: the same gradients
    mha(x, x, x)
    assert all(np.array_equal(a, b) for a, b in zip(first, mha.backward(dout)))
    # check_finite=True: NaN or inf in an input, NaN or +inf in a floating mask is a ValueError;
    # -inf in the mask is a masked entry
    bad = x.copy()
    bad[1, 2, 3] = np.nan
    with pytest.raises(ValueError, match="^value"):
        mha(x, x, bad, check_finite=True)
    mask = np.zeros((3, 3), dtype=np.float32)
    mask[0, 1] = -np.inf
    mha(x, x, x, mask=mask, check_finite=True)
    mask[2, 0] = np.inf
    with pytest.raises(ValueError, match="^mask"):
        mha(x, x, x, mask=mask, check_finite=True)
    with pytest.raises(ValueError):
        npattn.MultiHeadAttention(2**32, 1)
    with pytest.raises(ValueError):
        masks.causal(2**40, 2**40)
    with pytest.raises(RuntimeError):
        npattn.MultiHeadAttention(8, 2).backward(np.ones((2, 3, 8), dtype=np.float32))


def test_ci_runs_the_readme_test_command():
    section = README.split("## Running the tests", 1)[1]
    command = re.search(r"```bash\n(.*?)\n```", section, flags=re.S).group(1).strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci.splitlines(), f"{command!r} is not a line of .ci/run"
