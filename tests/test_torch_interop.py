"""``MultiHeadAttention.from_torch``, ``load_torch_state_dict``, ``torch_state_dict``.

Values are checked in ``test_torch_parity.py``; here: every torch layout
round-trips exactly, dtypes follow the torch module, and a bad state dict or
a layer torch cannot express gets a ValueError naming it.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from npattn import MultiHeadAttention, torch_interop  # noqa: E402
from npattn.backend import to_numpy  # noqa: E402

LAYOUTS = [
    dict(),
    dict(kdim=3, vdim=5),
    dict(kdim=6),
    dict(vdim=4),
    dict(bias=False),
    dict(bias=False, kdim=3, vdim=5),
    dict(add_bias_kv=True),
    dict(add_bias_kv=True, add_zero_attn=True, kdim=3, vdim=5),
    dict(add_zero_attn=True, bias=False),
]


def _randomized(tm):
    with torch.no_grad():
        for p in tm.parameters():
            p.copy_(torch.randn_like(p))
    return tm


@pytest.mark.parametrize("kw", LAYOUTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_round_trip_every_layout(backend, kw):
    tm = _randomized(torch.nn.MultiheadAttention(6, 2, dtype=torch.float64, **kw))
    mha = MultiHeadAttention.from_torch(tm, backend=backend)
    D = 6
    sd = tm.state_dict()
    # the mapping, entry by entry
    if "in_proj_weight" in sd:
        w = sd["in_proj_weight"].numpy()
        np.testing.assert_array_equal(to_numpy(mha.params["w_k"]), w[D : 2 * D])
    else:
        np.testing.assert_array_equal(to_numpy(mha.params["w_v"]), sd["v_proj_weight"].numpy())
    if "in_proj_bias" in sd:
        np.testing.assert_array_equal(to_numpy(mha.params["b_v"]), sd["in_proj_bias"].numpy()[2 * D :])
    if "bias_k" in sd:
        np.testing.assert_array_equal(to_numpy(mha.params["bias_k"]), sd["bias_k"].numpy().reshape(D))
    assert mha.add_zero_attn == bool(kw.get("add_zero_attn", False))
    back = mha.torch_state_dict()
    assert list(back) == list(sd)
    for k in sd:
        assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]), k
    tm2 = torch.nn.MultiheadAttention(6, 2, dtype=torch.float64, **kw)
    tm2.load_state_dict(back)  # strict: same keys and shapes
    # export is a copy: changing it leaves the npattn module alone
    before = to_numpy(mha.params["w_o"])
    back["out_proj.weight"].add_(1.0)
    np.testing.assert_array_equal(to_numpy(mha.params["w_o"]), before)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_dtype_dropout_and_mode_follow_torch(dtype):
    tm = torch.nn.MultiheadAttention(4, 2, dropout=0.25, dtype=getattr(torch, dtype)).eval()
    mha = MultiHeadAttention.from_torch(tm)
    assert str(mha.params["w_q"].dtype) == dtype
    assert mha.dropout == 0.25 and mha.training is False
    assert mha.torch_state_dict()["in_proj_weight"].dtype == getattr(torch, dtype)


def test_a_module_of_mixed_dtypes_is_refused():
    """from_torch took the dtype of out_proj.weight and cast every other parameter to it: a
    float64 module whose out_proj.weight was float32 became a float32 copy, its in_proj_weight
    rounded silently (torch's own forward refuses the module: "expected the same dtype")."""
    tm = torch.nn.MultiheadAttention(4, 2, dtype=torch.float64)
    tm.out_proj.weight.data = tm.out_proj.weight.data.float()
    for call in (lambda: MultiHeadAttention.from_torch(tm), lambda: torch_interop.config_from_torch(tm)):
        with pytest.raises(ValueError, match=r"^module: expected parameters of one dtype .*got "
                                             r"float64 \(in_proj_weight, in_proj_bias, out_proj.bias\); "
                                             r"float32 \(out_proj.weight\)"):
            call()


def _as_buffers(tm):
    """``tm`` with each parameter moved into a buffer of the same name (same state dict keys)."""
    for mod in tm.modules():
        for n in list(mod._parameters):
            p = mod._parameters.pop(n)
            if p is not None:
                mod.register_buffer(n, p.detach())
    return tm


def test_a_module_without_parameters_takes_the_dtype_of_its_floating_buffers():
    """A float64 module whose weights are buffers (in its state dict all the same) was read as
    float32: from_torch made a float32 copy, its weights rounded silently."""
    tm = _as_buffers(_randomized(torch.nn.MultiheadAttention(4, 2, dtype=torch.float64)))
    assert not list(tm.parameters())
    assert torch_interop.module_dtype(tm) == "float64"
    mha = MultiHeadAttention.from_torch(tm)
    assert str(mha.params["w_q"].dtype) == "float64"
    np.testing.assert_array_equal(to_numpy(mha.params["w_q"]), tm.in_proj_weight[:4].numpy())
    tm.out_proj.weight = tm.out_proj.weight.float()  # the mixed buffers are named as parameters are
    with pytest.raises(ValueError, match=r"^module: expected buffers of one dtype .*got float64 "
                                         r"\(in_proj_weight, in_proj_bias, out_proj.bias\); "
                                         r"float32 \(out_proj.weight\)"):
        torch_interop.module_dtype(tm)


def test_a_module_without_parameters_or_floating_buffers_has_no_dtype():
    """No default dtype stands for a module that holds no floating-point tensor: a ValueError
    names the argument and the module."""
    holds_ints = torch.nn.Module()
    holds_ints.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    for module, kind in ((torch.nn.ReLU(), "ReLU"), (holds_ints, "Module")):
        with pytest.raises(ValueError, match=r"^layer: expected a module with parameters or "
                                             r"floating-point buffers .*got a " + kind + " with neither"):
            torch_interop.module_dtype(module, "layer")


def test_bfloat16_needs_a_backend_with_it():
    tm = torch.nn.MultiheadAttention(4, 2, dtype=torch.bfloat16)
    mha = MultiHeadAttention.from_torch(tm, backend="torch")
    assert mha.params["w_q"].dtype == torch.bfloat16
    assert torch.equal(mha.torch_state_dict()["in_proj_weight"], tm.in_proj_weight.detach())
    with pytest.raises(ValueError, match=r"^dtype: expected one of \['float16', 'float32', 'float64'\] "
                                         r"for backend 'numpy', got 'bfloat16'$"):
        MultiHeadAttention.from_torch(tm, backend="numpy")


def test_to_numpy_of_a_bfloat16_tensor_names_x():
    """NumPy has no bfloat16: ``to_numpy`` says so, naming its argument and the way out (it
    raised torch's own 'Got unsupported ScalarType BFloat16')."""
    with pytest.raises(TypeError, match=r"^x: expected a tensor of a dtype NumPy has, got torch\.bfloat16"):
        to_numpy(torch.ones(2, dtype=torch.bfloat16))


def test_load_casts_to_module_dtype_and_takes_numpy():
    tm = _randomized(torch.nn.MultiheadAttention(4, 2, dtype=torch.float64))
    mha = MultiHeadAttention(4, 2, dtype="float32")
    sd = {k: v.numpy() for k, v in tm.state_dict().items()}
    assert mha.load_torch_state_dict(sd) is mha
    assert mha.params["w_q"].dtype == np.float32
    np.testing.assert_array_equal(mha.params["b_o"], sd["out_proj.bias"].astype(np.float32))


def test_bad_state_dicts_are_named():
    mha = MultiHeadAttention(4, 2)
    sd = torch.nn.MultiheadAttention(4, 2).state_dict()
    before = {k: v.copy() for k, v in mha.params.items()}
    missing = {k: v for k, v in sd.items() if k != "in_proj_bias"}
    with pytest.raises(ValueError, match="missing \\['in_proj_bias'\\]"):
        mha.load_torch_state_dict(missing)
    with pytest.raises(ValueError, match="unexpected \\['bias_k'\\]"):
        mha.load_torch_state_dict({**sd, "bias_k": torch.zeros(1, 1, 4)})
    bad = dict(sd)
    bad["out_proj.weight"] = torch.zeros(4, 5)
    with pytest.raises(ValueError, match=r"out_proj.weight.*\(4, 4\).*\(4, 5\)"):
        mha.load_torch_state_dict(bad)
    for k in before:  # nothing was assigned by a failed load
        np.testing.assert_array_equal(mha.params[k], before[k])
    with pytest.raises(TypeError, match=r"^module: expected a torch\.nn\.MultiheadAttention, got Linear$"):
        MultiHeadAttention.from_torch(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="^state_dict: expected a mapping"):
        mha.load_torch_state_dict(None)
    with pytest.raises(TypeError, match=r"^state_dict\['in_proj_weight'\]: expected a tensor or array, got list"):
        mha.load_torch_state_dict({k: v.tolist() for k, v in sd.items()})
    with pytest.raises(TypeError, match=r"^state_dict\['in_proj_weight'\]: expected a floating tensor"):
        mha.load_torch_state_dict({k: v.to(torch.int64) for k, v in sd.items()})
    # meta tensors hold no numbers: named (torch's NotImplementedError came through)
    with pytest.raises(TypeError, match=r"^state_dict\['in_proj_weight'\]: expected a tensor whose "
                                        r"numbers can be copied to the host"):
        mha.load_torch_state_dict({k: torch.empty_like(v, device="meta") for k, v in sd.items()})
    with pytest.raises(TypeError, match="^mha: expected an npattn MultiHeadAttention, got object"):
        torch_interop.params_from_torch_state_dict(object(), sd)
    # a key that is no string (sorted() stopped on it: "'<' not supported between ...")
    with pytest.raises(ValueError, match=r"^state_dict: expected keys .*got \[0, .*unexpected \[0\]"):
        mha.load_torch_state_dict({**sd, 0: torch.zeros(1)})
    for k in before:
        np.testing.assert_array_equal(mha.params[k], before[k])


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(qdim=3), r"^qdim: torch\.nn\.MultiheadAttention needs qdim == d_model=4, got 3$"),
     (dict(n_kv_head=1), r"^n_kv_head: torch\.nn\.MultiheadAttention needs n_kv_head == n_head=2, got 1$"),
     (dict(qkv_bias=False), r"^qkv_bias, out_bias: torch\.nn\.MultiheadAttention has one bias flag for both, "
                            r"got qkv_bias=False, out_bias=True$")],
)
def test_layers_torch_cannot_express(kwargs, message):
    mha = MultiHeadAttention(4, 2, **kwargs)
    with pytest.raises(ValueError, match=message):
        mha.torch_state_dict()
    with pytest.raises(ValueError, match=message):
        mha.load_torch_state_dict(torch.nn.MultiheadAttention(4, 2).state_dict())


def test_config_and_host_params_build_the_module_without_it():
    """torch_interop hands over constructor arguments and host arrays; the module builds itself."""
    from npattn import torch_interop

    tm = _randomized(torch.nn.MultiheadAttention(6, 3, dropout=0.1, kdim=4, vdim=5,
                                                 add_bias_kv=True, dtype=torch.float64))
    config = torch_interop.config_from_torch(tm)
    assert config == dict(d_model=6, n_head=3, dropout=0.1, bias=True, qkv_bias=True,
                          out_bias=True, kdim=4, vdim=5, add_bias_kv=True, add_zero_attn=False,
                          dtype="float64")
    mha = MultiHeadAttention(**config)
    host = torch_interop.params_from_torch_state_dict(mha, tm.state_dict())
    assert list(host) == list(mha.params)
    assert all(type(a) is np.ndarray and a.dtype == np.float64 for a in host.values())
    np.testing.assert_array_equal(host["w_k"], tm.k_proj_weight.detach().numpy())
    np.testing.assert_array_equal(host["bias_v"], tm.bias_v.detach().numpy().reshape(6))
    host["w_o"][...] = 0.0  # copies: the torch module is untouched
    assert torch.count_nonzero(tm.out_proj.weight) > 0
    with pytest.raises(TypeError, match=r"^module: expected a torch\.nn\.MultiheadAttention, got Linear$"):
        torch_interop.config_from_torch(torch.nn.Linear(4, 4))


def test_bfloat16_state_dict_values_widen_to_float32_exactly():
    """bfloat16 has float32's exponent range: 2**20 and 2**-20 are bfloat16 numbers, which
    float32 holds exactly (float16 would make the first inf and the second subnormal)."""
    values = torch.tensor([2.0**20, -(2.0**-20), 1.5], dtype=torch.bfloat16)
    a = torch_interop.host_tensor("in_proj_bias", values)
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a, np.array([2.0**20, -(2.0**-20), 1.5], dtype=np.float32))


def test_options_read_the_output_bias_from_out_proj():
    """torch has one bias flag, but the output projection's bias is a parameter of its own:
    one set to None is read as out_bias=False (which npattn then refuses to convert)."""
    tm = torch.nn.MultiheadAttention(6, 2)
    tm.out_proj.bias = None
    opts = torch_interop.options_from_torch(tm)
    assert opts["qkv_bias"] is True and opts["out_bias"] is False


def test_host_params_are_arrays_of_their_own_not_views_of_in_proj():
    tm = _randomized(torch.nn.MultiheadAttention(6, 2, dtype=torch.float64))
    mha = MultiHeadAttention.from_torch(tm)
    params = torch_interop.params_from_torch_state_dict(mha, tm.state_dict())
    for name in ("w_q", "w_k", "w_v", "b_q", "b_k", "b_v"):
        assert params[name].base is None, name


def test_to_numpy_of_a_tensor_is_a_copy():
    t = torch.zeros(3, dtype=torch.float64)
    a = to_numpy(t)
    a[0] = 1.0
    assert t[0].item() == 0.0


def test_host_tensor_is_a_copy_of_the_tensor():
    """host_tensor is documented as a host copy: writing into it must not reach the tensor
    (``Tensor.numpy()`` alone shares the tensor's memory)."""
    t = torch.zeros(3, dtype=torch.float64)
    a = torch_interop.host_tensor("out_proj.bias", t)
    a[0] = 1.0
    assert t[0].item() == 0.0


def test_the_functions_themselves_refuse_sinks():
    """torch has no place for sinks: torch_interop's own functions refuse such a layer, not
    only the module's methods (a direct call converted it without the parameter)."""
    mha = MultiHeadAttention(4, 2, sinks=True)
    with pytest.raises(ValueError, match="^sinks"):
        torch_interop.torch_state_dict(mha)
    with pytest.raises(ValueError, match="^sinks"):
        torch_interop.params_from_torch_state_dict(mha, torch.nn.MultiheadAttention(4, 2).state_dict())


def test_a_state_dict_value_of_the_right_size_but_wrong_shape_is_refused():
    """k_proj_weight is (D, kdim): its transpose (kdim, D) has the same size and would load as
    a w_k of the wrong layout; bias_k is (1, 1, D), and (D,) is refused too."""
    tm = torch.nn.MultiheadAttention(4, 2, kdim=3, vdim=5, add_bias_kv=True)
    mha = MultiHeadAttention.from_torch(tm)
    sd = tm.state_dict()
    with pytest.raises(ValueError, match=r"k_proj_weight.*\(4, 3\).*\(3, 4\)"):
        mha.load_torch_state_dict({**sd, "k_proj_weight": sd["k_proj_weight"].T})
    with pytest.raises(ValueError, match=r"bias_k.*\(1, 1, 4\).*\(4,\)"):
        mha.load_torch_state_dict({**sd, "bias_k": sd["bias_k"].reshape(4)})


def test_a_layout_without_params_is_refused_by_name():
    """An object with every layout attribute but ``params`` is no module: the conversions read
    its parameters, so it is refused up front with a TypeError naming what it lacks (not an
    AttributeError once the state dict has been checked)."""
    from types import SimpleNamespace

    layout = SimpleNamespace(d_model=4, n_head=2, n_kv_head=2, qdim=4, kdim=4, vdim=4, qkv_bias=True,
                             out_bias=True, add_bias_kv=False)
    sd = torch.nn.MultiheadAttention(4, 2).state_dict()
    for call in (lambda: torch_interop.torch_state_dict_shapes(layout),
                 lambda: torch_interop.params_from_torch_state_dict(layout, sd),
                 lambda: torch_interop.torch_state_dict(layout)):
        with pytest.raises(TypeError, match=r"^mha: expected an npattn MultiHeadAttention, got "
                                            r"types.SimpleNamespace \(without params\)$"):
            call()


def test_a_value_with_a_shape_but_no_dtype_is_no_tensor():
    """A state dict value needs a shape and a dtype to be a tensor or array: one with a shape
    alone is refused as such, before any copy to the host is tried."""

    class ShapeOnly:
        shape = (4,)

    with pytest.raises(TypeError, match=r"^state_dict\['out_proj.bias'\]: expected a tensor or array, "
                                        r"got \S*ShapeOnly$"):
        torch_interop.host_tensor("out_proj.bias", ShapeOnly())


def test_a_masked_array_value_is_refused_and_nothing_is_loaded():
    """A NumPy masked array in a state dict: its host copy kept the data and dropped the mask,
    so the masked entries were loaded as whatever numbers lay under them. Refused by name,
    as npattn refuses masked arrays everywhere, before any parameter changes; the message says
    how to take the data of each kind (NumPy's np.ma.getdata would not take dask's)."""
    tm = _randomized(torch.nn.MultiheadAttention(4, 2, dtype=torch.float64))
    mha = MultiHeadAttention(4, 2, dtype="float64")
    before = {k: v.copy() for k, v in mha.params.items()}
    sd = {k: v.numpy().copy() for k, v in tm.state_dict().items()}
    w = sd["in_proj_weight"]
    sd["in_proj_weight"] = np.ma.MaskedArray(w, mask=np.eye(12, 4, dtype=bool))
    with pytest.raises(TypeError, match=r"^state_dict\['in_proj_weight'\]: expected a tensor or a plain "
                                        r"array, got numpy\.ma\.MaskedArray \(npattn would ignore its mask\); "
                                        r"pass its data, np\.ma\.getdata\(a\), with the masked entries"):
        mha.load_torch_state_dict(sd)
    for k in before:
        np.testing.assert_array_equal(mha.params[k], before[k])
    np.testing.assert_array_equal(np.ma.getdata(sd["in_proj_weight"]), w)  # the argument unchanged
    da = pytest.importorskip("dask.array")  # a dask array of masked chunks keeps its mask as well
    sd["in_proj_weight"] = da.ma.masked_array(da.from_array(w, chunks=4),
                                              mask=da.from_array(np.eye(12, 4, dtype=bool), chunks=4))
    with pytest.raises(TypeError, match=r"^state_dict\['in_proj_weight'\]: expected a tensor or a plain "
                                        r"array, got a dask array of numpy\.ma\.MaskedArray chunks "
                                        r"\(npattn would ignore its mask\); pass its data, "
                                        r"dask\.array\.ma\.getdata\(a\),"):
        mha.load_torch_state_dict(sd)
    for k in before:
        np.testing.assert_array_equal(mha.params[k], before[k])
    sd["in_proj_weight"] = np.ma.MaskedArray(w, mask=np.eye(12, 4, dtype=bool))
    sd["in_proj_weight"] = np.ma.getdata(sd["in_proj_weight"])  # its data, as the message says
    mha.load_torch_state_dict(sd)
    np.testing.assert_array_equal(mha.params["w_k"], w[4:8])


def test_unexpected_keys_are_listed_in_order():
    """Several unexpected keys are named sorted, so the message is the same from run to run
    (a set's order of strings changes with the process's hash seed)."""
    mha = MultiHeadAttention(4, 2)
    sd = torch.nn.MultiheadAttention(4, 2).state_dict()
    extra = ["f", "b", "e", "a", "d", "c"]
    with pytest.raises(ValueError, match=r"unexpected \['a', 'b', 'c', 'd', 'e', 'f'\]\)$"):
        mha.load_torch_state_dict({**sd, **{k: torch.zeros(1) for k in extra}})


def test_a_subclass_with_its_own_forward_is_refused():
    """A subclass of torch.nn.MultiheadAttention with its own forward (here one that doubles the
    output) was copied as torch's module: the copy computed half the subclass's output, without a
    word. A subclass that only adds a method computes as torch does, and is copied."""

    class Doubled(torch.nn.MultiheadAttention):
        def forward(self, *args, **kwargs):
            out, weights = super().forward(*args, **kwargs)
            return 2.0 * out, weights

    class Described(torch.nn.MultiheadAttention):
        def describe(self):
            return f"{self.num_heads} heads"

    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    tm = _randomized(Doubled(4, 2, batch_first=True, dtype=torch.float64))
    plain = torch.nn.MultiheadAttention(4, 2, batch_first=True, dtype=torch.float64)
    plain.load_state_dict(tm.state_dict())
    assert not torch.allclose(tm(x, x, x)[0], plain(x, x, x)[0])  # it does compute otherwise
    message = (r"^module: expected torch\.nn\.MultiheadAttention's forward \(npattn computes as torch's "
               r"module does\), got a .*Doubled with its own$")
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention.from_torch(tm)
    with pytest.raises(ValueError, match=message):
        torch_interop.config_from_torch(tm)

    td = _randomized(Described(4, 2, batch_first=True, dtype=torch.float64)).eval()
    out, _ = MultiHeadAttention.from_torch(td)(*(x.numpy(),) * 3)
    np.testing.assert_allclose(out, td(x, x, x)[0].detach().numpy(), rtol=0, atol=1e-12)


def test_weights_held_otherwise_are_named_as_the_modules():
    """A module whose in_proj_weight is parametrized (or pruned) has other state dict keys:
    from_torch refused it as 'state_dict: expected keys ...', an argument its caller never
    passed; the message now names the module's state dict."""
    import torch.nn.utils.prune  # noqa: F401  (torch.nn.utils does not import it)

    tm = torch.nn.MultiheadAttention(4, 2, batch_first=True, dtype=torch.float64)
    torch.nn.utils.parametrize.register_parametrization(tm, "in_proj_weight", torch.nn.Identity())
    with pytest.raises(ValueError, match=r"^module\.state_dict\(\): expected keys \['in_proj_weight', .*"
                                         r"unexpected \['parametrizations\.in_proj_weight\.original'\]\)$"):
        MultiHeadAttention.from_torch(tm)
    tm = torch.nn.MultiheadAttention(4, 2, batch_first=True, dtype=torch.float64)
    torch.nn.utils.prune.random_unstructured(tm, "in_proj_weight", 0.5)
    with pytest.raises(ValueError, match=r"^module\.state_dict\(\): expected keys .*missing "
                                         r"\['in_proj_weight'\], unexpected \['in_proj_weight_mask', "
                                         r"'in_proj_weight_orig'\]\)$"):
        MultiHeadAttention.from_torch(tm)
