"""Every kind of temporary change camviz makes to a model (:mod:`camviz.core.modelstate`) is
made inside the block and undone after it: on a normal exit, after an exception raised in
the middle of a forward pass, and after a change that fails halfway through being made.

"Undone" is checked on everything a model holds: every module's plain attributes (train/eval
flags, timm's ``fused_attn``, a detector transform's sizes, score thresholds), its hooks, and
every parameter's and buffer's ``requires_grad``, ``.grad``, dtype, memory format (strides)
and values; and the process's autocast and grad modes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import timm
import torch
from torch import nn

from camviz.core.modelstate import (
    Attributes,
    DetectorInputSize,
    EvalMode,
    ForwardPrecision,
    FusedAttention,
    HookSet,
    ModelChange,
    changed,
    eval_mode,
)
from camviz.core.precision import forward_precision

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)
_PLAIN = (bool, int, float, str, tuple, type(None))


def snapshot(model: nn.Module) -> dict:
    """Everything the model holds, as comparable values."""
    tensors = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        tensors[name] = (
            tensor.requires_grad,
            tensor.dtype,
            tensor.stride(),
            tensor.detach().clone(),
            None if tensor.grad is None else tensor.grad.clone(),
            len(tensor._backward_hooks or {}),
        )
    return {
        "modules": [
            (
                name,
                type(module),
                {key: value for key, value in vars(module).items() if isinstance(value, _PLAIN)},
                tuple(len(getattr(module, hooks)) for hooks in _HOOK_DICTS),
            )
            for name, module in model.named_modules()
        ],
        "tensors": tensors,
        "modes": (torch.is_autocast_enabled("cpu"), torch.is_grad_enabled()),
    }


def assert_same(before: dict, after: dict) -> None:
    assert after["modules"] == before["modules"]
    assert after["modes"] == before["modes"]
    assert after["tensors"].keys() == before["tensors"].keys()
    for name, (*flags, values, grad, hooks) in before["tensors"].items():
        *new_flags, new_values, new_grad, new_hooks = after["tensors"][name]
        assert new_flags == flags, name
        assert torch.equal(new_values, values), name
        assert (grad is None) == (new_grad is None) and (
            grad is None or torch.equal(grad, new_grad)
        )
        assert new_hooks == hooks, name


class MidPassError(Exception):
    """Raised by the test models in the middle of a forward pass when asked to."""


def fails_when_asked(module: nn.Module) -> dict[str, bool]:
    """A permanent hook on ``module`` that raises :class:`MidPassError` while ``switch["on"]``."""
    switch = {"on": False}

    def hook(module: nn.Module, args: object, output: object) -> None:
        if switch["on"]:
            raise MidPassError("the model failed in the middle of its forward pass")

    module.register_forward_hook(hook)
    return switch


class SmallCNN(nn.Module):
    """Mixed train/eval flags, a frozen layer, a gradient held, a channels-last weight and a
    float64 buffer: everything a change could disturb."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)
        self.register_buffer("scale", torch.tensor(2.0, dtype=torch.float64))
        self.conv.weight.data = self.conv.weight.data.contiguous(memory_format=torch.channels_last)
        self.norm.eval()  # frozen statistics inside a model in train mode
        self.head.bias.requires_grad_(False)
        self.head(torch.ones(1, 4)).sum().backward()  # .grad held by the head's weight
        self.seen: list[tuple[bool, torch.dtype, bool]] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.seen.append(
            (
                images.is_contiguous(memory_format=torch.channels_last),
                torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None,
                self.norm.training,
            )
        )
        features = self.norm(self.conv(images)).mean((2, 3))
        return self.head(features) * self.scale.float()


class TwoTransforms(nn.Module):
    """Two torchvision detector transforms (one resizing, one of fixed size, as SSD's) in
    front of a convolution, with a score threshold as the detectors hold."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.models.detection.transform import GeneralizedRCNNTransform

        mean, std = [0.0] * 3, [1.0] * 3
        self.resizing = GeneralizedRCNNTransform(64, 160, mean, std)
        self.fixed = GeneralizedRCNNTransform(80, 80, mean, std, fixed_size=(80, 80))
        self.conv = nn.Conv2d(3, 2, 3)
        self.score_thresh = 0.05
        self.seen: list[tuple[int, ...]] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        resized, _ = self.resizing(list(images))
        fixed, _ = self.fixed(list(images))
        self.seen.append((*resized.image_sizes[0], *fixed.image_sizes[0]))
        return self.conv(resized.tensors).mean() + self.conv(fixed.tensors).mean()


def vit() -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        depth=2,
        embed_dim=16,
        num_heads=2,
        num_classes=3,
    ).eval()
    model.blocks[0].attn.fused_attn = False  # as built with TIMM_FUSED_ATTN=0
    return model


@dataclass
class Kind:
    """One kind of change: the model, how to make the change for a block, where the model
    can fail mid-pass, and what must hold inside the block."""

    build: Callable[[], nn.Module]
    enter: Callable[[nn.Module], object]  # a context manager
    failing: Callable[[nn.Module], nn.Module]  # the module that raises mid-pass
    inputs: torch.Tensor
    check: Callable[[nn.Module], None]


def _in_eval(model: nn.Module) -> None:
    assert not any(module.training for module in model.modules())
    assert model.seen[-1][2] is False


def _fused(model: nn.Module) -> None:
    assert [block.attn.fused_attn for block in model.blocks] == [True, True]


def _sized(model: nn.Module) -> None:
    assert (model.resizing.min_size, model.resizing.max_size) == ((32,), 80)  # ratio 160/64
    assert (model.fixed.min_size, model.fixed.fixed_size) == ((32,), (32, 32))
    assert model.seen[-1] == (32, 64, 32, 32)  # a 40 x 80 image


def _threshold(model: nn.Module) -> None:
    assert model.score_thresh == 0.0 and model.resizing.min_size == (16,)


def _reduced(model: nn.Module) -> None:
    assert model.seen[-1][:2] == (True, torch.bfloat16)
    assert not torch.is_autocast_enabled("cpu")  # only the model's own calls


def _hooked(hooks: HookSet, model: nn.Module) -> None:
    hooks.add(model.conv.register_forward_hook(lambda *args: None))
    hooks.add(model.head.register_forward_pre_hook(lambda *args: None))
    hooks.add_full_backward_hook(model.norm, lambda *args: None)
    hooks.add(model.conv.weight.register_hook(lambda grad: grad))


class _Hooks:
    """A :class:`HookSet` block with hooks of every kind added."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.hooks = model, HookSet()

    def __enter__(self) -> None:
        self.hooks.__enter__()
        _hooked(self.hooks, self.model)

    def __exit__(self, *exc_info: object) -> None:
        self.hooks.__exit__(*exc_info)


IMAGES = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
KINDS = {
    "eval mode": Kind(SmallCNN, eval_mode, lambda m: m.norm, IMAGES, _in_eval),
    "fused attention": Kind(
        vit,
        lambda m: changed(m, FusedAttention()),
        lambda m: m.blocks[1],
        torch.rand(1, 3, 32, 32),
        _fused,
    ),
    "detector input size": Kind(
        TwoTransforms,
        lambda m: changed(m, DetectorInputSize(32)),
        lambda m: m.conv,
        torch.rand(1, 3, 40, 80),
        _sized,
    ),
    "attributes": Kind(
        TwoTransforms,
        lambda m: changed(
            m, Attributes(((m, "score_thresh", 0.0), (m.resizing, "min_size", (16,))))
        ),
        lambda m: m.conv,
        torch.rand(1, 3, 40, 80),
        _threshold,
    ),
    "precision and channels-last": Kind(
        SmallCNN,
        lambda m: forward_precision(m, torch.bfloat16, True, torch.device("cpu")),
        lambda m: m.conv,
        IMAGES,
        _reduced,
    ),
    "hooks": Kind(SmallCNN, _Hooks, lambda m: m.conv, IMAGES, lambda m: None),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_change_is_made_in_the_block_and_undone_after_it(kind):
    spec = KINDS[kind]
    model = spec.build()
    fails_when_asked(spec.failing(model))
    before = snapshot(model)

    with spec.enter(model):
        model(spec.inputs)
        spec.check(model)

    assert_same(before, snapshot(model))


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_change_is_undone_after_the_model_fails_mid_pass(kind):
    spec = KINDS[kind]
    model = spec.build()
    switch = fails_when_asked(spec.failing(model))
    before = snapshot(model)

    with pytest.raises(MidPassError), spec.enter(model):
        model(spec.inputs)
        spec.check(model)  # the change is in place when the model fails
        switch["on"] = True
        model(spec.inputs)
    switch["on"] = False

    assert_same(before, snapshot(model))


def test_changes_are_made_in_order_and_undone_in_reverse():
    model = TwoTransforms()
    before = snapshot(model)
    first = Attributes(((model, "score_thresh", 0.5),))
    second = Attributes(((model, "score_thresh", 0.25),))
    seen = []

    with changed(model, EvalMode(), first, second, DetectorInputSize(32)):
        seen.append(model.score_thresh)
        model(torch.rand(1, 3, 40, 80))

    assert seen == [0.25]
    assert_same(before, snapshot(model))  # restored in forward order, 0.5 would stay


class _Refuses(ModelChange):
    """A change that fails after part of its work, as ``model.eval()`` on a module whose
    ``train`` raises would."""

    def save(self, model: nn.Module) -> list[tuple[nn.Module, bool]]:
        return EvalMode().save(model)

    def apply(self, model: nn.Module, saved: object) -> None:
        model.conv.training = False
        raise MidPassError("could not finish the change")

    def restore(self, model: nn.Module, saved: list[tuple[nn.Module, bool]]) -> None:
        EvalMode().restore(model, saved)


class _TrainRaises(nn.BatchNorm2d):
    def train(self, mode: bool = True) -> _TrainRaises:
        raise MidPassError("this module cannot change mode")


def test_a_change_that_fails_halfway_is_undone_with_those_before_it():
    model = SmallCNN()
    before = snapshot(model)

    with (
        pytest.raises(MidPassError),
        changed(model, DetectorInputSize(32), FusedAttention(), _Refuses()),
    ):
        pass

    assert_same(before, snapshot(model))
    model.norm.__class__ = _TrainRaises  # model.eval() sets the conv's flag, then raises
    before = snapshot(model)
    with pytest.raises(MidPassError), eval_mode(model):
        pass
    assert_same(before, snapshot(model))


def test_a_change_is_a_description_reused_across_models_and_blocks():
    change = ForwardPrecision(torch.bfloat16, True, torch.device("cpu"))
    first, second = SmallCNN(), SmallCNN()

    with changed(first, change), changed(second, change), changed(first, EvalMode()):
        first(IMAGES)
        second(IMAGES)
    first(IMAGES)

    assert first.seen == [(True, torch.bfloat16, False), (False, None, False)]
    assert second.seen == [(True, torch.bfloat16, False)]


def test_a_full_backward_capture_leaves_the_module_open_to_plain_backward_hooks():
    import camviz

    model = SmallCNN()
    with camviz.capture(model, "norm", gradients=True, backward="full") as seen:
        model(IMAGES).sum().backward()
    assert seen.gradients["norm"].shape == (1, 4, 6, 6)

    # PyTorch refuses a plain backward hook on a module still marked as using full ones.
    model.norm.register_backward_hook(lambda *args: None).remove()
