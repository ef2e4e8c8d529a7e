"""npattn.masks: causal / padding builders and the torch MHA mask adapter.

Against torch where torch defines the behaviour (nn.MultiheadAttention with
its own masks vs npattn with the converted mask); structural properties
otherwise, on every backend.
"""

import importlib.util
import math
import re

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from npattn import MultiHeadAttention, masks
from npattn import functional as F
from npattn.backend import backend_name, device_of, namespace, resolve_backend

# --------------------------------------------------------------------------
# causal


@settings(max_examples=25)
@given(Lq=st.integers(0, 7), Lk=st.integers(0, 7))
def test_causal_alignments_are_corners_of_a_square(Lq, Lk):
    """top-left is the top-left corner of the square causal mask; bottom-right
    the bottom-right corner (Lq new queries at the end of Lk keys)."""
    M = max(Lq, Lk)
    square = np.tril(np.ones((M, M), dtype=bool))  # query i sees j <= i
    tl = np.asarray(masks.causal(Lq, Lk))
    br = np.asarray(masks.causal(Lq, Lk, align="bottom_right"))
    assert tl.shape == br.shape == (Lq, Lk) and tl.dtype == br.dtype == np.bool_
    np.testing.assert_array_equal(tl, square[:Lq, :Lk])
    np.testing.assert_array_equal(br, square[M - Lq:, M - Lk:])
    if Lq == Lk:
        np.testing.assert_array_equal(tl, br)
    # bottom-right: the last query sees every key
    if Lq and Lk:
        assert br[-1].all()


def test_causal_top_left_is_sdpa_is_causal(xp, to_xp, to_np):
    rng = np.random.default_rng(0)
    q, k, v = (to_xp(rng.standard_normal(s)) for s in [(2, 2, 5, 3), (2, 2, 3, 3), (2, 2, 3, 3)])
    ref, _ = F.sdpa_forward(q, k, v, is_causal=True)
    out, _ = F.sdpa_forward(q, k, v, mask=masks.causal(5, 3, xp=xp))
    np.testing.assert_array_equal(to_np(out), to_np(ref))


def test_causal_bottom_right_empty_rows_are_zero(xp, to_xp, to_np):
    rng = np.random.default_rng(1)
    q = to_xp(rng.standard_normal((2, 2, 5, 3)))
    k, v = (to_xp(rng.standard_normal((2, 2, 3, 3))) for _ in range(2))
    out, cache = F.sdpa_forward(q, k, v, mask=masks.causal(5, 3, "bottom_right", xp=xp))
    out = to_np(out)
    assert np.all(out[:, :, :2] == 0.0)  # queries 0, 1 see no key
    assert np.all(np.isfinite(out)) and np.all(np.abs(out[:, :, 2:]) > 0.0)


def test_causal_bad_arguments():
    with pytest.raises(ValueError, match="^align: expected 'top_left' or 'bottom_right', got 'top-left'$"):
        masks.causal(2, 3, align="top-left")
    with pytest.raises(ValueError, match="^Lk: expected an int >= 0, got -1$"):
        masks.causal(2, -1)
    # a bad xp= is named as the argument it was given as
    with pytest.raises(ValueError, match=r"^xp: expected one of \[.*'numpy'.*\], got 'nope'$"):
        masks.causal(2, 3, xp="nope")
    with pytest.raises(TypeError, match="^xp: expected one of .* or a namespace module, got int"):
        masks.window(2, 3, 1, 1, xp=5)
    # each side of a window is named as itself
    with pytest.raises(ValueError, match="^left: expected an int >= 0, got -1"):
        masks.window(2, 3, -1, 0)
    with pytest.raises(TypeError, match="^right: expected an int >= 0, got float 1.5"):
        masks.window(2, 3, 0, 1.5)


@settings(max_examples=60)
@given(Lq=st.integers(0, 6), Lk=st.integers(0, 6), align=st.sampled_from(["top_left", "bottom_right"]),
       left=st.none() | st.integers(0, 14), right=st.none() | st.integers(0, 14))
# a side of 0 is a bound (the diagonal only on that side), not "no bound": named explicitly,
# since the search need not draw it where it matters
@example(Lq=3, Lk=3, align="top_left", left=0, right=None)
@example(Lq=2, Lk=4, align="bottom_right", left=0, right=1)
def test_window_is_its_definition_for_sides_of_every_size(Lq, Lk, align, left, right):
    """Query i at key position i + o sees j with i + o - left <= j <= i + o + right, pair by
    pair, for sides below, between and past the lengths (a side longer than the shorter length
    can still leave keys out: window(5, 2, 3, None) hides key 0 from query 4; one of
    max(Lq, Lk) - 1 or more leaves none out, whatever the align)."""
    o = 0 if align == "top_left" else Lk - Lq
    want = np.array([[(left is None or j >= i + o - left) and (right is None or j <= i + o + right)
                      for j in range(Lk)] for i in range(Lq)], dtype=bool).reshape(Lq, Lk)
    np.testing.assert_array_equal(masks.window(Lq, Lk, left, right, align), want)


# --------------------------------------------------------------------------
# padding


@settings(max_examples=20)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=4), extra=st.integers(0, 2))
def test_padding_properties(lengths, extra):
    Lk = max(lengths) + extra
    m = np.asarray(masks.padding(lengths, Lk))
    assert m.shape == (len(lengths), 1, 1, Lk) and m.dtype == np.bool_
    np.testing.assert_array_equal(m.sum(axis=-1).ravel(), lengths)
    # a prefix: once a key is padding, every later key is too
    assert np.all(np.diff(m.astype(int), axis=-1) <= 0)


def test_padding_of_no_batch_entries():
    """B = 0 (a sequence or an array of no lengths) is an empty mask, not NumPy's 'zero-size
    array to reduction operation' from the range check."""
    for lengths in ([], (), np.zeros(0, dtype=np.int64)):
        m = np.asarray(masks.padding(lengths, 3))
        assert m.shape == (0, 1, 1, 3) and m.dtype == np.bool_


def test_padding_of_a_sequence_is_made_on_xp(backend, xp, to_np):
    """A list of lengths is created with ``xp`` (an array keeps its own library)."""
    m = masks.padding([2, 0, 3], 3, xp=backend)
    assert backend_name(namespace(m)) == backend_name(xp)
    np.testing.assert_array_equal(to_np(m)[:, 0, 0], [[True, True, False], [False] * 3, [True] * 3])


def test_padding_on_backend_keeps_device(xp, to_xp, to_np):
    lengths = to_xp(np.array([3, 0, 5]))
    m = masks.padding(lengths, 5)
    assert device_of(m) == device_of(lengths)
    np.testing.assert_array_equal(to_np(m).sum(axis=-1).ravel(), [3, 0, 5])
    # the length-0 entry: nothing to attend, zero output, never NaN
    rng = np.random.default_rng(2)
    q, k, v = (to_xp(rng.standard_normal(s)) for s in [(3, 2, 4, 2), (3, 2, 5, 2), (3, 2, 5, 2)])
    out, _ = F.sdpa_forward(q, k, v, mask=m)
    out = to_np(out)
    assert np.all(out[1] == 0.0) and np.all(np.isfinite(out))


def test_sizes_beyond_the_index_dtype_and_unsigned_sizes(backend, xp, to_np):
    """A window side of 2**63 or more is unbounded on every library (torch wrapped it to a
    negative bound, array_api_strict refused it), NumPy unsigned sizes are ints (uint64(1)
    negated wrapped), and lengths of a small integer dtype count keys past its range."""
    i, j = np.arange(3)[:, None], np.arange(4)[None, :]
    for left, right, want in ((None, 2**63, np.ones((3, 4), bool)), (2**64, 0, j <= i),
                              (np.uint64(1), np.uint8(0), (j <= i) & (j >= i - 1))):
        np.testing.assert_array_equal(to_np(masks.window(3, 4, left, right, xp=backend)), want)
    want = np.array([[False, False], [True, False], [True, True]])  # bottom-right, Lq > Lk
    np.testing.assert_array_equal(to_np(masks.causal(np.uint8(3), np.uint8(2), "bottom_right", xp=backend)),
                                  want)
    lengths = xp.asarray(np.array([200, 0], dtype=np.uint8))  # (200 is past int8's range)
    m = to_np(masks.padding(lengths, 300))  # arange(300) in uint8 wrapped at 256
    np.testing.assert_array_equal(m.sum(axis=-1).ravel(), [200, 0])


def test_segments_is_its_definition(xp, to_xp, to_np):
    """mask[b, 0, i, j] = (q_segments[b, i] == k_segments[b, j]), one head axis: (B, 1, Lq, Lk)."""
    qs = np.array([[0, 0, 1], [2, 2, 2]])  # B = 2, Lq = 3
    ks = np.array([[0, 1, 1, 1], [2, 3, 3, 2]])  # Lk = 4
    m = to_np(masks.segments(to_xp(qs), to_xp(ks)))
    assert m.shape == (2, 1, 3, 4)
    expected = np.array([[[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 1]],   # entry 0: documents 0 and 1
                         [[1, 0, 0, 1], [1, 0, 0, 1], [1, 0, 0, 1]]], dtype=bool)  # entry 1: 2
    np.testing.assert_array_equal(m[:, 0], expected)


def test_segments_bad_arguments():
    with pytest.raises(TypeError, match="^q_segments: expected an array, got None"):
        masks.segments(None, np.zeros((1, 2), dtype=np.int64))
    ids = np.zeros((2, 3), dtype=np.int64)
    # one sequence of ids (no batch axis) and batch entries that differ in number are refused,
    # not broadcast: one row of q_segments against two of k_segments would pair them silently
    with pytest.raises(ValueError, match=r"^q_segments: expected shape \(B, L\), got shape \(3,\)"):
        masks.segments(ids[0], ids)
    with pytest.raises(ValueError, match=r"^k_segments: expected shape \(B, L\), got shape \(3,\)"):
        masks.segments(ids, ids[0])
    with pytest.raises(ValueError, match=r"^k_segments: expected 1 batch entries like q_segments, "
                                         r"got shape \(2, 3\)"):
        masks.segments(ids[:1], ids)
    # more axes than (B, L) are refused as well, not compared along a trailing axis
    with pytest.raises(ValueError, match=r"^q_segments: expected shape \(B, L\), got shape \(2, 3, 1\)"):
        masks.segments(ids[..., None], ids)
    with pytest.raises(ValueError, match=r"^k_segments: expected shape \(B, L\), got shape \(2, 3, 1\)"):
        masks.segments(ids, ids[..., None])
    # ids are integers: floating ids (which == would compare after rounding) are refused by name
    with pytest.raises(TypeError, match="^q_segments: expected an integer array, got dtype float64"):
        masks.segments(ids.astype(np.float64), ids)
    with pytest.raises(TypeError, match="^k_segments: expected an integer array, got dtype float32"):
        masks.segments(ids, ids.astype(np.float32))


def test_padding_takes_unsigned_lengths_on_every_backend(backend, xp, to_np):
    """Unsigned lengths of every width count keys as a list of ints does: torch promotes
    no uint16/32/64 with the int64 key positions and array_api_strict no uint64 (a
    RuntimeError / TypeError from the comparison if the lengths kept their dtype)."""
    for name in ("uint8", "uint16", "uint32", "uint64"):
        if not hasattr(xp, name):
            continue
        lengths = xp.asarray(np.array([5, 0, 2]), dtype=getattr(xp, name))
        m = to_np(masks.padding(lengths, 6))
        np.testing.assert_array_equal(m[:, 0, 0], np.arange(6)[None, :] < np.array([5, 0, 2])[:, None],
                                      err_msg=name)


def test_padding_bad_arguments():
    with pytest.raises(ValueError, match=r"^lengths: expected values in \[0, Lk=3\], got \[1, 4\]$"):
        masks.padding([1, 4], 3)
    with pytest.raises(ValueError, match=r"^lengths: expected shape \(B,\), got shape \(1, 2\)$"):
        masks.padding(np.array([[1, 2]]), 3)
    with pytest.raises(ValueError, match=r"^lengths: expected shape \(B,\), got shape \(\)"):
        masks.padding(np.array(3), 4)  # one length, no batch axis
    # an array's values are checked as a list's: Lk + 1 would mean Lk keys, -1 none
    for bad in ([4, 1], [-1, 1]):
        for lengths in (np.array(bad), bad):
            with pytest.raises(ValueError,
                               match=r"^lengths: expected values in \[0, Lk=3\], "
                                     rf"got {re.escape(str(bad))}$"):
                masks.padding(lengths, 3)
    with pytest.raises(TypeError, match="^lengths: expected an integer array, got dtype float64$"):
        masks.padding(np.array([1.0, 2.0]), 3)
    # a bool is no length (True would count as one key)
    with pytest.raises(TypeError, match=r"^lengths: expected ints, got \[True, 2\]"):
        masks.padding([True, 2], 3)
    # Lk is checked first, by name (-1 was reported as lengths out of [0, Lk=-1])
    with pytest.raises(ValueError, match="^Lk: expected an int >= 0, got -1"):
        masks.padding([1], -1)
    with pytest.raises(TypeError, match="^Lk: expected an int >= 0, got float 2.0"):
        masks.padding([1], 2.0)
    for lengths, received in ((3, "int 3"), (None, "None"), ({1, 2}, "set {1, 2}"),
                              ({0: 1, 1: 2}, "dict {0: 1, 1: 2}")):  # a set or a dict has no order
        with pytest.raises(TypeError, match=r"^lengths: expected an integer array of shape \(B,\) or a "
                                            rf"sequence of ints \(list, tuple, range\), got {received}$"):
            masks.padding(lengths, 3)
    with pytest.raises(ValueError, match=rf"^lengths: expected values in \[0, Lk=4\], got \[{10**30}, 1\]$"):
        masks.padding([10**30, 1], 4)  # (an OverflowError in asarray before)
    with pytest.raises(ValueError, match=rf"^lengths: expected values in \[0, Lk=4\], got \[{-10**30}, 1\]$"):
        masks.padding([-10**30, 1], 4)  # below the index dtype too, refused before asarray
    with pytest.raises(TypeError, match="^lengths: expected a plain numpy.ndarray, got numpy.ma"):
        masks.padding(np.ma.array([1, 2], mask=[False, True]), 3)  # the mask would be ignored
    with pytest.raises(TypeError,
                       match=r"^xp: expected None or the library of lengths \(numpy\), "
                             r"got array_api_strict$"):
        masks.padding(np.array([1, 2]), 3, xp="array_api_strict")
    with pytest.raises(ValueError, match=r"^xp: expected one of \[.*'numpy'.*\], got 'nope'$"):
        masks.padding(np.array([1, 2]), 3, xp="nope")
    with pytest.raises(ValueError,
                       match=r"^device: expected None or the device of lengths \('cpu'\), got 'elsewhere'$"):
        masks.padding(np.array([1, 2]), 3, device="elsewhere")
    # a sequence is created on device=: one the backend lacks is named (NumPy's own message does not)
    with pytest.raises(ValueError, match="^device: expected a device of the numpy backend, got 'elsewhere'"):
        masks.padding([1, 2], 3, device="elsewhere")
    np.testing.assert_array_equal(masks.padding(np.array([1, 2]), 3, xp="numpy", device="cpu"),
                                  masks.padding((1, 2), 3))
    # a range is a sequence of ints as well
    np.testing.assert_array_equal(masks.padding(range(1, 3), 3)[:, 0, 0],
                                  [[True, False, False], [True, True, False]])


def _zero_view(backend, shape, dtype="int8"):
    """Zeros of ``shape``, a broadcast view of one entry: an array of any size, in no memory."""
    xp = resolve_backend(backend)
    one = xp.zeros((1,) * len(shape), dtype=getattr(xp, dtype))
    return xp.broadcast_to(one, shape)


@pytest.mark.parametrize("build, match", [
    (lambda xp: masks.causal(2**56, 2**56, xp=xp),
     rf"^Lq and Lk: expected sizes for which .*, "
     rf"an array of shape \({2**56}, {2**56}\) \(8 bytes an entry\)"),
    (lambda xp: masks.causal(3, 2**62, "bottom_right", xp=xp), rf"^Lq and Lk: .*got {3 * 2**62 * 8} bytes$"),
    (lambda xp: masks.window(2**56, 2**31, 1, None, xp=xp), r"^Lq and Lk: expected sizes"),
    (lambda xp: masks.padding([1, 1], 2**62, xp=xp),
     rf"^Lk: expected sizes for which the key positions, "
     rf"an array of shape \({2**62},\) .*got {2**65} bytes$"),
    (lambda xp: masks.padding([0] * 16, 2**59, xp=xp),  # positions of 2**62 bytes, a mask of 2**63
     rf"^lengths and Lk: expected sizes for which the mask, an array of shape \(16, 1, 1, {2**59}\) "
     r"\(1 byte an entry\)"),
    # segment ids of (1, 2**32) each, as views: a mask of 2**64 bytes
    (lambda xp: masks.segments(_zero_view(xp, (1, 2**32)), _zero_view(xp, (1, 2**32))),
     rf"^q_segments and k_segments: expected sizes for which the mask, an array of shape "
     rf"\(1, 1, {2**32}, {2**32}\) \(1 byte an entry\), .*got {2**64} bytes$"),
])
def test_a_mask_that_cannot_exist_is_refused_naming_its_sizes(backend, build, match):
    """A mask, or the positions it is built from, larger than the largest array (sys.maxsize
    bytes) is refused before anything is made, naming the sizes (NumPy's "array is too big"
    named none); the limit is said too."""
    import sys

    with pytest.raises(ValueError, match=match) as info:
        build(backend)
    assert f"fits in {sys.maxsize} bytes (the largest array)" in str(info.value)


def test_masks_on_strict_second_device():
    xps = pytest.importorskip("array_api_strict")
    dev = xps.Device("device1")
    c = masks.causal(3, 4, xp=xps, device=dev)
    assert c.device == dev
    p = masks.padding(xps.asarray([1, 2], device=dev), 4)
    assert p.device == dev
    kpm = xps.asarray(np.array([[False, True]]), device=dev)
    assert masks.from_torch_mha(key_padding_mask=kpm).device == dev
    # device= without xp= moves the result on the masks' own backend (it was ignored: the
    # mask stayed where it was)
    here = xps.asarray(np.array([[False, True]]))
    moved = masks.from_torch_mha(key_padding_mask=here, device=dev)
    assert moved.device == dev
    np.testing.assert_array_equal(np.asarray(xps.asarray(moved, device=here.device)),
                                  [[[[True, False]]]])
    # a floating result as well: the 0 / -inf of a boolean mask are made on its device
    f = masks.from_torch_mha(key_padding_mask=kpm, dtype="float64")
    assert f.device == dev
    np.testing.assert_array_equal(np.asarray(xps.asarray(f, device=here.device)), [[[[0.0, -np.inf]]]])


# --------------------------------------------------------------------------
# from_torch_mha without torch: structure


@settings(max_examples=20)
@given(N=st.integers(1, 3), H=st.integers(1, 3), L=st.integers(1, 4), S=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_from_torch_mha_structure(N, H, L, S, seed):
    rng = np.random.default_rng(seed)
    a2 = rng.random((L, S)) < 0.3  # True = ignore
    a3 = rng.random((N * H, L, S)) < 0.3
    kpm = rng.random((N, S)) < 0.3
    m = masks.from_torch_mha(a2)
    np.testing.assert_array_equal(m, ~a2[None, None])
    # a 3-D mask of one entry, (1, L, S), needs no n_head
    np.testing.assert_array_equal(masks.from_torch_mha(a2[None]), ~a2[None, None])
    m = masks.from_torch_mha(a3, n_head=H)
    assert m.shape == (N, H, L, S)
    for n in range(N):
        for h in range(H):  # torch's entry n*H + h is batch n, head h
            np.testing.assert_array_equal(m[n, h], ~a3[n * H + h])
    np.testing.assert_array_equal(masks.from_torch_mha(a3, batch_size=N), m)
    m = masks.from_torch_mha(a2, kpm)
    np.testing.assert_array_equal(m, ~a2[None, None] & ~kpm[:, None, None, :])
    # an unbatched key_padding_mask, (S,), is one batch entry's: (1, 1, 1, S)
    m = masks.from_torch_mha(key_padding_mask=kpm[0])
    assert m.shape == (1, 1, 1, S)
    np.testing.assert_array_equal(m[0, 0, 0], ~kpm[0])
    np.testing.assert_array_equal(masks.from_torch_mha(a2, kpm[0]), ~a2[None, None] & ~kpm[0])
    # the floating form of the same masks gives the same softmax
    f = masks.from_torch_mha(a3, kpm, n_head=H, dtype=np.float64)
    b = masks.from_torch_mha(a3, kpm, n_head=H)
    assert f.dtype == np.float64 and set(np.unique(f)) <= {0.0, -math.inf}
    x = rng.standard_normal((N, H, L, S))
    np.testing.assert_array_equal(F.masked_softmax_forward(x, f)[0], F.masked_softmax_forward(x, b)[0])
    # float masks are added, bools become -inf
    fa = rng.standard_normal((L, S))
    fk = rng.standard_normal((N, S))
    np.testing.assert_allclose(masks.from_torch_mha(fa, fk), fa[None, None] + fk[:, None, None, :])
    out = masks.from_torch_mha(fa, kpm)
    np.testing.assert_array_equal(out, np.where(kpm[:, None, None, :], -np.inf, fa[None, None]))


def test_from_torch_mha_bad_arguments():
    a3 = np.zeros((6, 2, 3), dtype=bool)
    assert masks.from_torch_mha() is None
    with pytest.raises(ValueError, match=r"^attn_mask: a 3-D mask of shape \(6, 2, 3\) needs n_head= "
                                         r"\(or batch_size=\) to split its first axis N\*H$"):
        masks.from_torch_mha(a3)
    with pytest.raises(ValueError, match=r"^attn_mask: expected first axis N\*H = 1\*4 = 4, "
                                         r"got shape \(6, 2, 3\)"):
        masks.from_torch_mha(a3, n_head=4)
    with pytest.raises(ValueError, match=r"^attn_mask: expected first axis N\*H = 2\*2 = 4, "
                                         r"got shape \(6, 2, 3\)"):
        masks.from_torch_mha(a3, n_head=2, batch_size=2)
    with pytest.raises(ValueError, match="^key_padding_mask: expected S=3 keys like attn_mask, got 4"):
        masks.from_torch_mha(np.zeros((2, 3), bool), np.zeros((2, 4), bool))
    with pytest.raises(ValueError, match=r"^key_padding_mask: expected N=batch_size=3, got shape \(2, 4\)"):
        masks.from_torch_mha(key_padding_mask=np.zeros((2, 4), bool), batch_size=3)
    # a key_padding_mask of more axes than (N, S) is refused by name (not an unpacking error)
    with pytest.raises(ValueError, match=r"^key_padding_mask: expected shape \(N, S\) or \(S,\), "
                                         r"got shape \(2, 1, 4\)"):
        masks.from_torch_mha(key_padding_mask=np.zeros((2, 1, 4), bool))
    # N*H = 6 split by n_head=2 is N = 3, against a key_padding_mask of N = 2
    with pytest.raises(ValueError, match="^key_padding_mask: expected N=3 like attn_mask, got 2"):
        masks.from_torch_mha(a3, np.zeros((2, 3), bool), n_head=2)
    with pytest.raises(TypeError,
                       match="^attn_mask: expected a bool or real floating array, got dtype int64$"):
        masks.from_torch_mha(np.zeros((2, 3), dtype=np.int64))
    for kpm in (np.zeros((2, 3), dtype=np.int64), np.zeros(3, dtype=np.int64)):  # batched or not
        with pytest.raises(TypeError,
                           match="^key_padding_mask: expected a bool or real floating array, "
                                 "got dtype int64$"):
            masks.from_torch_mha(key_padding_mask=kpm)
    # not arrays: named, not "libraries mixed"
    with pytest.raises(TypeError, match="^attn_mask: expected an array, got list"):
        masks.from_torch_mha([[True, False]])
    with pytest.raises(TypeError, match="^key_padding_mask: expected an array, got list"):
        masks.from_torch_mha(np.zeros((2, 3), bool), [[True, False, True]])
    with pytest.raises(ValueError, match=r"^xp: expected one of \[.*'numpy'.*\], got 'nope'$"):
        masks.from_torch_mha(np.zeros((2, 3), bool), xp="nope")
    # a device the target backend lacks is named, with xp= or without
    for kw in (dict(xp="numpy"), {}):
        with pytest.raises(ValueError, match="^device: expected a device of the numpy backend, got 'elsewhere'"):
            masks.from_torch_mha(np.zeros((2, 3), bool), device="elsewhere", **kw)
    with pytest.raises(ValueError,
                       match=r"^attn_mask: expected shape \(L, S\) or \(N\*H, L, S\), "
                             r"got shape \(1, 1, 2, 3\)$"):
        masks.from_torch_mha(np.zeros((1, 1, 2, 3), bool))
    # fewer axes than (L, S) are refused by name too (not an unpacking error)
    for bad in (np.zeros(3, bool), np.zeros((), bool)):
        with pytest.raises(ValueError, match=r"^attn_mask: expected shape \(L, S\) or \(N\*H, L, S\), "
                                             rf"got shape {re.escape(str(bad.shape))}$"):
            masks.from_torch_mha(bad)
    # dtype must be floating (an int or bool additive mask cannot hold -inf)
    additive = np.array([[0.0, -np.inf], [1.5, 0.0]])
    for dtype in (np.bool_, np.int64, np.complex128, "int8", "half-precision"):
        with pytest.raises(TypeError, match=r"^dtype: expected None or a real floating dtype of the masks' "
                                            rf"library \(numpy\) or its name, got {re.escape(repr(dtype))}$"):
            masks.from_torch_mha(additive, dtype=dtype)
    with pytest.raises(TypeError, match=r"^dtype: expected None or a real floating dtype .*, "
                                        rf"got {re.escape(repr(np.int32))}$"):
        masks.from_torch_mha(np.zeros((2, 3), bool), dtype=np.int32)
    with pytest.raises(TypeError, match=r"^n_head: expected a positive int, got float 2\.0$"):
        masks.from_torch_mha(a3, n_head=2.0)
    with pytest.raises(ValueError, match="^batch_size: expected a positive int, got 0"):
        masks.from_torch_mha(a3, batch_size=0)
    assert masks.from_torch_mha(additive, dtype="float32").dtype == np.float32
    # NumPy ints are ints
    np.testing.assert_array_equal(masks.from_torch_mha(a3, n_head=np.int64(2)),
                                  masks.from_torch_mha(a3, n_head=2))


def test_from_torch_mha_broadcasts_an_unbatched_key_padding_mask_over_a_batched_attn_mask():
    """A key_padding_mask of shape (S,) is one entry's, (1, 1, 1, S): it broadcasts over the N
    batch entries of a 3-D attn_mask (N*H, L, S), as it does over a 2-D one."""
    N, H, L, S = 3, 2, 2, 4
    rng = np.random.default_rng(22)
    a3 = rng.random((N * H, L, S)) < 0.4  # True = ignore
    kpm = np.array([False, True, False, True])
    m = masks.from_torch_mha(a3, kpm, n_head=H)
    assert m.shape == (N, H, L, S)
    np.testing.assert_array_equal(m, ~a3.reshape(N, H, L, S) & ~kpm)
    f = masks.from_torch_mha(a3.astype(np.float64), kpm, n_head=H)  # additive: the same keys
    np.testing.assert_array_equal(f, np.where(kpm, -np.inf, a3.reshape(N, H, L, S)))


def test_from_torch_mha_sums_floating_masks_in_their_promoted_dtype():
    """Two floating masks of different dtypes are summed in the dtype they promote to, whichever
    comes first: a float64 mask's values are not rounded to the other mask's float32."""
    rng = np.random.default_rng(23)
    a32 = rng.standard_normal((2, 3)).astype(np.float32)  # (L, S)
    k64 = rng.standard_normal((4, 3))  # (N, S), values float32 cannot hold
    for attn, kpm in ((a32, k64), (a32.astype(np.float64), k64.astype(np.float32))):
        out = masks.from_torch_mha(attn, kpm)
        assert out.dtype == np.float64
        want = attn.astype(np.float64)[None, None] + kpm.astype(np.float64)[:, None, None, :]
        np.testing.assert_array_equal(out, want)
    # a boolean mask takes the floating one's dtype
    out = masks.from_torch_mha(a32, np.array([[False, True, False]]))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.where([False, True, False], -np.inf, a32)[None, None])


def test_from_torch_mha_refuses_a_dtype_the_masks_library_lacks():
    """``dtype`` is a floating dtype of the masks' own library, or its name: a NumPy dtype with
    torch masks (whose isdtype raises on it) or a name JAX lacks (a missing name would be read
    as JAX's default dtype) is a TypeError naming dtype, before anything is computed."""
    if importlib.util.find_spec("torch") is None and importlib.util.find_spec("jax") is None:
        pytest.skip("neither torch nor JAX is installed")
    if importlib.util.find_spec("torch") is not None:
        torch = resolve_backend("torch")
        kpm = torch.asarray([[False, True, False]])
        for dtype in (np.float64, np.dtype("float32"), "nope", torch.int64):
            with pytest.raises(TypeError, match=r"^dtype: expected None or a real floating dtype "
                                                r"of the masks' library \(torch\) or its name, "
                                                rf"got {re.escape(repr(dtype))}$"):
                masks.from_torch_mha(key_padding_mask=kpm, dtype=dtype)
        out = masks.from_torch_mha(key_padding_mask=kpm, dtype="float64")
        assert out.dtype == torch.float64 and out.reshape(-1).tolist() == [0.0, -math.inf, 0.0]
    if importlib.util.find_spec("jax") is not None:
        jnp = resolve_backend("jax")
        kpm = jnp.asarray(np.array([[False, True, False]]))
        for dtype in ("nope", "int8"):
            with pytest.raises(TypeError, match=r"^dtype: expected None or a real floating dtype "
                                                r"of the masks' library \(jax\) or its name, "
                                                rf"got {re.escape(repr(dtype))}$"):
                masks.from_torch_mha(key_padding_mask=kpm, dtype=dtype)
        out = masks.from_torch_mha(key_padding_mask=kpm, dtype="float32")
        assert out.dtype == jnp.float32 and np.asarray(out).reshape(-1).tolist() == [0.0, -math.inf, 0.0]


def test_from_torch_mha_moves_bfloat16_between_backends():
    """``xp=`` moves the mask through the host, where NumPy has no bfloat16: a bfloat16 mask
    goes through float32, which holds it exactly, to a backend with bfloat16, and one without
    is a TypeError naming ``xp`` before anything is computed (torch raised 'Got unsupported
    ScalarType BFloat16', JAX 'Unsupported dtype in DLTensor')."""
    torch = pytest.importorskip("torch")
    am = torch.tensor([[True, False, False]])
    kpm = torch.tensor([[False, False, True]])
    expected = [-math.inf, 0.0, -math.inf]
    out = masks.from_torch_mha(am, kpm, dtype=torch.bfloat16, xp="torch")
    assert out.dtype == torch.bfloat16 and out.reshape(-1).tolist() == expected
    with pytest.raises(TypeError, match="^xp: expected a backend with bfloat16.*got numpy"):
        masks.from_torch_mha(am, kpm, dtype=torch.bfloat16, xp="numpy")
    jnp = pytest.importorskip("jax.numpy")
    out = masks.from_torch_mha(am, kpm, dtype=torch.bfloat16, xp="jax")
    assert out.dtype == jnp.bfloat16 and out.reshape(-1).tolist() == expected
    back = masks.from_torch_mha(out.reshape(1, 3), xp="torch")  # a floating (L, S) JAX mask
    assert back.dtype == torch.bfloat16 and back.reshape(-1).tolist() == expected


def test_from_torch_mha_moves_bfloat16_values_of_every_magnitude():
    """A bfloat16 additive mask keeps its values when ``xp=`` moves it: bfloat16 has float32's
    exponent range, so 2**40 and 2**-30 (past float16's largest value and below its smallest)
    arrive as they were, not as inf and 0."""
    torch = pytest.importorskip("torch")
    values = [2.0**40, -(2.0**-30), -3.0, -math.inf]
    am = torch.tensor([values, values[::-1]], dtype=torch.bfloat16)  # (L, S) = (2, 4)
    out = masks.from_torch_mha(am, xp="torch")
    assert out.dtype == torch.bfloat16 and out.shape == (1, 1, 2, 4)
    assert out[0, 0].tolist() == [values, values[::-1]]


# --------------------------------------------------------------------------
# from_torch_mha against torch.nn.MultiheadAttention


def _npattn_from_torch(tm, D, H):
    """npattn module with tm's parameters (packed in_proj split by hand)."""
    mha = MultiHeadAttention(D, H, dtype="float64")
    W = tm.in_proj_weight.detach().numpy()
    b = tm.in_proj_bias.detach().numpy()
    mha.params.update(
        w_q=W[:D].copy(), w_k=W[D:2 * D].copy(), w_v=W[2 * D:].copy(),
        b_q=b[:D].copy(), b_k=b[D:2 * D].copy(), b_v=b[2 * D:].copy(),
        w_o=tm.out_proj.weight.detach().numpy().copy(), b_o=tm.out_proj.bias.detach().numpy().copy(),
    )
    return mha


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@settings(max_examples=15)
@given(
    attn_kind=st.sampled_from(["none", "bool2d", "bool3d", "float2d", "float3d"]),
    kpm_kind=st.sampled_from(["none", "bool", "float"]),
    L=st.integers(2, 4), S=st.integers(2, 5), seed=st.integers(0, 2**16),
)
def test_from_torch_mha_matches_torch_module(attn_kind, kpm_kind, L, S, seed):
    torch = pytest.importorskip("torch")
    if attn_kind == "none" and kpm_kind == "none":
        kpm_kind = "bool"
    N, D, H = 3, 8, 2
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    tm = torch.nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        tm.in_proj_bias.normal_()
        tm.out_proj.bias.normal_()
    query = rng.standard_normal((N, L, D))
    key = rng.standard_normal((N, S, D))
    value = rng.standard_normal((N, S, D))

    def ignore(shape):  # torch polarity, True = ignore; key 0 always kept (no empty row: torch gives NaN)
        m = rng.random(shape) < 0.4
        m[..., 0] = False
        return m

    def additive(shape):
        m = rng.standard_normal(shape)
        m[rng.random(shape) < 0.3] = -math.inf
        m[..., 0] = 0.0
        return m

    attn = {"none": None, "bool2d": ignore((L, S)), "bool3d": ignore((N * H, L, S)),
            "float2d": additive((L, S)), "float3d": additive((N * H, L, S))}[attn_kind]
    kpm = {"none": None, "bool": ignore((N, S)), "float": additive((N, S))}[kpm_kind]

    t_in = [torch.tensor(a, requires_grad=True) for a in (query, key, value)]
    t_out, t_w = tm(
        *t_in,
        attn_mask=None if attn is None else torch.tensor(attn),
        key_padding_mask=None if kpm is None else torch.tensor(kpm),
        need_weights=True, average_attn_weights=False,
    )
    dout = rng.standard_normal((N, L, D))
    t_out.backward(torch.tensor(dout))

    mask = masks.from_torch_mha(attn, kpm, n_head=H)
    mha = _npattn_from_torch(tm, D, H)
    out, w = mha(query, key, value, mask=mask, need_weights=True, average_attn_weights=False)
    dq, dk, dv = mha.backward(dout)
    assert _rel(out, t_out.detach().numpy()) < 1e-12
    assert _rel(w, t_w.detach().numpy()) < 1e-12
    # relative to the largest input gradient: dquery is exactly 0 when every
    # row has one key to attend, and rounding then leaves ~1e-16 in its place
    scale = max(float(np.max(np.abs(t.grad.numpy()))) for t in t_in)
    for g, t in zip((dq, dk, dv), t_in):
        assert float(np.max(np.abs(g - t.grad.numpy()))) <= 1e-10 * scale

    # the same mask converted from torch tensors stays a torch tensor, equal values
    mt = masks.from_torch_mha(
        None if attn is None else torch.tensor(attn),
        None if kpm is None else torch.tensor(kpm), n_head=H,
    )
    assert isinstance(mt, torch.Tensor)
    np.testing.assert_array_equal(mt.numpy(), mask)
    # and npattn's mask means the same to torch's SDPA (True = may attend there too)
    qh = rng.standard_normal((N, H, L, 4))
    kh, vh = rng.standard_normal((N, H, S, 4)), rng.standard_normal((N, H, S, 4))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(torch.tensor(a) for a in (qh, kh, vh)), attn_mask=mt
    ).numpy()
    assert _rel(F.sdpa_forward(qh, kh, vh, mask=mask)[0], ref) < 1e-12


def test_causal_bottom_right_matches_torch_causal_lower_right():
    """torch's own bottom-right causal bias (torch.nn.attention.bias.causal_lower_right)."""
    torch = pytest.importorskip("torch")
    bias = pytest.importorskip("torch.nn.attention.bias")
    rng = np.random.default_rng(3)
    for Lq, Lk in [(2, 5), (4, 4), (3, 6)]:
        q = rng.standard_normal((2, 2, Lq, 3))
        k, v = rng.standard_normal((2, 2, Lk, 3)), rng.standard_normal((2, 2, Lk, 3))
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(torch.tensor(a) for a in (q, k, v)), attn_mask=bias.causal_lower_right(Lq, Lk)
        ).numpy()
        out, _ = F.sdpa_forward(q, k, v, mask=masks.causal(Lq, Lk, "bottom_right"))
        assert _rel(out, ref) < 1e-12


def test_causal_and_window_match_jax_local_window_size():
    """JAX's top-left is_causal and local_window_size=(left, right) (query i sees keys
    i - left <= j <= i + right), read off jax.nn.dot_product_attention itself, against
    causal() and window(..., "top_left") for Lq < Lk, Lq = Lk and Lq > Lk (rows left with
    no key included): zero scores and value = identity make row i of out the weights of
    query i, uniform over the keys it may attend; JAX gives an empty row uniform weights
    from a finite fill value, which its lse (about -2.4e38) tells apart."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def allowed(Lq, Lk, **kw):  # -> [Lq, Lk] bool
        q = jnp.zeros((1, Lq, 1, Lk), dtype=jnp.float32)  # [B, Lq, H, Dh] (JAX's layout)
        k = jnp.zeros((1, Lk, 1, Lk), dtype=jnp.float32)  # [B, Lk, H, Dh]
        v = jnp.eye(Lk, dtype=jnp.float32)[None, :, None, :]  # [B, Lk, H, Lk]
        out, lse = jax.nn.dot_product_attention(q, k, v, implementation="xla",
                                                return_residual=True, **kw)
        weights = np.asarray(out)[0, :, 0, :]  # [Lq, Lk]: 1/count where allowed, 0 elsewhere
        empty = np.asarray(lse).reshape(Lq) < -1e30  # [Lq]
        return (weights > 0.5 / Lk) & ~empty[:, None]

    for Lq, Lk in [(3, 7), (5, 5), (7, 3), (1, 4), (4, 1)]:
        np.testing.assert_array_equal(masks.causal(Lq, Lk), allowed(Lq, Lk, is_causal=True))
        for left, right in [(0, 0), (1, 0), (3, 0), (0, 2), (2, 1), (1, 9), (9, 9)]:
            np.testing.assert_array_equal(masks.window(Lq, Lk, left, right, "top_left"),
                                          allowed(Lq, Lk, local_window_size=(left, right)),
                                          err_msg=f"Lq={Lq} Lk={Lk} window=({left}, {right})")


def test_segments_of_dtypes_the_library_does_not_compare_name_k_segments():
    """int64 against uint64 ids: torch raised its own RuntimeError from the comparison and
    array_api_strict a TypeError naming nothing; both now name k_segments, in the mask builder
    and in sdpa_forward's option, before anything is computed. NumPy compares them."""
    import importlib.util

    from npattn.attention import sdpa_forward

    q_ids, k_ids = np.array([[0, 0, 1]]), np.array([[0, 1, 1, 1]], dtype=np.uint64)
    same = masks.segments(q_ids, k_ids)[0, 0]
    np.testing.assert_array_equal(same, q_ids[0][:, None] == k_ids[0][None, :].astype(np.int64))
    libs = [n for n in ("torch", "array_api_strict") if importlib.util.find_spec(n)]
    if not libs:
        pytest.skip("neither torch nor array_api_strict is installed")
    for name in libs:
        xp = resolve_backend(name)
        qs = xp.asarray(np.array([[0, 0, 1]], dtype=np.int64))
        ks = xp.asarray(np.array([[0, 1, 1, 1]], dtype=np.uint64))
        with pytest.raises(TypeError, match="^k_segments: expected an integer dtype that .* "
                                            "compares with q_segments' int64, got uint64"):
            masks.segments(qs, ks)
        q = xp.asarray(np.zeros((1, 1, 3, 2)))
        k = xp.asarray(np.zeros((1, 1, 4, 2)))
        with pytest.raises(TypeError, match="^k_segments: expected an integer dtype"):
            sdpa_forward(q, k, k, q_segments=qs, k_segments=ks)
