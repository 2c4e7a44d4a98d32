"""Train the small CNN of the synthetic localisation benchmark (weights shipped in the package).

    python benchmarks/train_synthetic.py            # about a minute on 2 CPU cores

Reproduces the shipped weights: the data come from fixed seeds (camviz.evaluation.synthetic), the
initial weights and the batch order from a fixed seed, and torch runs deterministic
algorithms on one thread, so the same torch version on the same kind of CPU writes the same
file. The held-out accuracy it prints is on a set drawn with another seed.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name

from camviz.evaluation.synthetic import SHIPPED_WEIGHTS, SyntheticCNN, make_dataset
from camviz.io.render import atomic_write

TRAIN_SEED = 0
HELD_OUT_SEED = 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000, help="training images")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=SHIPPED_WEIGHTS)
    args = parser.parse_args()

    torch.manual_seed(TRAIN_SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    started = time.perf_counter()
    train = make_dataset(args.images, seed=TRAIN_SEED)
    held_out = make_dataset(1000, seed=HELD_OUT_SEED)
    model = SyntheticCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    steps = args.epochs * -(-len(train) // args.batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps)
    order = torch.Generator().manual_seed(TRAIN_SEED)
    for epoch in range(args.epochs):
        model.train()
        for batch in torch.randperm(len(train), generator=order).split(args.batch_size):
            loss = F.cross_entropy(model(train.images[batch]), train.labels[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        print(
            f"epoch {epoch + 1}/{args.epochs}: loss {loss.item():.3f}, held-out accuracy "
            f"{accuracy(model, held_out.images, held_out.labels):.3f} "
            f"({time.perf_counter() - started:.0f} s)"
        )
    with atomic_write(args.out) as file:
        torch.save(model.state_dict(), file)
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()[:16]
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB, sha256 {digest}...)")


@torch.inference_mode()
def accuracy(model: SyntheticCNN, images: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    return float((model(images).argmax(dim=1) == labels).float().mean())


if __name__ == "__main__":
    main()
