"""Train the small networks of camviz.synthetic (their weights are shipped in the package).

    python benchmarks/train_synthetic.py                   # the classifier, about a minute
    python benchmarks/train_synthetic.py --model detector  # the detector, about 3 minutes

on 2 CPU cores. ``classifier`` is :class:`SyntheticCNN` on one-object images
(``synthetic_cnn.pt``); ``detector`` is :class:`SyntheticDetector` on scenes of 1 to 4 objects
(``synthetic_detector.pt``).

Reproduces the shipped weights: the data come from fixed seeds (camviz.evaluation.synthetic), the
initial weights and the batch order from a fixed seed, and torch runs deterministic
algorithms on one thread, so the same torch version on the same kind of CPU writes the same
file. The held-out score it prints is on a set drawn with another seed: the classifier's
accuracy, or the share of objects the detector finds (a box of the object's class with
probability >= 0.25 and IoU >= 0.5 with the object's box).
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn
from torchvision.ops import box_convert, box_iou

from camviz.evaluation.synthetic import (
    SHIPPED_DETECTOR,
    SHIPPED_WEIGHTS,
    SyntheticCNN,
    SyntheticDetector,
    SyntheticScenes,
    make_dataset,
    make_scenes,
)
from camviz.io.atomic import atomic_write

TRAIN_SEED = 0
HELD_OUT_SEED = 1
DEFAULTS = {  # images, epochs, learning rate, weights file
    "classifier": (4000, 5, 3e-3, SHIPPED_WEIGHTS),
    "detector": (3000, 10, 1e-2, SHIPPED_DETECTOR),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(DEFAULTS), default="classifier")
    parser.add_argument("--images", type=int, help="training images")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    images, epochs, learning_rate, out = DEFAULTS[args.model]
    images, epochs = args.images or images, args.epochs or epochs
    out = args.out or out

    torch.manual_seed(TRAIN_SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    started = time.perf_counter()
    model: nn.Module
    if args.model == "classifier":
        train = make_dataset(images, seed=TRAIN_SEED)
        held_out = make_dataset(1000, seed=HELD_OUT_SEED)
        model = SyntheticCNN()

        def loss_of(batch: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(model(train.images[batch]), train.labels[batch])

        def score() -> str:
            return f"held-out accuracy {accuracy(model, held_out.images, held_out.labels):.3f}"

    else:
        scenes = make_scenes(images, objects=(1, 4), seed=TRAIN_SEED)
        held_out_scenes = make_scenes(500, objects=(1, 4), seed=HELD_OUT_SEED)
        detector = model = SyntheticDetector()

        def loss_of(batch: torch.Tensor) -> torch.Tensor:
            boxes = [scenes.boxes[n] for n in batch]
            return detector.loss(scenes.images[batch], boxes, [scenes.labels[n] for n in batch])

        def score() -> str:
            return f"held-out objects found {found(detector, held_out_scenes):.3f}"

    fit(model, images, loss_of, epochs, args.batch_size, learning_rate, score, started)
    with atomic_write(out) as file:
        torch.save(model.state_dict(), file)
    digest = hashlib.sha256(out.read_bytes()).hexdigest()[:16]
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB, sha256 {digest}...)")


def fit(
    model: nn.Module,
    images: int,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    epochs: int,
    batch_size: int,
    learning_rate: float,
    score: Callable[[], str],
    started: float,
) -> None:
    """AdamW with a one-cycle schedule over shuffled batches of image indices."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=1e-4)
    steps = epochs * -(-images // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=learning_rate, total_steps=steps
    )
    order = torch.Generator().manual_seed(TRAIN_SEED)
    for epoch in range(epochs):
        model.train()
        for batch in torch.randperm(images, generator=order).split(batch_size):
            loss = loss_of(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        model.eval()
        with torch.inference_mode():
            print(
                f"epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}, {score()} "
                f"({time.perf_counter() - started:.0f} s)"
            )


def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    return float((model(images).argmax(dim=1) == labels).float().mean())


def found(detector: SyntheticDetector, scenes: SyntheticScenes) -> float:
    """The share of objects with a predicted box of their class, probability >= 0.25, IoU >= 0.5."""
    predictions = detector(scenes.images)
    hits = []
    for cells, boxes, labels in zip(predictions, scenes.boxes, scenes.labels, strict=True):
        overlaps = box_iou(boxes.float(), box_convert(cells[:, :4], "cxcywh", "xyxy"))
        confident = cells[:, 4:][:, labels].T >= 0.25  # (objects, cells)
        hits.append(((overlaps >= 0.5) & confident).any(dim=1))
    return float(torch.cat(hits).float().mean())


if __name__ == "__main__":
    main()
