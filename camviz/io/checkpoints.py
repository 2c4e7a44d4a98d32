"""Local checkpoints: read a state_dict without running code, and load it into an architecture.

Checkpoints are read with ``weights_only=True``: a file that pickles whole objects could run
code when loaded, so it is refused with the advice to save a state_dict. Training scripts
nest the state_dict (``"state_dict"``, ``"model_state_dict"``, ``"model"``) and prefix its
keys (``"module."`` of ``nn.DataParallel``, ``"_orig_mod."`` of ``torch.compile``); both are
undone. A classifier fine-tuned for another number of classes is recognised from the shape
of its output tensors, so the architecture is built for that number.
"""

from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from camviz.core.errors import CamvizError

if TYPE_CHECKING:
    from camviz.io.architectures import Architecture

__all__ = ["from_checkpoint", "load_weights", "read_state_dict", "shape_text"]

# Keys under which training scripts commonly nest the state_dict in a checkpoint.
_WRAPPER_KEYS = ("state_dict", "model_state_dict", "model")

# Prefixes added by nn.DataParallel / DistributedDataParallel and by torch.compile.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def from_checkpoint(architecture: Architecture, path: Path) -> tuple[nn.Module, int]:
    """Build ``architecture`` without weights and load the checkpoint at ``path`` into it.

    Returns:
        The model and its number of classes, read off the checkpoint's classifier.
    """
    state_dict = read_state_dict(path)
    layout = _layout(architecture)
    state_dict = _without_auxiliary_head(layout, state_dict)
    num_classes = _checkpoint_classes(layout, state_dict, architecture.num_classes)
    model = architecture.build(num_classes)
    problems = _mismatches(model.state_dict(), state_dict)
    if problems:
        raise CamvizError(
            f"the checkpoint {path} does not fit {architecture.name} ({problems}); pass "
            "--model with the architecture it was saved from"
        )
    model.load_state_dict(state_dict)
    return model, num_classes


def _layout(architecture: Architecture) -> dict[str, torch.Tensor]:
    """The architecture's own state_dict, for its names and shapes only: built on the meta
    device, which allocates nothing and skips the random initialisation (half a second for a
    ResNet-18) that a real model built only to read the checkpoint's class count would cost.
    An architecture whose construction reads tensor values (RegNet's block widths) cannot be
    built there, and is built for real."""
    try:
        with torch.device("meta"):
            return architecture.build(architecture.num_classes).state_dict()
    except (NotImplementedError, RuntimeError):
        return architecture.build(architecture.num_classes).state_dict()


def load_weights(model: nn.Module, path: Path, name: str) -> None:
    """Load the state_dict at ``path`` into ``model`` (named ``name`` in messages), every key
    and shape checked.

    Raises:
        CamvizError: The file cannot be read (:func:`read_state_dict`), or its tensors do
            not fit the model (the first differences are named).
    """
    state_dict = read_state_dict(path)
    problems = _mismatches(model.state_dict(), state_dict)
    if problems:
        raise CamvizError(
            f"the checkpoint {path} does not fit {name} ({problems}); pass the --model (and "
            "--model-arg) it was saved from"
        )
    model.load_state_dict(state_dict)


def _without_auxiliary_head(
    expected: Mapping[str, torch.Tensor], given: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``given`` without a segmentation model's auxiliary classifier when ``expected`` has
    none: that head serves training only (its output is never the model's answer)."""
    prefix = "aux_classifier."
    if any(key.startswith(prefix) for key in expected):
        return given
    return {key: value for key, value in given.items() if not key.startswith(prefix)}


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state_dict from a checkpoint file, without running any code in it.

    Accepts a raw state_dict, one nested under ``"state_dict"``, ``"model_state_dict"`` or
    ``"model"``, and ``.safetensors`` files; strips the ``"module."`` prefix of
    ``nn.DataParallel`` and the ``"_orig_mod."`` prefix of ``torch.compile``.

    Raises:
        CamvizError: The file is missing or unreadable, pickles whole objects, holds no
            tensors, or names them with keys that are not strings.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise CamvizError(f"checkpoint {path} {what}; give the path of a .pt/.pth file")
    checkpoint = _read_checkpoint(path)
    while isinstance(checkpoint, dict):
        nested = [checkpoint[key] for key in _WRAPPER_KEYS if isinstance(checkpoint.get(key), dict)]
        if not nested:
            break
        checkpoint = nested[0]
    if not (
        isinstance(checkpoint, dict)
        and checkpoint
        and all(isinstance(value, torch.Tensor) for value in checkpoint.values())
    ):
        raise CamvizError(
            f"{path} holds no state_dict (a dict of tensors); save one with "
            "torch.save(model.state_dict(), PATH)"
        )
    unnamed = next((key for key in checkpoint if not isinstance(key, str)), None)
    if unnamed is not None:
        raise CamvizError(
            f"{path} holds a dict of tensors whose keys are not all parameter names (one is "
            f"{type(unnamed).__name__} {unnamed!r}); save a state_dict with "
            "torch.save(model.state_dict(), PATH)"
        )
    return _without_wrapper_prefixes(checkpoint)


def _read_checkpoint(path: Path) -> Any:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu")
        except Exception as error:  # safetensors raises its own error types
            raise CamvizError(f"{path} is not a readable safetensors file ({error})") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's multi-line advice to drop weights_only
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch names what the file would have run or built: "GLOBAL posix.system".
        pickled = re.search(r"GLOBAL (\S+)", str(error))
        if pickled is None:  # not a pickle at all
            raise CamvizError(_not_a_checkpoint(path, error)) from None
        raise CamvizError(
            f"{path} is not a plain state_dict (it pickles {pickled.group(1)}); camviz loads "
            "weights only, for safety (unpickling anything else can run code), so save one "
            "with torch.save(model.state_dict(), PATH)"
        ) from None
    except PermissionError:
        raise CamvizError(f"cannot read {path}: permission denied; check its permissions") from None
    except Exception as error:  # torch.load fails on foreign files with many error types
        raise CamvizError(_not_a_checkpoint(path, error)) from None


def _not_a_checkpoint(path: Path, error: Exception) -> str:
    return (
        f"{path} is not a PyTorch checkpoint camviz can read ({type(error).__name__}); save "
        "one with torch.save(model.state_dict(), PATH)"
    )


def _without_wrapper_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if all(key.startswith(prefix) for key in state_dict):
                state_dict = {key.removeprefix(prefix): value for key, value in state_dict.items()}
                stripped = True
    return state_dict


def _checkpoint_classes(
    expected: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor], num_classes: int
) -> int:
    """The number of classes the checkpoint was trained for.

    A classifier trained for ``N`` classes differs from the architecture's only in the first
    dimension of its output tensors (``fc.weight``, ``fc.bias``, or a 1x1 convolution), which
    is ``num_classes`` in the architecture and ``N`` in the checkpoint. Those tensors give
    ``N``; when there are none, or they disagree, the architecture's count stands and the
    mismatch is reported by the key check.
    """
    found = {
        given[key].shape[0]
        for key in expected.keys() & given.keys()
        if expected[key].dim() > 0
        and given[key].dim() == expected[key].dim()
        and expected[key].shape[0] == num_classes
        and given[key].shape[0] != num_classes
        and given[key].shape[1:] == expected[key].shape[1:]
    }
    return found.pop() if len(found) == 1 else num_classes


def _mismatches(expected: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor]) -> str:
    """A short description of how ``given`` fails to fit ``expected``; empty if it fits."""
    missing = [key for key in expected if key not in given]
    unexpected = [key for key in given if key not in expected]
    reshaped = [
        f"{key} is {shape_text(given[key])} in the file but {shape_text(expected[key])} in "
        "the model"
        for key in expected
        if key in given and given[key].shape != expected[key].shape
    ]
    parts = [
        _listed("missing keys", missing),
        _listed("unexpected keys", unexpected),
        _listed("wrong shapes", reshaped, quote=False),
    ]
    return "; ".join(part for part in parts if part)


def _listed(what: str, items: list[str], quote: bool = True, shown: int = 2) -> str:
    if not items:
        return ""
    names = ", ".join(repr(item) if quote else item for item in items[:shown])
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return f"{what}: {names}{more}"


def shape_text(tensor: torch.Tensor) -> str:
    """A tensor's shape as ``3x224x224`` (``a scalar`` for none)."""
    return "x".join(map(str, tensor.shape)) or "a scalar"
