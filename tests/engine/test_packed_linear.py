"""Linear layers on oneDNN with packed weights: the stock layer's output up to fp32 rounding,
for every row count and shape; a weight changed in place is packed again; a model's layers
are converted in place, its state dict unchanged."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from radixmesh.engine import packed_linear
from radixmesh.engine.packed_linear import PackedLinear, pack_linears
from radixmesh.engine.presets import build_random_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


def _pair(n_in: int, n_out: int, bias: bool, seed: int) -> tuple[nn.Linear, nn.Module]:
    torch.manual_seed(seed)
    plain = nn.Linear(n_in, n_out, bias=bias)
    model = nn.Sequential(nn.Linear(n_in, n_out, bias=bias))
    model.load_state_dict({f"0.{k}": v for k, v in plain.state_dict().items()})
    assert pack_linears(model) == 1
    return plain, model[0]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 80), st.integers(1, 80), st.booleans(), st.integers(1, 12),
       st.integers(0, 2**16))
def test_packed_equals_the_stock_layer(n_in: int, n_out: int, bias: bool, rows: int,
                                       seed: int) -> None:
    plain, packed = _pair(n_in, n_out, bias, seed)
    assert isinstance(packed, PackedLinear)
    x = torch.randn(1, rows, n_in, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed(x[0]), plain(x[0]), atol=1e-5, rtol=1e-5)


def test_a_weight_changed_in_place_is_packed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_linear, "BIG_WEIGHT", 0)  # one row goes through oneDNN too
    plain, packed = _pair(16, 8, True, 0)
    x = torch.randn(3, 16)
    with torch.no_grad():
        packed.weight.mul_(2)
        plain.weight.mul_(2)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed(x[:1]), plain(x[:1]), atol=1e-5, rtol=1e-5)


def test_a_model_is_packed_in_place_with_its_state_dict() -> None:
    model = build_random_model("micro", 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        n = pack_linears(model)
        got = model(input_ids=ids).logits
    assert n == sum(1 for m in model.modules() if isinstance(m, nn.Linear))
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert pack_linears(model) == 0  # already packed


def test_a_torch_without_the_private_ops_keeps_the_stock_linear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(packed_linear, "_ops_present", lambda: False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert packed_linear.pack_linears(model) == 0
    assert type(model[0]) is torch.nn.Linear
