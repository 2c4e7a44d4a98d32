"""Does ``torch.compile`` pay for Score-CAM's repeated passes? ResNet-50, one 224 px image,
``layer4`` (2,048 channels: 2,048 masked whole-network passes), on this CPU.

Run by hand (never in the tests)::

    python benchmarks/bench_compile.py             # 48 masked copies timed, then scaled
    python benchmarks/bench_compile.py --copies 96

Score-CAM at ``layer4`` runs the whole model on the image masked by each channel's map, in
chunks of as many copies as hold about 2^20 input values on a CPU (six at 224 px). This
times ``--copies`` such copies, in those chunks, eagerly and through ``torch.compile``
(inductor, static shapes; the first call, which compiles, is counted), checks that both
give the same scores, and scales both to 2,048 copies: eager time over compiled time,
compilation included, is the figure the issue asks for (adopt compiling at >= 1.3).
Random weights (the time does not depend on them); one thread per core as set by torch.
"""

from __future__ import annotations

import argparse
import time

import torch
from torchvision.models import resnet50

from camviz.cams.scorecam import CPU_PASS_VALUES

CHANNELS = 2048


def masked_copies(count: int) -> torch.Tensor:
    """``count`` masked copies of one image, as Score-CAM makes them (random masks)."""
    generator = torch.Generator().manual_seed(0)
    image = torch.rand(1, 3, 224, 224, generator=generator)
    masks = torch.rand(count, 1, 224, 224, generator=generator)
    return image * masks


def timed(model: torch.nn.Module, copies: torch.Tensor, chunk: int) -> tuple[float, torch.Tensor]:
    """Seconds to score every copy in chunks of ``chunk``, and the scores."""
    start = time.perf_counter()
    with torch.no_grad():
        scores = torch.cat([model(part)[:, 0] for part in copies.split(chunk)])
    return time.perf_counter() - start, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=48)
    arguments = parser.parse_args()
    chunk = max(1, min(64, CPU_PASS_VALUES // (3 * 224 * 224)))
    copies = masked_copies(arguments.copies // chunk * chunk)
    model = resnet50().eval()
    timed(model, copies[:chunk], chunk)  # warm-up: allocator, kernels chosen
    eager, expected = timed(model, copies, chunk)
    compiled_model = torch.compile(model)
    start = time.perf_counter()
    timed(compiled_model, copies[:chunk], chunk)  # compiles
    compiling = time.perf_counter() - start
    compiled, got = timed(compiled_model, copies, chunk)
    scale = CHANNELS / len(copies)
    capability, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    print(f"CPU capability {capability}, {threads} threads")
    print(
        f"{len(copies)} copies in chunks of {chunk}: eager {eager:.1f} s, compiled {compiled:.1f} s"
    )
    difference = (got - expected).abs().max()
    print(f"compilation {compiling:.1f} s; scores differ by at most {difference:.2e}")
    ratio = eager * scale / (compiling + compiled * scale)
    print(
        f"Score-CAM at layer4 ({CHANNELS} copies), eager / compiled with compilation: {ratio:.2f} "
        f"(without compilation {eager / compiled:.2f})"
    )


if __name__ == "__main__":
    main()
