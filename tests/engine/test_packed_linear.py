"""Linear layers on oneDNN with packed weights: the stock layer's output up to fp32 rounding,
for every row count and shape; a weight changed in place is packed again; a model's layers
are converted in place, its state dict unchanged; each layer takes oneDNN from the crossover
measured once for its weight's shape, the fewest rows from which oneDNN won every rung."""

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
    assert pack_linears(model, rows=lambda _: 1) == 1  # every row count through oneDNN
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


def test_a_weight_changed_in_place_is_packed_again() -> None:
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


F, S = 1.0, 2.0  # a fast and a slow call


@pytest.mark.parametrize(("times", "want"), [
    (((S, F), (S, F), (F, S), (F, S), (F, S)), 4),
    (((F, S), (S, F), (F, S), (F, S), (F, S)), 4),  # one rung's win does not outweigh two
    (((F, S), (1.1, F), (F, S), (F, S), (F, S)), 1),  # a small loss below wins does
    (((F, S),) * 5, 1),
    (((F, S), (F, S), (F, S), (F, S), (S, F)), 1),  # losing only the last rung
    (((F, S), (S, F), (S, F), (S, F), (S, F)), None),
    (((F, F),) * 5, None),  # a tie: the stock kernel
])
def test_the_threshold_loses_least_against_the_faster_kernel(
    times: tuple[tuple[float, float], ...], want: int | None,
) -> None:
    assert packed_linear.threshold([1, 2, 4, 8, 16], list(times)) == want


def test_the_ladder_stops_at_the_work_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[int] = []
    monkeypatch.setattr(packed_linear, "MAX_TUNE_WORK", 4 * 64 * 32)
    monkeypatch.setattr(packed_linear, "_timed", lambda a, b: (timed.append(1), (F, S))[1])
    _, layer = _pair(32, 64, False, 0)
    assert packed_linear.crossover(layer) == 1  # type: ignore[arg-type]
    assert len(timed) == 3  # rungs 1, 2, 4: 4 rows x 2,048 multiply-adds is the bound
    assert packed_linear._timed(lambda: None, lambda: None) is not None


def test_each_shape_is_measured_once_and_its_layers_share_it() -> None:
    model = build_random_model("micro", 0)
    measured: list[tuple[int, int, bool]] = []

    def key(layer: nn.Linear) -> tuple[int, int, bool]:
        return layer.out_features, layer.in_features, layer.bias is not None

    def rows(layer: nn.Linear) -> int | None:
        measured.append(key(layer))
        return None if layer.out_features == 64 else 3

    n = pack_linears(model, rows=rows)
    shapes = {key(m) for m in model.modules() if isinstance(m, nn.Linear)}
    assert n > len(shapes) and sorted(measured) == sorted(shapes)
    for m in model.modules():
        if isinstance(m, PackedLinear):
            assert m.min_rows == (None if m.out_features == 64 else 3)
