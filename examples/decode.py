"""Greedy decode with the reference Kimi K3 model, eagerly and under `backend="k3"`.

    python examples/decode.py                      # tiny config, CPU or GPU
    python examples/decode.py --config small --tokens 32 --batch 4

Prints tokens/s for both, whether the two produced the same tokens, and the backend's per-layer
fusion plan vs actual (and its bucket guards).
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

import k3compile.backend
from k3compile.models import build_model, get_config


def decode(step, prompt: torch.Tensor, tokens: int, max_batch: int):
    """Feed the prompt one token at a time, then greedily extend it; returns (tokens, seconds)."""
    batch, plen = prompt.shape
    slots = torch.arange(batch, device=prompt.device)
    # a prompt column is a strided view; contiguous like the generated ids, or Dynamo guards on
    # the stride and recompiles when generation starts
    out, ids = [], prompt[:, 0].contiguous()
    start = None
    for pos in range(plen + tokens - 1):
        if pos == plen:  # time the generated part only
            if prompt.is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        positions = torch.full((batch,), pos, device=prompt.device)
        k3compile.backend.mark_batch(ids, positions, slots)  # one graph for every batch size
        logits = step(ids, positions, slots)
        ids = prompt[:, pos + 1].contiguous() if pos + 1 < plen else logits.argmax(-1)
        if pos + 1 >= plen:
            out.append(ids)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    return torch.stack(out, 1), time.perf_counter() - (start or time.perf_counter())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="float32 makes eager and k3 agree token for token on CPU")
    ap.add_argument("--executor", default=None, choices=["inductor", "aten"],
                    help="what runs the unfused rest (default: inductor on GPU, aten on CPU)")
    ap.add_argument("--no-k3", action="store_true", help="eager only")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")

    cfg = get_config(args.config)
    dtype = getattr(torch, args.dtype)
    max_len = args.prompt_len + args.tokens + 1
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=gen).to(args.device)

    model = build_model(cfg, device=args.device, dtype=dtype, max_batch=max(args.batch, 8), max_seq_len=max_len)
    with torch.no_grad():
        eager_tokens, secs = decode(model, prompt, args.tokens, args.batch)
    print(f"eager   {args.config} on {args.device}: {args.batch * args.tokens / secs:8.1f} tokens/s")
    if args.no_k3:
        return 0

    model.reset_cache()
    executor = args.executor or ("inductor" if args.device.startswith("cuda") else "aten")
    k3compile.backend.ensure_registered()  # a source tree on PYTHONPATH has no entry point
    compiled = torch.compile(model, backend="k3", fullgraph=True, options={"executor": executor})
    t0 = time.perf_counter()
    with torch.no_grad():
        k3_tokens, secs = decode(compiled, prompt, args.tokens, args.batch)
    print(f"k3      {args.config} on {args.device}: {args.batch * args.tokens / secs:8.1f} tokens/s "
          f"(compile + run {time.perf_counter() - t0:.1f} s, executor {executor})")
    same = torch.equal(eager_tokens, k3_tokens)
    print(f"same tokens as eager: {same}")
    print(k3compile.backend.last_compiled().summary())
    return 0 if same or dtype == torch.bfloat16 else 1


if __name__ == "__main__":
    raise SystemExit(main())
