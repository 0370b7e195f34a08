"""Moonshot's released Kimi K3 modeling code under `backend="k3"`: build a tiny model from their
files (`KimiLinearForCausalLM`, or with `--model k3` the release's
`KimiK3ForConditionalGeneration`), adapt it to the decode-step call, compile, decode.

    K3_MOONSHOT_DIR=/path/to/moonshot python examples/moonshot.py            # CPU, tiny config
    K3_MOONSHOT_DIR=... python examples/moonshot.py --device cuda --tokens 32

K3_MOONSHOT_DIR names a folder holding modeling_kimi_linear.py and configuration_kimi_k3.py (the
Hugging Face repo moonshotai/Kimi-K3); `pip install -e ".[moonshot]"`. On CUDA with fla
installed, Moonshot's eager model runs fla's kernels; the adapted step always runs k3compile's
torch stand-ins, which the backend fuses. Prints tokens/s of Moonshot's eager generate loop and
of the compiled step (on a CPU the fused ops run their torch references), the prompt and the
compiled step's tokens, whether Moonshot's loop produced the same tokens, and the
per-layer fusion plan. The tiny model's experts are dense `nn.Linear`s, which `k3.moe_experts`
(MXFP4 only) does not take: the plan says so in each MoE layer.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

import k3compile.backend
from k3compile.adapt import adapt, moonshot


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def moonshot_decode(model, prompt, tokens):
    """Moonshot's own loop: prefill, then one token at a time through its KimiDynamicCache."""
    out = model(input_ids=prompt, use_cache=True)
    cache, ids, result = out.past_key_values, out.logits[:, -1].argmax(-1), []
    sync(prompt.device)
    start = time.perf_counter()
    for _ in range(tokens):
        result.append(ids)
        ids = model(input_ids=ids[:, None], past_key_values=cache,
                    use_cache=True).logits[:, -1].argmax(-1)
    sync(prompt.device)
    return torch.stack(result, 1), time.perf_counter() - start


def step_decode(step, prompt, tokens):
    """The built-in call: the prompt as one [B, T] step at position 0, then one token a step."""
    batch, plen = prompt.shape
    slots, start_pos = torch.arange(batch, device=prompt.device), torch.zeros_like(prompt[:, 0])
    ids, result = step(prompt, start_pos, slots)[:, -1].argmax(-1), []
    sync(prompt.device)
    start = time.perf_counter()
    for i in range(tokens):
        result.append(ids)
        ids = step(ids, start_pos + plen + i, slots).argmax(-1)
    sync(prompt.device)
    return torch.stack(result, 1), time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--executor", default="aten", choices=["aten", "inductor"])
    ap.add_argument("--model", default="kimi_linear", choices=["kimi_linear", "k3"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    k3compile.backend.ensure_registered()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    config = moonshot.tiny_k3_config() if args.model == "k3" else moonshot.tiny_config()
    model = moonshot.build(config, dtype=dtype, device=device)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(3, vocab, (args.batch, args.prompt_len),
                           generator=torch.Generator().manual_seed(0)).to(device)
    want, t_eager = moonshot_decode(model, prompt, args.tokens)

    step = adapt(model, max_batch=args.batch, max_seq_len=args.prompt_len + args.tokens + 1)
    compiled = torch.compile(step, backend="k3", fullgraph=True,
                             options={"executor": args.executor, "strict": False})
    t0 = time.perf_counter()
    step_decode(compiled, prompt, 1)  # compiles the prefill and the decode graph
    print(f"compile: {time.perf_counter() - t0:.1f} s")
    step.reset_cache()
    got, t_k3 = step_decode(compiled, prompt, args.tokens)

    n = args.batch * args.tokens
    print(f"moonshot eager: {n / t_eager:8.1f} tokens/s")
    print(f"adapted + k3:   {n / t_k3:8.1f} tokens/s")
    print(f"prompt: {prompt.tolist()}")
    print(f"tokens: {got.tolist()}")
    print(f"same tokens as Moonshot's eager loop: {torch.equal(got, want)}")
    print(k3compile.backend.last_compiled().summary())


if __name__ == "__main__":
    main()
