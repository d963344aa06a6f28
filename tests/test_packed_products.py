"""Products with packed weights (`model/matmul.py`): the large weights' products run through
oneDNN on a copy of the weight packed once. The packed product is the same product (to
float32 rounding), its copy follows the weight (in-place changes, freed and reused memory),
and where packing does not apply (float64, autograd on) the plain product runs. The
operator's kernel is Python or C++ (`matmul.native_kernel`): the same products either way."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from branchspec.config import v4_mini_v2_config
from branchspec.model import matmul
from branchspec.model.init import random_model
from branchspec.model.layers import JoinedLinear, Linear, StackedLinear, pack_products, packed_products
from branchspec.model.metadata import chain_meta

pytestmark = pytest.mark.skipif(not matmul.packed_products_available(), reason="torch built without oneDNN")


@pytest.fixture(autouse=True)
def python_kernel():
    """The Python kernel in place (the tests count its calls; a compiled engine built
    earlier in this process put the C++ one in), and what was in place put back after."""
    was = matmul._KERNEL.native
    matmul.native_kernel(False)
    yield
    matmul.native_kernel(was)


@pytest.fixture(params=["python", "native"])
def kernel(request, python_kernel):
    """Each kernel in turn."""
    if request.param == "native" and not matmul.native_kernel(True):
        pytest.skip(f"the C++ kernel could not be built here: {matmul._KERNEL.failed}")
    return request.param


def packed_calls(fn):
    """Run fn, returning (its result, how many packed products it ran)."""
    calls = [0]
    original = matmul.packed_weight

    def counting(w):
        calls[0] += 1
        return original(w)

    matmul.packed_weight = counting
    try:
        return fn(), calls[0]
    finally:
        matmul.packed_weight = original


@pytest.mark.parametrize("rows", [1, 3, 8, 64])
@pytest.mark.parametrize("out_features", [1, 300, 2048])
def test_packed_product_equals_plain(rows, out_features, kernel):
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    w = torch.randn(out_features, 96, generator=gen)
    x = torch.randn(2, rows, 96, generator=gen)
    with torch.no_grad():
        got, calls = packed_calls(lambda: matmul.linear(x, w, packed=True))
    assert calls == (1 if kernel == "python" else 0) and got.shape == (2, rows, out_features)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)
    # a strided input (a column slice) is the same product
    wide = torch.randn(rows, 2 * 96, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(matmul.linear(wide[:, ::2], w, packed=True), F.linear(wide[:, ::2], w),
                                   atol=1e-5, rtol=1e-5)


def test_packed_copy_follows_its_weight(kernel):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(512, 64, generator=gen)
    x = torch.randn(4, 64, generator=gen)
    with torch.no_grad():
        before = matmul.linear(x, w, packed=True)
        w.mul_(-2.0)                                   # changed in place: packed again
        after = matmul.linear(x, w, packed=True)
    torch.testing.assert_close(after, -2.0 * before, atol=1e-5, rtol=1e-5)

    # A weight freed and another allocated at its address: the stale copy is not used.
    addresses = {}
    for seed in range(20):
        v = torch.randn(512, 64, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            torch.testing.assert_close(matmul.linear(x, v, packed=True), F.linear(x, v), atol=1e-5, rtol=1e-5)
        addresses[v.data_ptr()] = addresses.get(v.data_ptr(), 0) + 1
        del v
    assert max(addresses.values()) > 1, "no address was reused: the stale-copy case did not arise"


def test_stale_copy_check_is_what_catches_a_change(monkeypatch):
    """Negative control: with the check that a copy still mirrors its weight switched off,
    a product after an in-place change uses the old copy and is wrong."""
    w = torch.randn(512, 64)
    x = torch.randn(4, 64)
    monkeypatch.setattr(matmul._Packed, "holds", lambda self, w: True)
    with torch.no_grad():
        before = matmul.linear(x, w, packed=True)
        w.mul_(-2.0)
        after = matmul.linear(x, w, packed=True)
    assert torch.allclose(after, before)                  # the stale copy was used
    assert not torch.allclose(after, F.linear(x, w), atol=1e-3)


def test_weights_made_under_inference_mode(kernel):
    """Inference tensors keep no version counter: their packed and joined copies are
    taken as current for as long as the memory holds them, and the products are right."""
    with torch.inference_mode():
        w, v = torch.randn(512, 64), torch.randn(300, 64)
        x = torch.randn(4, 64)
        torch.testing.assert_close(matmul.linear(x, w, packed=True), F.linear(x, w), atol=1e-5, rtol=1e-5)
        stacked = StackedLinear(lambda: [w, v])
        stacked.packed = True
        a, b = stacked(x)
        torch.testing.assert_close(a, F.linear(x, w), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b, F.linear(x, v), atol=1e-5, rtol=1e-5)


def test_dead_weights_copies_are_dropped():
    x = torch.randn(2, 64)
    with torch.no_grad():
        for seed in range(10):
            matmul.linear(x, torch.randn(300 + seed, 64), packed=True)   # each freed at once
    alive = [e for e in matmul._PACKED.values() if not e.storage.expired()]
    assert len(matmul._PACKED) <= len(alive) + 1


def test_plain_product_where_packing_does_not_apply():
    w = torch.randn(256, 32)
    x = torch.randn(3, 32)
    _, calls = packed_calls(lambda: matmul.linear(x, w, packed=True))                   # autograd on
    assert calls == 0
    with torch.no_grad():
        _, calls = packed_calls(lambda: matmul.linear(x.double(), w.double(), packed=True))   # float64
        assert calls == 0
        _, calls = packed_calls(lambda: matmul.linear(x, w, packed=False))
        assert calls == 0
        _, calls = packed_calls(lambda: matmul.linear(x, w, packed=True))
        assert calls == 1


def test_compiled_graph_calls_the_packed_product():
    w = torch.randn(1024, 64)
    x = torch.randn(8, 64)

    def step(x, w):
        return matmul.linear(x.relu(), w, packed=True).softmax(-1)

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    with torch.no_grad():
        got, calls = packed_calls(lambda: compiled(x, w))
        torch.testing.assert_close(got, F.linear(x.relu(), w).softmax(-1), atol=1e-6, rtol=1e-5)
        assert calls == 1
        # The same graph, not compiled again, calls whichever kernel is in place.
        if matmul.native_kernel(True):
            native, calls = packed_calls(lambda: compiled(x, w))
            assert calls == 0
            torch.testing.assert_close(native, got, atol=1e-6, rtol=1e-5)
            matmul.native_kernel(False)
            _, calls = packed_calls(lambda: compiled(x, w))
            assert calls == 1


def test_native_kernel_switches_both_ways():
    """The C++ kernel in place: the Python one is not called, the products are the same,
    and a weight changed in place is packed again; taken out, the Python one serves again."""
    if not matmul.native_kernel(True):
        pytest.skip(f"the C++ kernel could not be built here: {matmul._KERNEL.failed}")
    w, x = torch.randn(600, 64), torch.randn(5, 64)
    with torch.no_grad():
        got, calls = packed_calls(lambda: matmul.linear(x, w, packed=True))
        assert calls == 0
        torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)
        w.mul_(3.0)
        torch.testing.assert_close(matmul.linear(x, w, packed=True), 3.0 * got, atol=1e-4, rtol=1e-5)
        assert matmul.native_kernel(False) is False
        again, calls = packed_calls(lambda: matmul.linear(x, w, packed=True))
    assert calls == 1
    torch.testing.assert_close(again, 3.0 * got, atol=1e-4, rtol=1e-5)


def test_native_kernel_that_cannot_be_built(monkeypatch, tmp_path):
    """No C++ compiler: one warning naming the cause, and the Python kernel keeps serving."""
    monkeypatch.setattr(matmul._KERNEL, "library", None)
    monkeypatch.setattr(matmul._KERNEL, "failed", None)
    monkeypatch.setenv("BRANCHSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.warns(UserWarning, match="could not be built.*no-such-compiler"):
        assert matmul.native_kernel(True) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert matmul.native_kernel(True) is False    # not tried again, no second warning
    w, x = torch.randn(600, 64), torch.randn(5, 64)
    with torch.no_grad():
        got, calls = packed_calls(lambda: matmul.linear(x, w, packed=True))
    assert calls == 1
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))


@pytest.fixture(scope="module")
def model():
    return random_model(v4_mini_v2_config(), seed=0, dtype=torch.float32, expert_dispatch="dense")


def forward(model, rows: int = 40):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.cfg.vocab_size, (2, rows), generator=gen)
    meta = chain_meta(torch.zeros(2, dtype=torch.long), rows, model.cfg.compressed_kinds)
    with torch.no_grad():
        return model(ids, meta).logits


def test_pack_products_chooses_large_weights(model):
    m = copy.deepcopy(model)
    assert pack_products(m) == len(packed_products(m)) > 0
    names = set(packed_products(m))
    # [8192, 256]; with dense experts [2564, 256] and the joined down projections [256, 1280]
    assert {"head", "layers.1.ffn.input_proj", "layers.1.ffn.down_proj"} <= names
    assert "layers.1.attn.wq_b" not in names                            # [256, 128]: small
    for name, module in m.named_modules():
        if isinstance(module, Linear):
            assert module.packed == (module.weight.numel() >= matmul.PACK_MIN_ELEMENTS), name
    assert pack_products(m, min_elements=0) == sum(
        isinstance(x, Linear) for x in m.modules()) + sum(
        isinstance(v, (StackedLinear, JoinedLinear)) for x in m.modules() for v in vars(x).values())
    assert pack_products(m, on=False) == 0 and packed_products(m) == ()


def test_packed_model_equals_unpacked(model):
    """Every product packed, logits equal the plain products' to float32 rounding; the
    same greedy tokens at every position."""
    m = copy.deepcopy(model)
    pack_products(m, on=False)
    plain = forward(m)
    pack_products(m, min_elements=0)
    packed, calls = packed_calls(lambda: forward(m))
    assert calls >= 4 * len(m.layers) + 1      # each layer: stacked inputs, wq_b, wo_b, FFN inputs; the head
    torch.testing.assert_close(packed, plain, atol=2e-4, rtol=1e-4)
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))


def test_packed_model_same_under_either_kernel(model):
    m = copy.deepcopy(model)
    pack_products(m)
    by_python = forward(m)
    if not matmul.native_kernel(True):
        pytest.skip(f"the C++ kernel could not be built here: {matmul._KERNEL.failed}")
    by_native, calls = packed_calls(lambda: forward(m))
    assert calls == 0
    torch.testing.assert_close(by_native, by_python, atol=1e-5, rtol=1e-5)
    assert torch.equal(by_native.argmax(-1), by_python.argmax(-1))
