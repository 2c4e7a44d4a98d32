"""Shared fixtures: small models built once per session, and the shipped photos."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "assets"


@pytest.fixture(scope="session")
def cat_path() -> Path:
    return ASSETS / "chelsea.png"


@pytest.fixture(scope="session")
def coffee_path() -> Path:
    return ASSETS / "coffee.png"


@pytest.fixture(scope="session")
def resnet18() -> nn.Module:
    """A randomly initialised torchvision ResNet-18 (in-place ReLUs and ``+=``), eval mode."""
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).eval()


@pytest.fixture(scope="session")
def offline_model():
    """The shipped, ImageNet-pretrained EfficientNet-Lite0 with preprocessing and class names."""
    from camviz.models import load

    return load("efficientnet_lite0")


@pytest.fixture
def small_batch() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 3, 64, 64)
