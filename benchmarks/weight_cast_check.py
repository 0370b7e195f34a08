"""Host time of stage weight_cast's per-call check (k3compile/stages/weight_cast.py): `Cast.wrap`
around a no-op against the no-op, for N fp32 masters whose copies are up to date (the steady
state: one address and one version read per master, no copy). One `data_ptr()` read per weight
is printed beside it as the yardstick of this host's Python speed.

    python benchmarks/weight_cast_check.py [N ...]     (default: 57 1024; CPU tensors)
"""

import sys
import timeit

import torch

from k3compile.stages.weight_cast import Cast


def best_us(fn, number: int = 1000, repeat: int = 7) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main(counts: list[int]) -> None:
    for n in counts:
        masters = [torch.nn.Parameter(torch.randn(64, 64), requires_grad=False) for _ in range(n)]
        copies = [m.to(torch.bfloat16) for m in masters]
        args = [torch.randn(2, 64), *masters]  # a user input, then the masters
        step = Cast(list(range(1, n + 1)), copies, [None] * n, masters).wrap(lambda a: None)

        def plain(a):
            return None

        check = (best_us(lambda step=step, args=args: step(list(args)))
                 - best_us(lambda plain=plain, args=args: plain(list(args))))
        pointer = best_us(lambda masters=masters: [w.data_ptr() for w in masters])
        print(f"{n} weights: check {check:.1f} us per call ({1e3 * check / n:.0f} ns per weight); "
              f"one data_ptr() per weight alone {1e3 * pointer / n:.0f} ns")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [57, 1024])
