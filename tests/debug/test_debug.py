"""metalearn.debug: check_function on real and broken Functions, check_consistent's
messages, anomaly_guard's first-non-finite reports in forward, backward and torch.func."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.autograd import Function

from metalearn.autograd import (
    clip_grad,
    safe_cross_entropy,
    safe_log,
    safe_log_softmax,
    safe_sigmoid,
)
from metalearn.debug import (
    FunctionCheckError,
    NonFiniteError,
    anomaly_guard,
    check_consistent,
    check_function,
)
from metalearn.models import MLP

# torch's forward-mode AD loads its decompositions through torch.jit.script, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")

ALL_CHECKS = ["gradcheck", "gradgradcheck", "torch.func.vjp", "torch.func.vmap",
              "vmap of torch.func.vjp", "torch.func.jvp"]  # fmt: skip


def _randn(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- check_function


@pytest.mark.parametrize(
    "fn, inputs",
    [
        (safe_sigmoid, lambda: (_randn(2, 3), 100.0)),  # clip inactive: exact derivatives
        (clip_grad, lambda: (_randn(2, 3), 100.0)),
        (safe_log, lambda: (_randn(2, 3).abs() + 0.5,)),
        (safe_log_softmax, lambda: (_randn(2, 3),)),
        (safe_cross_entropy, lambda: (_randn(2, 3), _randn(2, 3, seed=1).softmax(-1))),
    ],
    ids=["safe_sigmoid", "clip_grad", "safe_log", "safe_log_softmax", "safe_cross_entropy"],
)
def test_check_function_passes_metalearn_autograd(fn, inputs) -> None:
    report = check_function(fn, *inputs())
    assert report.passed == ALL_CHECKS and report.name == fn.__name__


class _HalfBackward(Function):
    """x**2 whose backward forgets the factor 2."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return x**2

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return g * x


class _DetachedBackward(_HalfBackward):
    """x**2 with a right backward that is not differentiable (it detaches x)."""

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return g * 2 * x.detach()


class _OldStyle(Function):
    """x**2, right derivatives, but ctx in forward: torch.func cannot run it."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x**2

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return g * 2 * x


class _NoJvp(_HalfBackward):
    """x**2, right and differentiable backward, no jvp staticmethod."""

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return g * 2 * x


X = torch.tensor([[1.5, -2.0], [0.5, 3.0]])


def test_check_function_locates_a_wrong_backward() -> None:
    with pytest.raises(FunctionCheckError) as info:
        check_function(_HalfBackward.apply, X)
    message = str(info.value)
    assert "_HalfBackward.apply" in message and "gradcheck failed" in message
    # The worst element: d out[1, 1] / d x[1, 1] is x = 3 by the backward, 2x = 6 really.
    assert "d(output 0)[1, 1] / d(input 0)[1, 1] is 3 by the backward but 6 by finite" in message
    assert "Fix the Function's backward" in message


def test_check_function_catches_a_backward_that_is_not_differentiable() -> None:
    check_function(_DetachedBackward.apply, X, gradgrad=False, transforms=False)  # first order ok
    with pytest.raises(FunctionCheckError) as info:
        check_function(_DetachedBackward.apply, X)
    message = str(info.value)
    assert "gradgradcheck failed" in message and "no .detach()" in message
    # d(grad of x)/dx = 2 * cotangent, but the detached backward gives 0.
    assert "/ d(input 0)" in message and "is 0 by the double backward" in message


def test_check_function_names_the_torch_func_transform_that_fails() -> None:
    check_function(_OldStyle.apply, X, transforms=False)  # the derivatives are right
    with pytest.raises(FunctionCheckError, match=r"fails under torch\.func\.vjp.*setup_context"):
        check_function(_OldStyle.apply, X)
    with pytest.raises(FunctionCheckError, match=r"fails under torch\.func\.jvp.*jvp staticmethod"):
        check_function(_NoJvp.apply, X)


def test_check_function_rejects_inputs_with_nothing_to_differentiate() -> None:
    with pytest.raises(ValueError, match="no floating-point tensor among its 1 inputs"):
        check_function(torch.neg, torch.arange(3))


# --------------------------------------------------------------------------- check_consistent


def test_check_consistent_returns_the_shared_device_and_dtype() -> None:
    model = MLP(3, [4], 2)
    x, y = torch.randn(5, 3), torch.arange(5)
    assert check_consistent(model, (x, y)) == (torch.device("cpu"), torch.float32)
    assert check_consistent(y) == (torch.device("cpu"), None)  # labels have no float dtype


def test_check_consistent_names_tensors_on_another_device() -> None:
    model = MLP(3, [4], 2)
    x = torch.empty(5, 3, device="meta")  # a second device without a GPU
    with pytest.raises(ValueError) as info:
        check_consistent(model=model, batch=(x, torch.arange(5)))
    message = str(info.value)
    assert "expected cpu (held by 5 of 6 tensors), but batch[0] is meta" in message
    assert ".to('cpu')" in message


def test_check_consistent_names_dict_entries_and_the_asked_device() -> None:
    params = {"w": torch.zeros(2), "b": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"expected meta \(as asked\), but params\['w'\] is cpu"):
        check_consistent(params=params, device="meta")


def test_check_consistent_names_a_parameter_of_another_dtype() -> None:
    model = MLP(3, [4], 2)
    model.head.bias.data = model.head.bias.data.double()
    with pytest.raises(TypeError) as info:
        check_consistent(model=model, x=torch.randn(5, 3))
    message = str(info.value)
    assert "expected torch.float32 (held by 4 of 5 tensors)" in message
    assert "model.head.bias is torch.float64" in message and ".to(torch.float32)" in message


def test_check_consistent_needs_a_tensor() -> None:
    with pytest.raises(ValueError, match="found no tensors"):
        check_consistent(3, "x", None)


# --------------------------------------------------------------------------- anomaly_guard


class _LogNet(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        shifted = x * 2 - 3
        return torch.log(shifted)  # NaN where x < 1.5


def test_anomaly_guard_names_the_forward_op_and_the_user_line() -> None:
    with pytest.raises(NonFiniteError) as info, anomaly_guard():
        _LogNet()(torch.tensor([1.0, 2.0, 3.0]))
    err = info.value
    assert err.op == "aten.log.default" and err.phase == "forward" and err.node is None
    message = str(err)
    assert "aten.log.default produced 1 NaN and 0 infinite values among 3" in message
    assert "shape (3,)" in message and "return torch.log(shifted)" in message
    assert "test_debug.py" in message and "its inputs were finite" in message


def test_anomaly_guard_reports_zero_over_zero() -> None:
    with pytest.raises(NonFiniteError, match=r"aten\.div\.Tensor produced 1 NaN"), anomaly_guard():
        torch.zeros(2) / torch.tensor([0.0, 1.0])


@pytest.mark.filterwarnings("ignore:Error detected in SqrtBackward0")  # anomaly mode repeats it
def test_anomaly_guard_names_the_backward_node_and_its_forward_line() -> None:
    x = torch.tensor([4.0, 0.0, 1.0], requires_grad=True)
    with pytest.raises(NonFiniteError) as info, anomaly_guard():
        root = x.sqrt()  # finite forward; d sqrt / dx = inf at 0
        root.sum().backward()
    err = info.value
    assert err.phase == "backward" and err.node == "SqrtBackward0"
    assert err.op.startswith("aten.")
    message = str(err)
    assert "in backward of SqrtBackward0" in message and "1 infinite" in message
    assert "root = x.sqrt()" in message and "root.sum().backward()" in message


def test_anomaly_guard_blames_the_input_when_nan_comes_from_outside() -> None:
    data = torch.tensor([1.0, float("nan")])
    with pytest.raises(NonFiniteError, match="its input 0 was already non-finite"):
        with anomaly_guard():
            data + 1


def test_anomaly_guard_works_inside_torch_func_transforms() -> None:
    with pytest.raises(NonFiniteError, match=r"aten\.log\.default"), anomaly_guard():
        torch.func.vmap(torch.log)(torch.tensor([[1.0, -1.0]]))


def test_anomaly_guard_nan_only_lets_infinities_through() -> None:
    with anomaly_guard(check="nan"):
        masked = torch.tensor([0.0, 1.0]).masked_fill(torch.tensor([True, False]), -torch.inf)
    assert masked[0] == -torch.inf
    with pytest.raises(ValueError, match="choose 'nonfinite'"), anomaly_guard(check="inf"):
        pass


def test_anomaly_guard_leaves_a_clean_computation_unchanged() -> None:
    torch.manual_seed(0)
    model = MLP(3, [8], 2).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))

    def step() -> tuple[Tensor, list[Tensor]]:
        loss = nn.functional.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        uninitialised = torch.empty(100)  # may hold NaN bits: not reported
        uninitialised.fill_(0.0)
        return loss, grads

    loss, grads = step()
    with anomaly_guard():
        guarded_loss, guarded_grads = step()
    assert torch.equal(loss, guarded_loss)
    assert all(torch.equal(g, h) for g, h in zip(grads, guarded_grads))
    assert not torch.is_anomaly_enabled()  # the guard restored the previous mode


def test_anomaly_guard_lets_intended_values_through_but_not_what_they_make() -> None:
    mask = torch.tensor([[True, False], [True, True]])
    logits = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    with anomaly_guard():
        placeholder = torch.full((), float("nan"))  # e.g. the accuracy of a skipped task
        losses = torch.stack([torch.tensor(0.5), placeholder])
        part = logits.masked_fill(mask, -torch.inf)[0].softmax(-1)  # one unmasked: finite
    assert losses[1].isnan() and torch.equal(part, torch.tensor([0.0, 1.0]))
    # A fully masked row: softmax makes NaN out of -inf, a new kind: reported.
    with pytest.raises(NonFiniteError, match=r"aten\._softmax\.default produced 2 NaN"):
        with anomaly_guard():
            logits.masked_fill(mask, -torch.inf)[1].softmax(-1)


def test_anomaly_guard_is_not_fooled_by_a_sum_that_overflows() -> None:
    big = torch.full((4,), 3e38)  # finite, but its sum overflows float32 (the fast check)
    with anomaly_guard():
        doubled = big * 1.0
    assert torch.equal(doubled, big)
