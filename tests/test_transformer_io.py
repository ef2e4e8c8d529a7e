"""The Transformer blocks: copy, pickle, save / load, and half precision.

Copies and files are checked against what the original holds and does, read
independently of the code under test: parameters taken to the host before the
copy, the ``.npz`` file opened with plain ``np.load``, and the original's own
next forward and backward (dropout p > 0 from the generator) as the value the
copy's must equal bit for bit.

Half precision (float16; bfloat16 where the backend has it, torch) is checked
against the float64 block with the same parameters, inputs and keep-masks,
each rounded to the half dtype first, so the two differ only by the half
block's arithmetic. The bound comes from the dtype's unit roundoff
``u = eps / 2`` and a count of roundings (see ``forward_roundings``).
"""

import copy
import io
import json
import pickle
import re
import types

import numpy as np
import pytest

from npattn import MultiHeadAttention
from npattn.transformer import (
    CONFIG_KEYS,
    DECODER_DROPOUT_SITES,
    ENCODER_DROPOUT_SITES,
    SAVE_VERSION,
    TransformerBlock,
    TransformerDecoderBlock,
)

B, L, LM, D, H, FF = 2, 6, 5, 16, 4, 32
BLOCKS = {"encoder": TransformerBlock, "decoder": TransformerDecoderBlock}


def host64(a):
    """A float64 host copy of a backend array (torch's bfloat16 included); None stays None."""
    if a is None:
        return None
    if hasattr(a, "detach"):  # torch: bfloat16 has no NumPy form
        return a.detach().cpu().double().numpy()
    from npattn.backend import to_numpy

    return np.asarray(to_numpy(a)).astype(np.float64)


def host(a):
    """A host copy in the array's own dtype (bfloat16 widened to float32, exactly)."""
    if hasattr(a, "detach"):
        a = a.detach().cpu()
        return (a.float() if str(a.dtype) == "torch.bfloat16" else a).numpy().copy()
    from npattn.backend import to_numpy

    return np.asarray(to_numpy(a))


def make_block(kind, backend, **kw):
    kw = dict(dict(dropout=0.3, dtype="float64", seed=3, backend=backend), **kw)
    return BLOCKS[kind](D, H, FF, **kw)


def inputs(kind, rng):
    """Host float64 inputs of one step: x, memory (decoder), the masks, dout."""
    pad = np.ones((B, 1, 1, L), dtype=bool)
    pad[1, ..., L - 2:] = False  # entry 1: the last two keys are padding
    out = {"x": rng.standard_normal((B, L, D)), "mask": pad, "dout": rng.standard_normal((B, L, D))}
    if kind == "decoder":
        mpad = np.ones((B, 1, 1, LM), dtype=bool)
        mpad[0, ..., LM - 1:] = False
        out.update(memory=rng.standard_normal((B, LM, D)), memory_mask=mpad)
    return out


def step(block, arrays, convert, dropout_masks=None, dtypes=None):
    """One forward (causal, padding mask) and backward: everything it returns or fills, on the host.

    ``dtypes``, a dict, receives each result's dtype on the backend.
    """
    a = {k: convert(v) for k, v in arrays.items()}
    if isinstance(block, TransformerDecoderBlock):
        out = block(a["x"], a["memory"], mask=a["mask"], memory_mask=a["memory_mask"], is_causal=True,
                    dropout_masks=dropout_masks)
        dx, dmemory = block.backward(a["dout"])
        res = {"out": out, "dx": dx, "dmemory": dmemory}
    else:
        out = block(a["x"], mask=a["mask"], is_causal=True, dropout_masks=dropout_masks)
        res = {"out": out, "dx": block.backward(a["dout"])}
    res.update({"grad " + k: g for k, g in block.grads.items()})
    if dtypes is not None:
        dtypes.update({k: v.dtype for k, v in res.items()})
    return {k: host(v) for k, v in res.items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def as_xp(xp, dtype=None):
    from npattn.backend import from_numpy

    def convert(a):
        x = from_numpy(np.asarray(a), xp)
        return x if dtype is None or a.dtype == bool else xp.astype(x, dtype)

    return convert


COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m))}


# --------------------------------------------------------------------------
# copy and pickle


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_copy_is_identical_and_independent(backend, xp, kind, how):
    m = make_block(kind, backend, norm_first=True, activation="gelu_tanh")
    arrays = inputs(kind, np.random.default_rng(0))
    convert = as_xp(xp)
    step(m, arrays, convert)  # grads and a cache exist; the generator has advanced
    params = {k: host(v) for k, v in m.params.items()}
    grads = {k: host(v) for k, v in m.grads.items()}
    c = COPIES[how](m)

    assert type(c) is type(m) and c.xp is m.xp and c.dtype == m.dtype and repr(c) == repr(m)
    assert c.training and list(c.params) == list(m.params)
    assert c.self_attn is not m.self_attn and c.self_attn.xp is m.xp
    for k in params:
        np.testing.assert_array_equal(host(c.params[k]), params[k], err_msg=k)
        np.testing.assert_array_equal(host(c.grads[k]), grads[k], err_msg=k)
    with pytest.raises(RuntimeError, match="forward"):  # the cache (activations) is not copied
        c.backward(convert(arrays["dout"]))

    # the same dropout stream: the next step is bit for bit the original's ...
    first_m, first_c = step(m, arrays, convert), step(c, arrays, convert)
    assert_same(first_m, first_c)
    # ... and the copy's generator is its own: c steps twice, then m catches up
    second_c = step(c, arrays, convert)
    assert not np.array_equal(second_c["out"], first_c["out"])  # dropout acts (p = 0.3)
    step(c, arrays, convert)
    assert_same(step(m, arrays, convert), second_c)

    # the parameters and the mode are the copy's own
    before = host(m.params["linear1.weight"])
    new = dict(c.params)
    new["linear1.weight"] = convert(np.zeros((FF, D)))
    new["self_attn.w_q"] = convert(np.zeros((D, D)))
    c.params = new
    np.testing.assert_array_equal(host(m.params["linear1.weight"]), before)
    assert not np.all(host(m.params["self_attn.w_q"]) == 0.0)
    c.eval()
    assert m.training and m.self_attn.training and not c.self_attn.training
    with pytest.raises(ValueError, match="linear1.weight"):  # assignments to the copy are still checked
        c.params = {**new, "linear1.weight": convert(np.zeros((FF, D + 1)))}


def test_copy_of_an_unnamed_namespace_is_a_type_error():
    import array_api_compat.numpy as compat_np

    ns = types.ModuleType("npattn_test_unimportable_namespace")
    ns.__dict__.update({k: v for k, v in vars(compat_np).items() if not k.startswith("__")})
    block = TransformerBlock(4, 2, 8, backend=ns, seed=0)
    for copier in COPIES.values():
        with pytest.raises(TypeError, match="backend.*npattn_test_unimportable_namespace"):
            copier(block)


# --------------------------------------------------------------------------
# save / load


VARIANTS = {
    "defaults": {},
    "pre-norm, gelu_tanh, no bias": dict(norm_first=True, activation="gelu_tanh", bias=False,
                                         layer_norm_eps=1e-6),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_save_load_round_trip(backend, xp, tmp_path, kind, dtype, variant):
    m = make_block(kind, backend, dtype=dtype, **VARIANTS[variant])
    arrays = inputs(kind, np.random.default_rng(1))
    convert = as_xp(xp, m.dtype)
    step(m, arrays, convert)  # the generator has advanced: load restores that state
    params = {k: host(v) for k, v in m.params.items()}
    path = tmp_path / "block"  # no .npz suffix: written at exactly this name
    m.save(path)
    assert path.exists() and not (tmp_path / "block.npz").exists()

    # the file, read without npattn: one JSON header and one array per parameter, bit for bit
    with np.load(path, allow_pickle=False) as npz:
        header = json.loads(str(npz["config"]))
        assert sorted(npz.files) == sorted(["config", *("param/" + k for k in params)])
        for k, a in params.items():
            assert npz["param/" + k].dtype == np.dtype(dtype)
            np.testing.assert_array_equal(npz["param/" + k], a, err_msg=k)
    assert header["format"] == type(m).SAVE_FORMAT == f"npattn.{type(m).__name__}"
    assert header["format_version"] == SAVE_VERSION == 1 and header["training"] is True
    expected_config = dict(d_model=D, n_head=H, d_ff=FF, dropout=0.3, activation="relu",
                           norm_first=False, layer_norm_eps=1e-5, bias=True, dtype=dtype)
    expected_config.update(VARIANTS[variant])
    assert header["config"] == expected_config and tuple(header["config"]) == CONFIG_KEYS

    r = type(m).load(path, backend=backend)
    assert type(r) is type(m) and repr(r) == repr(m) and r.training and r.xp is m.xp
    for k, a in params.items():
        assert r.params[k].dtype == m.params[k].dtype
        np.testing.assert_array_equal(host(r.params[k]), a, err_msg=k)
    # the next step in training mode (dropout p = 0.3 from the generator) is the original's
    assert_same(step(r, arrays, convert), step(m, arrays, convert))

    m.eval().save(path)  # overwrites; eval mode is kept
    r = type(m).load(path, backend=backend)
    assert not r.training and not r.self_attn.training


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_load_onto_another_backend(backend, xp, kind):
    m = make_block(kind, "numpy")
    arrays = inputs(kind, np.random.default_rng(2))
    step(m, arrays, as_xp(np))
    buf = io.BytesIO()
    m.save(buf)
    buf.seek(0)
    r = type(m).load(buf, backend=backend)
    assert r.xp is xp
    for k, a in m.params.items():
        np.testing.assert_array_equal(host(r.params[k]), a, err_msg=k)
    # the same keep-masks on every backend: the next steps agree to float64 rounding
    ours, theirs = step(r, arrays, as_xp(xp)), step(m, arrays, as_xp(np))
    for k in theirs:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-11, atol=1e-12, err_msg=k)

    buf = io.BytesIO()  # and back: saved on this backend, loaded on numpy
    r.save(buf)
    buf.seek(0)
    back = type(m).load(buf)
    for k in m.params:
        np.testing.assert_array_equal(back.params[k], host(r.params[k]), err_msg=k)


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_save_load_bfloat16_on_torch(tmp_path, kind):
    torch = pytest.importorskip("torch")
    m = make_block(kind, "torch", dtype="bfloat16")
    m.save(tmp_path / "bf16.npz")
    with np.load(tmp_path / "bf16.npz", allow_pickle=False) as npz:
        assert npz["param/linear1.weight"].dtype == np.float32  # float32 holds bfloat16 exactly
    r = type(m).load(tmp_path / "bf16.npz", backend="torch")
    for k in m.params:
        assert r.params[k].dtype == torch.bfloat16 and torch.equal(r.params[k], m.params[k]), k
    with pytest.raises(ValueError, match="bfloat16"):  # NumPy has none: the constructor says so
        type(m).load(tmp_path / "bf16.npz", backend="numpy")


def _rewrite(src, dst, edit):
    with np.load(src, allow_pickle=False) as npz:
        entries = {n: npz[n] for n in npz.files}
    edit(entries)
    with open(dst, "wb") as f:
        np.savez(f, **entries)
    return dst


def _edit_header(**changes):
    def edit(entries):
        header = json.loads(str(entries["config"]))
        for k, v in changes.items():
            if k.startswith("config."):
                if v is None:
                    header["config"].pop(k[7:])
                else:
                    header["config"][k[7:]] = v
            else:
                header[k] = v
        entries["config"] = np.array(json.dumps(header))

    return edit


def test_load_rejects_files_of_another_kind(tmp_path):
    enc, dec, mha = tmp_path / "enc.npz", tmp_path / "dec.npz", tmp_path / "mha.npz"
    make_block("encoder", "numpy").save(enc)
    make_block("decoder", "numpy").save(dec)
    MultiHeadAttention(D, H, seed=0).save(mha)
    cases = [
        (TransformerBlock, mha, ["'npattn.TransformerBlock'", "'npattn.MultiHeadAttention'"]),
        (TransformerDecoderBlock, mha, ["'npattn.TransformerDecoderBlock'", "'npattn.MultiHeadAttention'"]),
        (TransformerDecoderBlock, enc, ["'npattn.TransformerDecoderBlock'", "'npattn.TransformerBlock'"]),
        (TransformerBlock, dec, ["'npattn.TransformerBlock'", "'npattn.TransformerDecoderBlock'"]),
        (MultiHeadAttention, enc, ["'npattn.MultiHeadAttention'", "'npattn.TransformerBlock'"]),
    ]
    for cls, path, fragments in cases:
        with pytest.raises(ValueError) as info:
            cls.load(path)
        msg = str(info.value)
        assert "expected format" in msg and str(path) in msg, msg
        for fragment in fragments:
            assert fragment in msg, f"{cls.__name__} <- {path.name}: {fragment} not in {msg}"


def test_load_rejects_foreign_and_corrupt_files(tmp_path):
    good = tmp_path / "good.npz"
    make_block("decoder", "numpy").save(good)
    cases = {
        "future version": (_edit_header(format_version=SAVE_VERSION + 1),
                           ("format_version", f"expected format_version {SAVE_VERSION}", str(SAVE_VERSION + 1))),
        "config key missing": (_edit_header(**{"config.activation": None}),
                               ("configuration keys", "missing ['activation']")),
        "config key unexpected": (_edit_header(**{"config.kdim": 3}),
                                  ("configuration keys", "unexpected ['kdim']")),
        "bad config value": (_edit_header(**{"config.activation": "tanh"}),
                             ("configuration is not valid", "activation", "'tanh'")),
        "bad training flag": (_edit_header(training="yes"), ("training", "'yes'")),
        "bad generator state": (_edit_header(rng_state={"bit_generator": "nope"}), ("generator state",)),
        "generator state out of range": (_edit_header(rng_state={"bit_generator": "PCG64", "has_uint32": 0,
                                                                 "uinteger": 0,
                                                                 "state": {"state": 2**200, "inc": 1}}),
                                         ("generator state",)),
        "no config": (lambda e: e.pop("config"), ("'config'", "TransformerDecoderBlock.save")),
        "parameter missing": (lambda e: e.pop("param/norm3.bias"), ("norm3.bias", "missing")),
        "parameter unexpected": (lambda e: e.update({"param/norm4.weight": np.ones(D)}),
                                 ("norm4.weight", "unexpected")),
        "wrong shape": (lambda e: e.update({"param/linear2.weight": np.zeros((D, FF + 1))}),
                        ("linear2.weight", f"({D}, {FF})", f"({D}, {FF + 1})")),
        "wrong dtype": (lambda e: e.update({"param/multihead_attn.w_o": np.zeros((D, D), np.float32)}),
                        ("multihead_attn.w_o", "float64", "float32")),
    }
    for name, (edit, fragments) in cases.items():
        path = _rewrite(good, tmp_path / f"{name}.npz", edit)
        with pytest.raises(ValueError) as info:
            TransformerDecoderBlock.load(path)
        for fragment in fragments:
            assert fragment in str(info.value), f"{name}: {fragment!r} not in {info.value}"
        assert str(path) in str(info.value), name

    one = tmp_path / "one.npy"
    np.save(one, np.zeros(3))
    with pytest.raises(ValueError, match="single .npy array"):
        TransformerBlock.load(one)
    with pytest.raises(TypeError, match="path"):
        make_block("encoder", "numpy").save(3)
    with pytest.raises(TypeError, match="path"):
        TransformerBlock.load(None)
    r = TransformerDecoderBlock.load(good)  # the good file still loads
    assert r.params["norm3.bias"].shape == (D,)


@pytest.mark.parametrize("kind", sorted(BLOCKS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_state_dict_round_trips_in_half_precision(kind, dtype):
    """from_torch / torch_state_dict keep a half-precision layer's tensors exactly (bfloat16 too)."""
    torch = pytest.importorskip("torch")
    cls = {"encoder": torch.nn.TransformerEncoderLayer, "decoder": torch.nn.TransformerDecoderLayer}[kind]
    torch.manual_seed(0)
    layer = cls(D, H, FF, batch_first=True, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms and biases away from 1 and 0
    block = BLOCKS[kind].from_torch(layer, backend="torch")
    assert block.dtype == getattr(torch, dtype)
    assert block.params["norm1.weight"].dtype == getattr(torch, dtype)
    assert torch.equal(block.params["norm1.weight"], layer.norm1.weight.detach())
    sd, theirs = block.torch_state_dict(), layer.state_dict()
    assert list(sd) == list(theirs)
    for k in theirs:
        assert sd[k].dtype == theirs[k].dtype and torch.equal(sd[k], theirs[k]), k


# --------------------------------------------------------------------------
# half precision against float64
#
# Error model. Rounding to the half dtype has relative error at most
# u = eps / 2 (round to nearest; eps = 2^-10 for float16, 2^-7 for bfloat16).
# Inputs, parameters and keep-masks are given to both blocks already rounded,
# so the difference comes only from results the half block stores in half:
# to first order each adds an error of relative size <= u, carried to the
# output by the stages after it. Reductions (matmul, sums) accumulate in
# float32 on NumPy and torch CPU, and scores, softmax, layer norm and GELU
# run in float32; each float32 operation adds <= 2^-24 = u / 2^13 (float16),
# far below one rounding even over a hundred of them. With unit-variance
# inputs, torch's initialisation and layer norms near 1 every stage is well
# conditioned (it passes a relative error on at about its size), so the
# normwise relative error of the output is at most K u, with K the roundings
# on the longest chain from the input (``forward_roundings``). The backward
# mirrors the forward: it reads the forward's activations (K roundings) and
# stores each of its own stages once (K more), so gradients get 2 K u.

def forward_roundings(kind):
    """K: the results the half block rounds to its dtype on the longest forward chain.

    attention sublayer: projection product and bias add (2), the attention
    output (1, computed in float32), output projection product and bias (2),
    dropout (1), residual (1), layer norm (1): 8. Feed-forward sublayer:
    linear1 (2), activation (1), dropout (1), linear2 (2), dropout (1),
    residual (1), layer norm (1): 9. The encoder has one attention sublayer,
    the decoder two.
    """
    return {"encoder": 8 + 9, "decoder": 8 + 8 + 9}[kind]


UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def half_or_skip(xp, backend, dtype):
    if not hasattr(xp, dtype):
        pytest.skip(f"backend {backend!r} has no {dtype} (the Array API standard has no half precision)")
    return getattr(xp, dtype)


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def half_case(kind, backend, xp, dtype, norm_first, activation, seed=0):
    """The half block's and the float64 block's steps, from the same rounded parameters and inputs."""
    hdt = half_or_skip(xp, backend, dtype)
    rng = np.random.default_rng(seed)
    h = BLOCKS[kind](D, H, FF, dropout=0.25, norm_first=norm_first, activation=activation,
                     dtype=dtype, backend=backend, seed=seed)
    to_half = as_xp(xp, hdt)
    params = {}
    for k, v in h.params.items():  # norms 1 +- 0.3, biases +- 0.1: every term of the backward acts
        a = host64(v)
        if k.startswith("norm") and k.endswith(".weight"):
            a = a + 0.3 * rng.standard_normal(a.shape)
        elif k.endswith(".bias") or ".b_" in k:
            a = a + 0.1 * rng.standard_normal(a.shape)
        params[k] = to_half(a)
    h.params = params
    ref = BLOCKS[kind](D, H, FF, dropout=0.25, norm_first=norm_first, activation=activation,
                       dtype="float64", seed=seed)
    ref.params = {k: host64(v) for k, v in h.params.items()}  # the rounded values, exactly
    arrays = {k: (a if a.dtype == bool else host64(to_half(a))) for k, a in inputs(kind, rng).items()}
    shapes = {"self_attn": (B, H, L, L), "multihead_attn": (B, H, L, LM), "dropout": (B, L, FF)}
    sites = DECODER_DROPOUT_SITES if kind == "decoder" else ENCODER_DROPOUT_SITES
    keep = {s: rng.random(shapes.get(s, (B, L, D))) > 0.25 for s in sites}
    dtypes: dict = {}
    ours = step(h, arrays, to_half, {s: as_xp(xp)(m) for s, m in keep.items()}, dtypes)
    theirs = step(ref, arrays, np.asarray, keep)
    return h, ours, theirs, dtypes


CONFIGS = [(nf, act) for nf in (False, True) for act in ("relu", "gelu", "gelu_tanh")]


@pytest.mark.parametrize("norm_first, activation", CONFIGS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_half_precision_follows_float64(backend, xp, kind, dtype, norm_first, activation):
    """Outputs and gradients in the half dtype, within K u (outputs) and 2 K u (gradients) of float64.

    ReLU's derivative jumps at 0: a pre-activation that rounding moves across
    0 changes gradient entries by O(1), not O(u), which no bound from eps
    covers (with bfloat16's u = 2^-8 some of the B L F = 384 pre-activations
    lie that close to 0). With ReLU only the output is compared: ReLU is
    1-Lipschitz, so the forward bound holds through it.
    """
    h, ours, theirs, dtypes = half_case(kind, backend, xp, dtype, norm_first, activation)
    assert set(dtypes) == set(ours) and len(ours) == len(h.params) + (3 if kind == "decoder" else 2)
    for name, dt in dtypes.items():  # the output, dx, dmemory and every parameter gradient
        assert dt == getattr(xp, dtype), f"{name}: {dt}, expected {dtype}"
    assert all(np.all(np.isfinite(a)) for a in ours.values())
    K, u = forward_roundings(kind), UNIT_ROUNDOFF[dtype]
    errors = {"out": rel_err(ours["out"], theirs["out"])}
    assert errors["out"] <= K * u, f"out: {errors['out'] / u:.2f} u > K u = {K} u"
    if activation == "relu":
        return
    for name in ours:
        if name == "out":
            continue
        if name.endswith(".b_k"):
            # b_k's exact gradient is 0 (a row's softmax ignores adding one constant to all its
            # scores): its error is measured on the scale of the whole module's gradient
            module = name[5:].split(".")[0]
            scale = np.sqrt(sum(np.sum(theirs[n] ** 2) for n in theirs
                                if n.startswith(f"grad {module}.")))
            errors[name] = float(np.linalg.norm(ours[name] - theirs[name]) / scale)
        else:
            errors[name] = rel_err(ours[name], theirs[name])
        assert errors[name] <= 2 * K * u, f"{name}: {errors[name] / u:.2f} u > 2 K u = {2 * K} u"


def test_the_half_precision_check_can_fail(backend, xp):
    """The measure tells rounding from a wrong answer: a zero or a misplaced gradient is far beyond the bound."""
    h, ours, theirs, _ = half_case("encoder", backend, xp, "float16", False, "gelu")
    K, u = forward_roundings("encoder"), UNIT_ROUNDOFF["float16"]
    assert rel_err(np.zeros_like(ours["dx"]), theirs["dx"]) > 2 * K * u  # a backward returning zeros
    swapped = ours["grad linear1.weight"][::-1]  # the right numbers on the wrong rows
    assert rel_err(swapped, theirs["grad linear1.weight"]) > 2 * K * u
    assert 0.0 < rel_err(ours["out"], theirs["out"])  # the comparison does see float16's rounding


def test_blocks_dtype_docs_name_the_compute_precision():
    """The docstrings say what runs in float32 for half precision (docs/transformer.md repeats it)."""
    for cls in BLOCKS.values():
        doc = " ".join(cls.__doc__.split())
        for phrase in ("float32", "float16", "bfloat16", "layer norm", "softmax"):
            assert phrase in doc, f"{cls.__name__}: {phrase!r}"


def test_rng_state_reads_a_copy_and_restores_the_next_masks(xp, to_xp, to_np):
    block = TransformerBlock(8, 2, 12, dropout=0.3, dtype="float64", backend=xp, seed=1)
    x = to_xp(np.random.default_rng(2).standard_normal((2, 4, 8)))
    state = block.rng_state
    first = to_np(block.forward(x))
    state_copy = block.rng_state
    state_copy["state"]["state"] += 1  # writing the copy does not move the block's generator
    block.rng_state = state
    np.testing.assert_array_equal(to_np(block.forward(x)), first)
    before = block.rng_state
    expected = r"^rng_state: expected a state of the dropout generator \(PCG64, as rng_state reads it\), got "
    for bad in ({"bit_generator": "nope"},
                {"bit_generator": "PCG64", "has_uint32": 0, "uinteger": 0, "state": {"state": -5, "inc": 1}}):
        got = re.escape(repr(bad))  # then NumPy's own words
        with pytest.raises(ValueError, match=f"{expected}{got}, which NumPy refuses: .+$"):
            block.rng_state = bad  # out of range: was an OverflowError
    for bad, got in (("PCG64", "str"), ([("state", 1)], "list")):  # not a dict: the type, first
        with pytest.raises(TypeError, match=f"^rng_state: expected a dict read from rng_state, got {got}$"):
            block.rng_state = bad
    assert block.rng_state == before  # a failed assignment moves nothing


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_torch_state_dict_of_a_jax_bfloat16_block_is_bfloat16(kind):
    """JAX's bfloat16 arrays reach torch through NumPy widened to float32; the state dict
    still holds bfloat16 tensors, as a bfloat16 torch layer's, with the block's values."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("jax")
    block = BLOCKS[kind](D, H, FF, dtype="bfloat16", backend="jax", seed=33)
    sd = block.torch_state_dict()
    theirs = {"encoder": torch.nn.TransformerEncoderLayer,
              "decoder": torch.nn.TransformerDecoderLayer}[kind](D, H, FF, batch_first=True,
                                                                 dtype=torch.bfloat16).state_dict()
    assert list(sd) == list(theirs)
    for k, v in sd.items():
        assert v.dtype == torch.bfloat16, k
    for k in ("linear1.weight", "linear2.bias", "norm1.weight"):
        np.testing.assert_array_equal(sd[k].float().numpy(),
                                      np.asarray(block.params[k].astype("float32")), err_msg=k)
