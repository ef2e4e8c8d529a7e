"""Copying, pickling, saving and loading a ``MultiHeadAttention``.

``copy.deepcopy`` and ``pickle`` keep the backend by name, the parameters,
gradients, mode and the dropout generator's state, and drop the cache of
the last forward. ``save`` / ``load`` write and read a portable ``.npz``
(parameters plus a JSON header), never pickle.
"""

import copy
import json
import pickle
import re
import types

import numpy as np
import pytest

from npattn import MultiHeadAttention
from npattn.module import SAVE_PARAM_PREFIX, SAVE_VERSION, ParameterDict
from npattn.validation import dtype_name

B, LQ, LK = 2, 3, 4


def _module(backend, **kw):
    kw = dict(dict(kdim=5, vdim=3, n_kv_head=2, add_bias_kv=True, add_zero_attn=True,
                   dropout=0.3, dtype="float64", seed=4, backend=backend), **kw)
    return MultiHeadAttention(8, 4, **kw)


def _inputs(m, to_xp, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, LQ, m.qdim))
    k = rng.standard_normal((B, LK, m.kdim))
    v = rng.standard_normal((B, LK, m.vdim))
    mask = np.where(rng.random((B, 1, LQ, LK)) > 0.3, rng.standard_normal((B, 1, LQ, LK)), -np.inf)
    dout = rng.standard_normal((B, LQ, m.d_model))
    return [to_xp(a.astype(dtype_name(m.dtype))) for a in (q, k, v, mask, dout)]


def _step(m, arrays, to_np):
    """One forward + backward in training mode: everything it returns or fills, on the host."""
    q, k, v, mask, dout = arrays
    out, w = m(q, k, v, mask=mask, need_weights=True, average_attn_weights=False)
    grads = m.backward(dout)
    res = {"out": out, "weights": w, "dmask": m.dmask, **dict(zip(("dq", "dk", "dv"), grads)),
           **{"grad " + n: g for n, g in m.grads.items()}}
    return {n: to_np(a) for n, a in res.items()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def _copies():
    return {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m))}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_is_identical_and_independent(backend, to_xp, to_np, how):
    m = _module(backend)
    arrays = _inputs(m, to_xp)
    _step(m, arrays, to_np)  # grads, dmask and a cache exist; the generator has advanced
    c = _copies()[how](m)

    assert c.xp is m.xp and c.dtype == m.dtype and repr(c) == repr(m)
    assert type(c.params) is ParameterDict and list(c.params) == list(m.params)
    assert c.cache is None and m.cache is not None  # the cache is dropped, not copied
    with pytest.raises(RuntimeError, match="forward"):
        c.backward(arrays[4])
    for name in m.params:
        np.testing.assert_array_equal(to_np(c.params[name]), to_np(m.params[name]))
        np.testing.assert_array_equal(to_np(c.grads[name]), to_np(m.grads[name]))
    np.testing.assert_array_equal(to_np(c.dmask), to_np(m.dmask))

    # the same dropout stream: the next two steps are bit for bit the same on both ...
    first_m, first_c = _step(m, arrays, to_np), _step(c, arrays, to_np)
    _assert_same(first_m, first_c)
    # ... and the copy's generator is its own: c draws twice, then m catches up
    second_c = _step(c, arrays, to_np)
    assert not np.array_equal(second_c["out"], first_c["out"])  # dropout acts
    _step(c, arrays, to_np)
    _assert_same(_step(m, arrays, to_np), second_c)

    # the parameters are copies, and assignments to the copy are still checked
    before = to_np(m.params["w_o"])
    c.params["w_o"] = to_xp(np.zeros((8, 8)))
    np.testing.assert_array_equal(to_np(m.params["w_o"]), before)
    with pytest.raises(ValueError, match="w_o"):
        c.params["w_o"] = to_xp(np.zeros((8, 7)))


def test_copy_keeps_the_mode_and_a_backend_given_as_a_namespace_module():
    import array_api_compat.numpy as compat_np

    for backend in (np, compat_np):
        m = MultiHeadAttention(4, 2, backend=backend, seed=0).eval()
        c = pickle.loads(pickle.dumps(m))
        assert c.xp is m.xp and not c.training
        x = np.ones((1, 2, 4), dtype=np.float32)
        np.testing.assert_array_equal(c(x, x, x)[0], m(x, x, x)[0])


def test_copy_of_an_unnamed_namespace_is_a_type_error():
    import array_api_compat.numpy as compat_np

    ns = types.ModuleType("npattn_test_unimportable_namespace")
    ns.__dict__.update({k: v for k, v in vars(compat_np).items() if not k.startswith("__")})
    m = MultiHeadAttention(4, 2, backend=ns, seed=0)
    assert m.xp is ns
    for how, copier in _copies().items():
        with pytest.raises(TypeError, match="backend.*npattn_test_unimportable_namespace"):
            copier(m)


# --------------------------------------------------------------------------
# save / load


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_save_load_round_trip(backend, to_xp, to_np, tmp_path, dtype):
    # qdim != d_model, out_bias != qkv_bias, bias and block_k not their defaults: each must
    # come from its own setting
    m = _module(backend, dtype=dtype, impl="reference", block_q=3, block_k=5, qdim=6, bias=False,
                out_bias=True)
    arrays = _inputs(m, to_xp)
    _step(m, arrays, to_np)  # the generator has advanced: load restores that state
    path = tmp_path / "mha"  # no .npz suffix: written at exactly this name
    m.save(path)
    assert path.exists() and not (tmp_path / "mha.npz").exists()
    with np.load(path, allow_pickle=False) as npz:  # plain arrays and one JSON string
        header = json.loads(str(npz["config"]))
        assert sorted(npz.files) == sorted(["config", *(SAVE_PARAM_PREFIX + n for n in m.params)])
    assert header["format_version"] == SAVE_VERSION and header["config"]["dtype"] == dtype

    r = MultiHeadAttention.load(path, backend=backend)
    assert repr(r) == repr(m) and r.training == m.training
    assert (r.impl, r.block_q, r.block_k, r.bias, r.qkv_bias) == ("reference", 3, 5, False, False)
    for name in m.params:
        assert r.params[name].dtype == m.params[name].dtype
        np.testing.assert_array_equal(to_np(r.params[name]), to_np(m.params[name]))
    _assert_same(_step(r, arrays, to_np), _step(m, arrays, to_np))  # same next dropout draw

    m.eval().save(path)  # overwrites; eval mode is kept
    assert not MultiHeadAttention.load(path, backend=backend).training


@pytest.mark.parametrize("bias, qkv_bias, out_bias", [
    (True, False, None), (False, True, None), (True, None, False), (False, None, True),
    (True, False, True), (False, True, False),
])
def test_save_load_keeps_qkv_bias_and_out_bias_apart_from_bias(tmp_path, bias, qkv_bias, out_bias):
    """qkv_bias and out_bias set apart from bias (None follows it) are written as their own
    settings and read back: the loaded module has the flags and the parameters saved, b_q, b_k,
    b_v with qkv_bias only and b_o with out_bias only."""
    want_qkv = bias if qkv_bias is None else qkv_bias
    want_out = bias if out_bias is None else out_bias
    biases = sorted(["b_q", "b_k", "b_v"] * want_qkv + ["b_o"] * want_out)
    m = MultiHeadAttention(8, 2, bias=bias, qkv_bias=qkv_bias, out_bias=out_bias, dtype="float64", seed=2)
    rng = np.random.default_rng(3)
    for name in ("b_q", "b_k", "b_v", "b_o"):  # nonzero, so a bias lost or swapped shows
        if name in m.params:
            m.params[name] = rng.standard_normal(8)
    path = tmp_path / "m.npz"
    m.save(path)
    with np.load(path, allow_pickle=False) as npz:
        config = json.loads(str(npz["config"]))["config"]
        files = set(npz.files)
    assert (config["bias"], config["qkv_bias"], config["out_bias"]) == (bias, want_qkv, want_out)
    assert sorted(n for n in ("b_q", "b_k", "b_v", "b_o") if "param/" + n in files) == biases

    r = MultiHeadAttention.load(path)
    assert (r.bias, r.qkv_bias, r.out_bias) == (bias, want_qkv, want_out)
    assert sorted(r.params) == sorted(["w_q", "w_k", "w_v", "w_o"] + biases)
    for name in m.params:
        np.testing.assert_array_equal(r.params[name], m.params[name], err_msg=name)


def test_save_load_across_backends_and_file_objects(tmp_path, to_np):
    import io

    m = _module("numpy")
    buf = io.BytesIO()
    m.save(buf)
    for backend in ("numpy", "array_api_strict", "torch"):
        pytest.importorskip(backend)
        buf.seek(0)
        r = MultiHeadAttention.load(buf, backend=backend)
        assert r.xp.__name__.endswith(backend)
        for name in m.params:
            np.testing.assert_array_equal(to_np(r.params[name]), m.params[name])


def test_save_into_a_write_only_stream():
    """``save`` takes any binary file object to write, one with ``write`` alone too (a socket's
    or a pipe's writer), as its docstring says: not only those that can also read."""
    import io

    class WriteOnly:
        def __init__(self):
            self.chunks = []

        def write(self, data):
            self.chunks.append(bytes(data))
            return len(data)

        def flush(self):
            pass

    m = _module("numpy")
    out = WriteOnly()
    m.save(out)
    r = MultiHeadAttention.load(io.BytesIO(b"".join(out.chunks)))
    for name in m.params:
        np.testing.assert_array_equal(r.params[name], m.params[name])


def test_save_load_bfloat16_on_torch(tmp_path):
    torch = pytest.importorskip("torch")
    m = MultiHeadAttention(4, 2, dtype="bfloat16", backend="torch", seed=1)
    m.save(tmp_path / "bf16.npz")
    r = MultiHeadAttention.load(tmp_path / "bf16.npz", backend="torch")
    for name in m.params:
        assert r.params[name].dtype == torch.bfloat16
        assert torch.equal(r.params[name], m.params[name])
    with pytest.raises(ValueError, match="bfloat16"):  # NumPy has no bfloat16: the constructor says so
        MultiHeadAttention.load(tmp_path / "bf16.npz", backend="numpy")


def _rewrite(src, dst, edit):
    """Copy the save file ``src`` to ``dst`` with ``edit(entries)`` applied to its entries."""
    with np.load(src, allow_pickle=False) as npz:
        entries = {n: npz[n] for n in npz.files}
    edit(entries)
    with open(dst, "wb") as f:
        np.savez(f, **entries)
    return dst


def _edit_header(**changes):
    def edit(entries):
        header = json.loads(str(entries["config"]))
        header.update(changes)
        entries["config"] = np.array(json.dumps(header))

    return edit


def test_load_rejects_foreign_and_corrupt_files(tmp_path):
    m = _module("numpy")
    good = tmp_path / "good.npz"
    m.save(good)
    cases = {
        "missing parameter": (lambda e: e.pop("param/w_k"), ("w_k", "missing")),
        "unexpected parameter": (lambda e: e.update({"param/w_x": np.zeros(2)}), ("w_x", "unexpected")),
        "unexpected entry": (lambda e: e.update({"notes": np.zeros(2)}), ("notes", "unexpected")),
        "wrong shape": (lambda e: e.update({"param/w_o": np.zeros((8, 7))}), ("w_o", "(8, 8)", "(8, 7)")),
        "wrong dtype": (lambda e: e.update({"param/b_q": np.zeros(8, np.int64)}), ("b_q", "float64", "int64")),
        "unknown version": (_edit_header(format_version=SAVE_VERSION + 1), ("format_version", str(SAVE_VERSION + 1))),
        "other format": (_edit_header(format="something.else"), ("format", "something.else")),
        "bad config": (_edit_header(config={"d_model": 8, "n_head": 3}), ("configuration", "n_head")),
        "no config": (lambda e: e.pop("config"), ("'config'",)),
        "config not JSON": (lambda e: e.update(config=np.array("{not json")), ("JSON",)),
        "config a number": (lambda e: e.update(config=np.array(5)), ("one JSON string", "int64")),
        "config bytes": (lambda e: e.update(config=np.array(b"{}")), ("one JSON string", "S2")),
        "config in an array": (lambda e: e.update(config=np.array([str(e["config"])])),
                               ("one JSON string", "(1,)")),
        "bad training flag": (_edit_header(training="yes"), ("training",)),
    }
    for name, (edit, fragments) in cases.items():
        path = _rewrite(good, tmp_path / f"{name}.npz", edit)
        with pytest.raises(ValueError) as info:
            MultiHeadAttention.load(path)
        for fragment in fragments:
            assert fragment in str(info.value), f"{name}: {fragment!r} not in {info.value}"
        assert str(path) in str(info.value), name

    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"PK\x03\x04 this is not a zip archive")
    with pytest.raises(ValueError, match="expected an .npz file"):
        MultiHeadAttention.load(junk)
    one = tmp_path / "one.npy"
    np.save(one, np.zeros(3))
    with pytest.raises(ValueError, match="single .npy array"):
        MultiHeadAttention.load(one)
    with pytest.raises(TypeError, match="path"):
        m.save(3)
    with pytest.raises(TypeError, match="path"):
        MultiHeadAttention.load(None)
    np.testing.assert_array_equal(MultiHeadAttention.load(good).params["w_k"], m.params["w_k"])


def test_a_file_without_a_generator_state_loads(tmp_path):
    """rng_state null in the header (no state saved, as the header allows) loads: the
    parameters and the mode as saved, and the generator as the constructor seeds it without a
    seed (the configuration holds none): from fresh entropy, so two loads draw differently."""
    m = _module("numpy").eval()
    m.save(tmp_path / "good.npz")
    path = _rewrite(tmp_path / "good.npz", tmp_path / "no state.npz", _edit_header(rng_state=None))
    r = MultiHeadAttention.load(path)
    assert not r.training and list(r.params) == list(m.params)
    for name in m.params:
        np.testing.assert_array_equal(r.params[name], m.params[name])
    q, k, v = _inputs(r, np.asarray)[:3]
    outs = []
    for loaded in (r, MultiHeadAttention.load(path)):
        out, _ = loaded.train()(q, k, v)  # dropout 0.3, drawn from the module's generator
        outs.append(out)
    assert np.all(np.isfinite(outs[0])) and not np.array_equal(outs[0], outs[1])


UNPICKLED = []  # what unpickling a _Trap records


def _record_unpickling(tag):
    UNPICKLED.append(tag)
    return np.zeros((8, 5))


class _Trap:
    """An object whose unpickling runs ``_record_unpickling``: any code could run there."""

    def __reduce__(self):
        return _record_unpickling, ("param/w_k",)


def test_load_never_unpickles(tmp_path):
    """``load`` reads without pickle: a file whose entry is a pickled object array (which
    ``np.load(allow_pickle=True)`` would unpickle, running whatever code it names) is a
    ValueError, and nothing of it runs."""
    m = _module("numpy")
    m.save(tmp_path / "good.npz")
    trap = np.empty(1, dtype=object)
    trap[0] = _Trap()
    path = _rewrite(tmp_path / "good.npz", tmp_path / "trap.npz",
                    lambda e: e.update({"param/w_k": trap}))  # np.savez pickles it
    UNPICKLED.clear()
    with pytest.raises(ValueError, match="expected an .npz file written by MultiHeadAttention.save"):
        MultiHeadAttention.load(path)
    assert UNPICKLED == []


def test_a_pickle_of_an_older_npattn_loads_with_the_defaults():
    """A module pickled by an npattn from before ``scale``, ``softcap``, ``sinks`` and the
    cache's bookkeeping has none of those attributes: unpickled, it takes their defaults and
    computes what the module computed."""
    m = _module("numpy", dropout=0.0)
    state = m.__getstate__()
    for name in ("scale", "softcap", "sinks", "_decoded", "_cache_lent", "_token"):
        del state[name]
    old = MultiHeadAttention.__new__(MultiHeadAttention)
    old.__setstate__(state)  # what pickle.loads does with that state
    assert (old.scale, old.softcap, old.sinks) == (None, None, False)
    arrays = _inputs(m, np.asarray)
    _assert_same(_step(old, arrays, np.asarray), _step(m, arrays, np.asarray))


def test_load_of_a_config_without_dtype_takes_the_default_dtype(tmp_path):
    """A configuration without ``dtype`` builds the default (float32) module, as any missing
    argument: its float64 parameters are then refused by name, not with a KeyError."""
    def drop_dtype(entries):
        header = json.loads(str(entries["config"]))
        del header["config"]["dtype"]
        entries["config"] = np.array(json.dumps(header))

    for dtype, loads in (("float64", False), ("float32", True)):
        good = tmp_path / f"{dtype}.npz"
        m = _module("numpy", dtype=dtype)
        m.save(good)
        path = _rewrite(good, tmp_path / f"{dtype} without dtype.npz", drop_dtype)
        if loads:
            c = MultiHeadAttention.load(path)
            for name in m.params:
                np.testing.assert_array_equal(c.params[name], m.params[name])
        else:
            with pytest.raises(ValueError, match="expected dtype float32.*got float64"):
                MultiHeadAttention.load(path)


# ------------------------------------------------------------ malformed files, every model's load
# MultiHeadAttention, the blocks, GPT and the classifier read one file layout (module.py's
# helpers); each case below runs against every one of them.


def _saving_models():
    from npattn.classifier import TransformerClassifier
    from npattn.gpt import GPT
    from npattn.transformer import TransformerBlock, TransformerDecoderBlock

    return {
        "MultiHeadAttention": lambda: MultiHeadAttention(8, 2, kdim=5, dropout=0.1, seed=0),
        "TransformerBlock": lambda: TransformerBlock(8, 2, 16, dropout=0.1, seed=0),
        "TransformerDecoderBlock": lambda: TransformerDecoderBlock(8, 2, 16, dropout=0.1, seed=0),
        "GPT": lambda: GPT(7, 5, 8, 2, 2, dropout=0.1, seed=0),
        "TransformerClassifier": lambda: TransformerClassifier(3, 4, 2, 8, 2, 2, dropout=0.1, seed=0),
    }


SAVING_MODELS = sorted(_saving_models())


def _saved(tmp_path, name):
    """A fresh model of class ``name``, saved: (its class, the file)."""
    model = _saving_models()[name]()
    path = tmp_path / f"{name}.npz"
    model.save(path)
    return type(model), path


def _edit_json(**changes):
    """An edit for ``_rewrite``: header keys set (``config.<key>`` for the configuration's);
    the value ``_DROP`` removes the key."""
    def edit(entries):
        header = json.loads(str(entries["config"]))
        for key, value in changes.items():
            where, key = (header["config"], key[7:]) if key.startswith("config.") else (header, key)
            if value is _DROP:
                where.pop(key)
            else:
                where[key] = value
        entries["config"] = np.array(json.dumps(header))

    return edit


_DROP = object()


@pytest.mark.parametrize("name", SAVING_MODELS)
def test_a_directory_path_is_an_is_a_directory_error_naming_path(tmp_path, name):
    """``load`` of a directory raised NumPy's bare "[Errno 21] Is a directory" from inside
    ``np.load``; now an IsADirectoryError (an OSError, as a missing file's FileNotFoundError)
    that names ``path``, the save that writes such files and the directory. ``save`` too."""
    cls, _ = _saved(tmp_path, name)
    folder = tmp_path / "folder"
    folder.mkdir()
    for given in (folder, str(folder)):
        with pytest.raises(IsADirectoryError) as info:
            cls.load(given)
        assert str(info.value) == (f"path: expected a file written by {cls.__name__}.save, "
                                   f"got the directory {str(folder)!r}")
    with pytest.raises(IsADirectoryError, match="^path: expected a file name to write, got the directory"):
        _saving_models()[name]().save(folder)
    assert list(folder.iterdir()) == []


class _WriteOnly:
    def write(self, data):
        return len(data)


class _ReadOnly:
    def read(self, *size):
        return b""


@pytest.mark.parametrize("name", SAVING_MODELS)
def test_a_file_object_without_the_method_needed_is_a_type_error_naming_path(tmp_path, name):
    """``load`` reads and ``save`` writes: an object with only the other method passed the
    path check, and NumPy then failed with 'expected str, bytes or os.PathLike object', which
    names neither ``path`` nor the method missing."""
    cls, _ = _saved(tmp_path, name)
    with pytest.raises(TypeError) as info:
        cls.load(_WriteOnly())
    assert re.fullmatch(r"path: expected a file name \(str or os\.PathLike\) or a binary file "
                        r"object with read\(\), got (\w+\.)*_WriteOnly", str(info.value)), str(info.value)
    with pytest.raises(TypeError) as info:
        _saving_models()[name]().save(_ReadOnly())
    assert re.fullmatch(r"path: expected a file name \(str or os\.PathLike\) or a binary file "
                        r"object with write\(\), got (\w+\.)*_ReadOnly", str(info.value)), str(info.value)


@pytest.mark.parametrize("name", SAVING_MODELS)
@pytest.mark.parametrize("version, fragments", [
    (1.0, ("a JSON integer", "got 1.0 (float)")),  # json.loads("1.0") == 1 in Python: it loaded
    (True, ("a JSON integer", "got True (bool)")),  # bool is an int subclass
    ("1", ("a JSON integer", "got '1' (str)")),
    (None, ("a JSON integer", "got None")),
    (_DROP, ("a JSON integer", "got None")),
    (0, ("got 0", "which no npattn writes")),
    (-1, ("got -1", "which no npattn writes")),
    (SAVE_VERSION + 1, (f"got {SAVE_VERSION + 1}", "newer than this npattn")),
])
def test_format_version_must_be_the_json_integer_this_npattn_reads(tmp_path, name, version, fragments):
    cls, good = _saved(tmp_path, name)
    path = _rewrite(good, tmp_path / "edited.npz", _edit_json(format_version=version))
    with pytest.raises(ValueError) as info:
        cls.load(path)
    msg = str(info.value)
    assert msg.startswith(f"load: {str(path)!r}: expected format_version {SAVE_VERSION} ("), msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg}"
    cls.load(good)  # the unedited file loads


@pytest.mark.parametrize("name, key", [
    ("MultiHeadAttention", "d_model"), ("MultiHeadAttention", "kdim"), ("TransformerBlock", "d_ff"),
    ("TransformerDecoderBlock", "d_model"), ("GPT", "n_layer"), ("GPT", "vocab_size"),
    ("TransformerClassifier", "n_layers"),
])
def test_a_saved_size_too_large_for_an_array_is_refused_by_name(tmp_path, name, key):
    """d_model = 2**70 failed inside NumPy ("Maximum allowed dimension exceeded", no argument
    named) and GPT's n_layer = 2**70 with an OverflowError from SeedSequence.spawn."""
    cls, good = _saved(tmp_path, name)
    path = _rewrite(good, tmp_path / "edited.npz", _edit_json(**{f"config.{key}": 2**70}))
    with pytest.raises(ValueError, match=rf"configuration is not valid: {key}: expected (an|a positive) "
                                         rf"int <= \d+ \(the longest array axis\), got {2**70}$"):
        cls.load(path)


@pytest.mark.parametrize("name", ["GPT", "TransformerClassifier"])
@pytest.mark.parametrize("states, fragment", [
    ("x", "got 'x' (str)"),
    ([{}], "a list of 2 generator states (one per block), got a list of 1"),
    ([{}, {}, {}], "a list of 2 generator states (one per block), got a list of 3"),
    ([None, None], "block_rng_states[0]: expected a dict read from rng_state, got None"),
    (["x", "x"], "block_rng_states[0]: expected a dict read from rng_state, got str"),
])
def test_block_generator_state_errors_name_block_rng_states(tmp_path, name, states, fragment):
    """They said "expected 2 block generator states, got str" and "rng_state: expected a state
    read from rng_state": neither names the header's key."""
    cls, good = _saved(tmp_path, name)
    path = _rewrite(good, tmp_path / "edited.npz", _edit_json(block_rng_states=states))
    with pytest.raises(ValueError) as info:
        cls.load(path)
    assert "block_rng_states" in str(info.value) and fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("name", ["GPT", "TransformerClassifier"])
def test_a_bad_generator_state_of_block_1_is_named_by_its_index(tmp_path, name):
    """Block 0's state as saved, block 1's None: the error names block_rng_states[1]."""
    cls, good = _saved(tmp_path, name)
    with np.load(good, allow_pickle=False) as npz:
        states = json.loads(str(npz["config"]))["block_rng_states"]
    path = _rewrite(good, tmp_path / "edited.npz", _edit_json(block_rng_states=[states[0], None]))
    with pytest.raises(ValueError, match=r"block_rng_states\[1\]: expected a dict read from rng_state, "
                                         r"got None$"):
        cls.load(path)


@pytest.mark.parametrize("name", ["GPT", "TransformerClassifier"])
def test_a_models_file_says_which_backend_it_was_saved_from(tmp_path, name):
    """The header's saved_from_backend (docs/transformer.md) is the model's backend."""
    pytest.importorskip("array_api_strict")
    from npattn.classifier import TransformerClassifier
    from npattn.gpt import GPT

    make = {"GPT": lambda: GPT(7, 5, 8, 2, 2, seed=0, backend="array_api_strict"),
            "TransformerClassifier": lambda: TransformerClassifier(3, 4, 2, 8, 2, 2, seed=0,
                                                                   backend="array_api_strict")}
    model = make[name]()
    model.save(tmp_path / "model.npz")
    with np.load(tmp_path / "model.npz", allow_pickle=False) as npz:
        header = json.loads(str(npz["config"]))
    assert header["saved_from_backend"] == "array_api_strict"


_WRONG_VALUES = [_DROP, None, "x", 1.5, -3, 2**70, [1], {}]


@pytest.mark.parametrize("name", SAVING_MODELS)
def test_every_malformed_header_value_loads_or_is_a_value_error(tmp_path, name):
    """A sweep: each key of the header and of the configuration dropped or set to a value of
    another type. Each file loads (a default, a value the constructor takes) or raises a
    ValueError naming the file; MultiHeadAttention.load of a header without rng_state raised
    KeyError('rng_state'), a huge GPT n_layer an OverflowError."""
    cls, good = _saved(tmp_path, name)
    header = json.loads(str(np.load(good)["config"]))
    keys = [k for k in header if k != "config"] + [f"config.{k}" for k in header["config"]]
    path = tmp_path / "edited.npz"
    for key in keys:
        for value in _WRONG_VALUES:
            _rewrite(good, path, _edit_json(**{key: value}))
            try:
                cls.load(path)
            except ValueError as exc:
                assert str(exc).startswith(f"load: {str(path)!r}: "), (key, value, exc)
            except Exception as exc:  # noqa: BLE001 (the point of the sweep)
                pytest.fail(f"{key}={'dropped' if value is _DROP else repr(value)}: "
                            f"{type(exc).__name__}: {exc}")


def test_each_models_repr_reads_as_the_call_that_builds_it():
    """repr names dtype and backend as the constructor takes them ('float64', 'numpy'; it
    printed <class 'numpy.float64'> and 'array_api_compat.numpy'), so evaluating it builds a
    model of the same configuration."""
    from npattn import KVCache
    from npattn.classifier import TransformerClassifier
    from npattn.gpt import GPT
    from npattn.transformer import TransformerBlock, TransformerDecoderBlock

    names = {c.__name__: c for c in (MultiHeadAttention, GPT, TransformerBlock,
                                     TransformerDecoderBlock, TransformerClassifier)}
    models = [MultiHeadAttention(8, 2, dtype="float64", kdim=6, n_kv_head=1, softcap=2.0),
              MultiHeadAttention(8, 2, dtype="float64", impl="blocked", block_q=4, block_k=3),
              GPT(11, 9, 8, 1, 2, dtype="float64"),
              TransformerBlock(8, 2, 16, dtype="float64", activation="gelu", norm_first=True),
              TransformerDecoderBlock(8, 2, 16, dtype="float64", bias=False),
              TransformerClassifier(4, 3, 5, d_model=8, n_head=2, dtype="float64")]
    for m in models:
        text = repr(m)
        assert "dtype='float64'" in text and "backend='numpy'" in text, text
        rebuilt = eval(text, names)
        assert repr(rebuilt) == text
        assert vars(rebuilt).keys() == vars(m).keys()
        for k, v in vars(m).items():  # the configuration: every plain setting the same
            if isinstance(v, (bool, int, float, str, type(None))):
                assert getattr(rebuilt, k) == v or (v != v and getattr(rebuilt, k) != getattr(rebuilt, k)), (type(m).__name__, k)
    cache = KVCache(2, 5, 3, 4, dtype="float64")
    assert "dtype='float64', backend='numpy'" in repr(cache)


def _models_with_modes_set_apart():
    """One model of each kind that holds blocks, float64 with dropout 0.3, in training mode but
    with one block's (or attention module's) mode set apart, and a forward of it on fixed inputs."""
    from npattn.classifier import TransformerClassifier
    from npattn.gpt import GPT
    from npattn.transformer import TransformerBlock, TransformerDecoderBlock

    rng = np.random.default_rng(7)
    x, memory, features = (rng.standard_normal(s) for s in ((2, 3, 8), (2, 5, 8), (2, 4, 3)))
    ids = np.array([[1, 2, 3, 4], [5, 6, 0, 1]])
    gpt = GPT(7, 5, 8, 3, 2, dropout=0.3, dtype="float64", seed=0)
    gpt.blocks[1].eval()  # block 1 drops nowhere
    gpt.blocks[2].self_attn.eval()  # block 2 drops everywhere but on its attention probabilities
    clf = TransformerClassifier(3, 4, 2, 8, 2, 3, dropout=0.3, dtype="float64", seed=0)
    clf.blocks[0].self_attn.eval()
    clf.blocks[2].eval()
    enc = TransformerBlock(8, 2, 16, dropout=0.3, dtype="float64", seed=0)
    enc.self_attn.eval()
    dec = TransformerDecoderBlock(8, 2, 16, dropout=0.3, dtype="float64", seed=0)
    dec.multihead_attn.eval()
    return {
        "GPT": (gpt, lambda m: m(ids)),
        "TransformerClassifier": (clf, lambda m: m(features)),
        "TransformerBlock": (enc, lambda m: m(x, is_causal=True)),
        "TransformerDecoderBlock": (dec, lambda m: m(x, memory, is_causal=True)),
    }


def _modes(model):
    """Every mode a model holds: its own, then each block's and its attention modules', in order."""
    modes = [model.training]
    for block in getattr(model, "blocks", [model]):
        attns = [block.self_attn] + ([block.multihead_attn] if hasattr(block, "multihead_attn") else [])
        modes.append((block.training, *(a.training for a in attns)))
    return modes


MODEL_KINDS = ["GPT", "TransformerBlock", "TransformerClassifier", "TransformerDecoderBlock"]


@pytest.mark.parametrize("name", MODEL_KINDS)
def test_save_load_keeps_the_modes_of_blocks_and_attention_modules_set_apart(tmp_path, name):
    """A block put in eval mode apart from its model, or an attention module apart from its
    block, came back in the model's mode: the next training forward of the loaded model
    dropped where the saved one did not."""
    model, forward = _models_with_modes_set_apart()[name]
    before = _modes(model)
    assert before[0] and not all(all(m) for m in before[1:]), before  # something is set apart
    model.save(tmp_path / "model.npz")
    loaded = type(model).load(tmp_path / "model.npz")
    assert _modes(loaded) == before
    np.testing.assert_array_equal(forward(loaded), forward(model))  # dropout 0.3 where training
    assert _modes(loaded) == _modes(model) == before


@pytest.mark.parametrize("name", MODEL_KINDS)
def test_a_file_without_the_modes_puts_every_module_in_the_models_mode(tmp_path, name):
    """Files written before the modes were saved load as they did: blocks and attention
    modules all in the header's mode ``training``."""
    for training in (True, False):
        model, forward = _models_with_modes_set_apart()[name]
        model.save(tmp_path / "model.npz")
        key = "block_modes" if hasattr(model, "blocks") else "modes"
        path = _rewrite(tmp_path / "model.npz", tmp_path / "old.npz",
                        _edit_json(**{key: _DROP, "training": training}))
        loaded = type(model).load(path)
        modes = _modes(loaded)
        assert modes[0] is training and all(m == (training,) * len(m) for m in modes[1:]), modes
        np.testing.assert_array_equal(forward(loaded), forward(model.train(training)))


@pytest.mark.parametrize("name, key, value, fragment", [
    ("TransformerBlock", "modes", "x", "'modes' in the header: expected a dict of bools with the keys "
                                       "['training', 'self_attn'], got 'x'"),
    ("TransformerBlock", "modes", {"training": True}, "'modes' in the header: expected a dict of bools "
                                                      "with the keys ['training', 'self_attn'], got "
                                                      "{'training': True}"),
    ("TransformerBlock", "modes", {"training": True, "self_attn": 1},
     "'modes' in the header: expected a dict of bools with the keys ['training', 'self_attn'], got "
     "{'training': True, 'self_attn': 1}"),
    ("TransformerBlock", "modes", {"training": False, "self_attn": True},
     "expected 'modes' in the header to hold the block's mode 'training' (True), got "
     "{'training': False, 'self_attn': True}"),
    ("TransformerDecoderBlock", "modes", {"training": True, "self_attn": True},
     "'modes' in the header: expected a dict of bools with the keys ['training', 'self_attn', "
     "'multihead_attn'], got {'training': True, 'self_attn': True}"),
    ("GPT", "block_modes", "x", "expected 'block_modes' in the header to be null or a list of 3"),
    ("GPT", "block_modes", [{"training": True, "self_attn": True}] * 2, "got a list of 2"),
    ("GPT", "block_modes", [{"training": True, "self_attn": True}, {"training": "no", "self_attn": True},
                            {"training": True, "self_attn": True}],
     "block_modes[1]: expected a dict of bools"),
    ("TransformerClassifier", "block_modes", [{"training": True, "self_attn": True}] * 2 + [[True, True]],
     "block_modes[2]: expected a dict of bools with the keys ['training', 'self_attn'], got [True, True]"),
])
def test_malformed_modes_in_a_file_are_a_value_error_naming_them(tmp_path, name, key, value, fragment):
    model, _ = _models_with_modes_set_apart()[name]
    model.save(tmp_path / "model.npz")
    path = _rewrite(tmp_path / "model.npz", tmp_path / "edited.npz", _edit_json(**{key: value}))
    with pytest.raises(ValueError) as info:
        type(model).load(path)
    msg = str(info.value)
    assert msg.startswith(f"load: {str(path)!r}: ") and fragment in msg, msg
    assert _modes(type(model).load(tmp_path / "model.npz")) == _modes(model)  # the good file loads


def test_a_blocks_modes_read_and_restore_each_module_and_refuse_another_dict_whole():
    from npattn.transformer import TransformerDecoderBlock

    block = TransformerDecoderBlock(8, 2, 16, dtype="float64", seed=0)
    block.self_attn.eval()
    assert block.modes == {"training": True, "self_attn": False, "multihead_attn": True}
    saved = block.modes
    block.eval()
    block.modes = saved
    assert (block.training, block.self_attn.training, block.multihead_attn.training) == (True, False, True)
    for bad, error in (({"training": False, "self_attn": False}, ValueError),
                       ({**saved, "norm1": True}, ValueError),
                       ({**saved, "multihead_attn": "no"}, TypeError), ([True, False, True], TypeError),
                       ({**saved, "training": 1}, TypeError)):
        expected = (r"^modes: expected a dict of bools with the keys "
                    r"\['training', 'self_attn', 'multihead_attn'\]")
        with pytest.raises(error, match=expected + ", got " + re.escape(repr(bad)) + "$"):
            block.modes = bad
        assert block.modes == saved  # nothing set
