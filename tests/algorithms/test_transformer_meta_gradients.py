"""MAML, ANIL and LoRA-MAML on a stock nn.TransformerEncoder classifier: the meta-gradient
equals a float64 reference written out with torch.autograd on a hand-written transformer
(`tests.helpers.transformer_reference`), second order through the math attention kernel;
first order is unchanged and keeps the fused kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from metalearn.algorithms import ANIL, FOMAML, MAML, LoRAMAML
from metalearn.data.sequences import MarkovSequenceTasks
from metalearn.models.sequence import SequenceTransformer
from tests.helpers.transformer_reference import reference_logits, reference_meta_gradient

HEADS, LAYERS, LR, STEPS = 2, 2, 0.3, 2
FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"
FAST_PATHS = ("aten::_native_multi_head_attention", "aten::_transformer_encoder_layer_fwd")


def _model(dtype: torch.dtype) -> SequenceTransformer:
    torch.manual_seed(0)
    return SequenceTransformer(vocab=5, ways=3, length=6, width=8, heads=HEADS, layers=LAYERS,
                               ffn=12).to(dtype)  # fmt: skip


def _tasks() -> list:
    data = MarkovSequenceTasks(ways=3, shots=2, queries=2, vocab=5, length=6)
    return data.batch(2, torch.Generator().manual_seed(1))


def _learner(name: str, dtype: torch.dtype, **kwargs):
    common = dict(inner_lr=LR, inner_steps=STEPS, vectorize="loop", **kwargs)
    if name == "lora":
        learner = LoRAMAML(_model(dtype), lora_rank=2, **common)
        with torch.no_grad():  # B = 0 would leave A's gradients zero: a weak test
            for n, p in learner.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(n)))
        return learner
    return {"maml": MAML, "anil": ANIL, "fomaml": FOMAML}[name](_model(dtype), **common)


def _adapted(name: str, params: dict) -> list[str]:
    """The inner loop's parameters, written out: MAML all but the layer norms (its default
    adapt_norm=False), ANIL the head, LoRA-MAML the adapters and the head."""
    if name in ("maml", "fomaml"):
        return [k for k in params if ".norm" not in k]
    if name == "anil":
        return [k for k in params if k.startswith("head.")]
    return [k for k in params if "lora_" in k or k.startswith("head.")]


def _learner_and_reference(name: str, dtype: torch.dtype):
    learner = _learner(name, dtype)
    tasks = _tasks()
    learner.zero_grad()
    learner.backward(tasks)
    got = {n: p.grad.double() for n, p in learner.model.named_parameters()}
    params = {n: p.detach().double() for n, p in learner.model.named_parameters()}
    scaling = 1.0  # LoRAMAML's default alpha = rank
    want = reference_meta_gradient(
        params, tasks, _adapted(name, params), lr=LR, steps=STEPS, heads=HEADS, layers=LAYERS,
        scaling=scaling, first_order=name == "fomaml",
    )  # fmt: skip
    return got, want


def _max_error(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want)


def test_the_hand_written_reference_is_the_model():
    model = _model(torch.float64).eval()
    x = _tasks()[0].support[0]
    ref = reference_logits(dict(model.named_parameters()), x, heads=HEADS, layers=LAYERS)
    assert (model(x) - ref).abs().max().item() < 1e-12


@pytest.mark.parametrize("name", ["maml", "anil", "lora", "fomaml"])
def test_float64_meta_gradient_equals_the_written_out_reference(name):
    got, want = _learner_and_reference(name, torch.float64)
    assert max(w.abs().max().item() for w in want.values()) > 1e-3  # not a zero test
    assert _max_error(got, want) < 1e-10


@pytest.mark.parametrize("name", ["maml", "anil", "lora"])
def test_float32_meta_gradient_equals_the_float64_reference(name):
    got, want = _learner_and_reference(name, torch.float32)
    scale = max(w.abs().max().item() for w in want.values())
    assert _max_error(got, want) < 1e-5 * scale


def test_checkpointed_inner_steps_equal_the_reference():
    """gradient_checkpointing=True recomputes the support forward: the math kernel again."""
    learner, tasks = _learner("maml", torch.float64, gradient_checkpointing=True), _tasks()
    learner.backward(tasks)
    got = {n: p.grad for n, p in learner.model.named_parameters()}
    params = {n: p.detach() for n, p in learner.model.named_parameters()}
    want = reference_meta_gradient(params, tasks, _adapted("maml", params), lr=LR, steps=STEPS,
                                   heads=HEADS, layers=LAYERS)  # fmt: skip
    assert _max_error(got, want) < 1e-10


def test_second_order_is_not_first_order():
    """The second-order terms are there: MAML's meta-gradient is not FOMAML's."""
    maml, _ = _learner_and_reference("maml", torch.float64)
    fomaml, _ = _learner_and_reference("fomaml", torch.float64)
    assert _max_error(maml, fomaml) > 1e-4


def _ops(run) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return {event.name for event in prof.events()}


@pytest.mark.parametrize("name", ["maml", "fomaml"])
def test_second_order_runs_the_math_kernel_first_order_the_fused_one(name):
    learner, tasks = _learner(name, torch.float32), _tasks()
    ops = _ops(lambda: learner.backward(tasks))
    assert not ops & set(FAST_PATHS)
    if name == "maml":  # support forwards: math; query forwards: fused
        assert MATH in ops and FLASH in ops
    else:  # first order: every forward fused
        assert FLASH in ops and MATH not in ops


def test_evaluation_takes_no_fused_fast_path():
    """Evaluation reads the query under no_grad in eval mode, where nn.MultiheadAttention and
    nn.TransformerEncoderLayer would take their fused inference paths: they stay off."""
    learner, tasks = _learner("maml", torch.float32), _tasks()
    learner.eval()
    ops = _ops(lambda: learner.evaluate(tasks))
    assert FLASH in ops and not ops & set(FAST_PATHS)


def test_the_stock_encoder_fails_without_the_rule():
    """What the rule prevents: the fused kernel's backward has no derivative."""
    model, task = _model(torch.float64), _tasks()[0]
    params = dict(model.named_parameters())
    loss = F.cross_entropy(torch.func.functional_call(model, params, (task.support[0],)),
                           task.support[1])  # fmt: skip
    (g,) = torch.autograd.grad(loss, [params["head.weight"]], create_graph=True)
    inner = torch.autograd.grad(loss, [params["embed.weight"]], create_graph=True)[0]
    with pytest.raises(RuntimeError, match="flash_attention.*not implemented"):
        torch.autograd.grad(inner.sum(), [params["position"]])
    assert g.requires_grad


class _AttentionClassifier(torch.nn.Module):
    """nn.MultiheadAttention with no layer norm: what vmap differentiates exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 8)
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(torch.tanh(h + self.attn(h, h, h, need_weights=False)[0]).mean(1))


@pytest.mark.parametrize("first_order", [False, True])
def test_vmap_equals_the_loop_on_multihead_attention(first_order):
    grads = {}
    for vectorize in ("vmap", "loop"):
        torch.manual_seed(0)
        learner = MAML(_AttentionClassifier().double(), inner_lr=LR, inner_steps=STEPS,
                       first_order=first_order, vectorize=vectorize)  # fmt: skip
        metrics = learner.backward(_tasks())
        assert metrics.vectorized == (2 if vectorize == "vmap" else 0)
        grads[vectorize] = {n: p.grad for n, p in learner.model.named_parameters()}
    assert _max_error(grads["vmap"], grads["loop"]) < 1e-10
