"""Mjölnir denoising: N uploads in one batched reverse chain vs the same uploads denoised one after another.

Both sides run the library's chain (``denoise_many`` and ``denoise``) with the same UNet on N packed
gradients of one size and one noise level M, so each side makes (start step + 1) x N grid evaluations;
the batched side makes them in start step + 1 calls. Prints seconds per upload and the speed-up.

    .venv/bin/python benchmarks/mjolnir_denoise_batching.py [--uploads 8] [--side 128] [--noise-level 0.72]
        [--unet cpu] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

from attackers.diffusion import Schedule, denoise, denoise_many, start_step
from attackers.diffusion.unet import UNet, preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--uploads", type=int, default=8)
    parser.add_argument("--side", type=int, default=128, help="packed grid side (128: the DLG LeNet on photos)")
    parser.add_argument("--noise-level", type=float, default=0.72, help="M (0.72: start step 200)")
    parser.add_argument("--unet", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = UNet(preset(args.unet), args.side).to(device).eval()
    schedule = Schedule()
    y = torch.randn(args.uploads, 1, args.side, args.side, generator=torch.Generator().manual_seed(1)).to(device)
    steps = start_step(schedule, args.noise_level) + 1

    def timed(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def one_at_a_time() -> None:
        generator = torch.Generator(device=device).manual_seed(0)
        for i in range(args.uploads):
            denoise(model, schedule, y[i : i + 1], args.noise_level, generator)

    def batched() -> None:
        denoise_many(
            model, schedule, y, [args.noise_level] * args.uploads, torch.Generator(device=device).manual_seed(0)
        )

    sequential_s, batched_s = timed(one_at_a_time), timed(batched)
    print(
        f"{args.uploads} uploads, {args.side}x{args.side} grids, {args.unet} UNet, M {args.noise_level} "
        f"({steps} steps), {args.threads} thread(s) on {device}"
    )
    print(f"one at a time: {sequential_s / args.uploads:.2f} s per upload")
    print(f"batched:       {batched_s / args.uploads:.2f} s per upload ({sequential_s / batched_s:.2f}x)")


if __name__ == "__main__":
    main()
