"""`k3compile generate`: greedy decode from a prompt under eager, Inductor and k3, timed side by side.

    k3compile generate                                    # tiny model, CPU: eager and k3
    k3compile generate --config small --batch 1 8 --backends eager,inductor,k3 --plot out.png
    k3compile generate --config k3_tp16 --layers 4 --device cuda --verify-rows 8
    k3compile generate --checkpoint DIR --config tiny --prompt-ids 1,2,3

The model is a built-in config (seeded random weights) or a checkpoint folder
(`k3compile.models.loader`; the architecture is `--config`, overridden by the folder's
`config.json` where it names K3Config fields). A text prompt goes through a byte tokenizer (one id
per UTF-8 byte): the built-in configs have no real vocabulary; a checkpoint wants `--prompt-ids`.

What is timed is honest decode and nothing else. Per backend and batch, one untimed decode first
compiles and warms the step (every bucket, and on a GPU the CUDA-graph capture), then the state is
reset and a second decode is timed from the first generated token on. Every call passes
contiguous int64 ids, positions and slots with the batch marked dynamic the same way, and the
compile counters (Dynamo's graphs, k3's buckets) are read around the timed part: the table's
`recompiles` column must be 0.

Verify rows (`--verify-rows T` > 1): every step takes [B, T] ids as a speculative verifier does.
The draft is the reference continuation (eager, one row per step, untimed): every draft token is
accepted where a backend agrees with it, so a step yields T tokens. The prompt is left-padded with
id 0 to a multiple of T and prefilled T rows per step. Greedy tokens of every backend are compared
with that reference; in fp32 a difference is an error (exit status 1).

Per-layer time is a step's time divided by the layer count (embedding and lm_head included);
`--plot` draws it per batch bucket, one line per backend (needs matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from k3compile import precompile
from k3compile.tools.args import option, positive_int

BACKENDS = ("eager", "inductor", "k3")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_PROMPT = "Kimi K3 decodes"


# ---- tokens ---------------------------------------------------------------------------------

def byte_encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def byte_decode(ids: Sequence[int]) -> str:
    """Ids below 256 as UTF-8 bytes (undecodable ones replaced), others as <id>."""
    out, run = [], bytearray()
    for i in ids:
        if i < 256:
            run.append(i)
            continue
        out.append(run.decode("utf-8", errors="replace"))
        run = bytearray()
        out.append(f"<{i}>")
    out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)


def id_list(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ids") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: want one or more ids >= 0")
    return ids


def backend_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown backend {', '.join(unknown) or repr(text)}; the backends: {', '.join(BACKENDS)}")
    return list(dict.fromkeys(names))


def device_type(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: want cpu or cuda (cuda:N)")
    return device


# ---- decoding -------------------------------------------------------------------------------

def call_step(step: Callable, ids: torch.Tensor, position: int, slots: torch.Tensor):
    """One decode step with the inputs every call of every backend gets: contiguous int64 ids
    ([B] or [B, T]), positions and slots, the batch dim marked dynamic."""
    # a fresh buffer: a slice of one row keeps its stride through contiguous() (size-1 dims), and
    # Dynamo would make that stride a graph input of its own
    ids = ids.to(torch.long).clone(memory_format=torch.contiguous_format)
    positions = torch.full((ids.shape[0],), position, dtype=torch.long, device=ids.device)
    if not precompile.RESTORED:  # a restored step has the batch symbolic already (--warm-start)
        for t in (ids, positions, slots):
            # maybe_: a batch of 1 stays Dynamo's static graph instead of raising
            torch._dynamo.maybe_mark_dynamic(t, 0)
    return step(ids, positions, slots)


def decode(step: Callable, model, prompt: torch.Tensor, steps: int, T: int,
           draft: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Greedy decode from a fresh state: prefill `prompt` [B, P] (P a multiple of T) T rows per
    step, then `steps` timed steps. T = 1 feeds back each step's argmax; T > 1 feeds the `draft`
    [B, >= steps*T] (the verify rows). Returns the greedy tokens [B, 1 + steps*T] (the prefill's
    last prediction first) and the seconds of the timed steps."""
    if T > 1 and draft is None:
        raise ValueError("verify rows (T > 1) need a draft to verify")
    model.reset_cache()
    B, P = prompt.shape
    slots = torch.arange(B, device=prompt.device)
    seq = prompt if draft is None else torch.cat([prompt, draft[:, :steps * T]], 1)

    def feed(p: int, ids: torch.Tensor) -> torch.Tensor:  # greedy tokens [B, rows]
        ids = ids[:, 0] if T == 1 else ids
        return call_step(step, ids, p, slots).argmax(-1).view(B, -1)

    for p in range(0, P, T):
        last = feed(p, seq[:, p:p + T])
    out = [last[:, -1:]]
    _sync(prompt.device)
    start = time.perf_counter()
    for k in range(steps):
        p = P + k * T
        out.append(feed(p, out[-1][:, -1:] if draft is None else seq[:, p:p + T]))
    _sync(prompt.device)
    return torch.cat(out, 1), time.perf_counter() - start


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compile_counts() -> tuple[int, int]:
    """(Dynamo graphs compiled, k3 buckets compiled) so far in this process."""
    from k3compile import backend

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return graphs, sum(len(c.buckets) for c in backend._compiled)


# ---- the run --------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    backend: str
    batch: int
    T: int
    steps: int
    seconds: float  # the timed steps
    ready: float  # compile + warm-up, seconds
    recompiles: int  # Dynamo graphs + k3 buckets compiled inside the timed steps
    tokens: torch.Tensor  # [B, 1 + steps*T]
    layers: int

    def as_dict(self) -> dict:
        return {"backend": self.backend, "batch": self.batch, "T": self.T, "steps": self.steps,
                "seconds": self.seconds, "ready_s": self.ready, "recompiles": self.recompiles,
                "tokens_per_s": self.tokens_per_s, "ms_per_step": self.ms_per_step,
                "us_per_layer": self.us_per_layer, "tokens": self.tokens.tolist()}

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.steps * self.T / self.seconds

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / self.steps

    @property
    def us_per_layer(self) -> float:
        return 1e3 * self.ms_per_step / self.layers


@dataclasses.dataclass
class Plan:
    model: Any
    layers: int
    prompt: torch.Tensor  # [max batch, P], P a multiple of T
    T: int
    steps: int
    batches: list[int]
    options: dict


def make_step(name: str, model, options: dict) -> Callable:
    if name == "eager":
        return model
    torch._dynamo.reset()  # one backend's compiled code must not serve another's calls
    if name == "inductor":
        return torch.compile(model, fullgraph=True)
    from k3compile import backend

    backend.ensure_registered()
    return torch.compile(model, backend="k3", fullgraph=True, options=options)


def reference(plan: Plan, batch: int) -> torch.Tensor:
    """Eager's greedy tokens, one row per step (untimed): the draft of verify rows and what every
    backend's tokens are compared with."""
    tokens, _ = decode(plan.model, plan.model, plan.prompt[:batch], plan.steps * plan.T, 1)
    return tokens


def verify_summary(first: int) -> str | None:
    """Verify mode's count over the k3 graphs compiled since `backend._compiled[first]`."""
    from k3compile import backend

    reports = [r for c in backend._compiled[first:] if c.options.verify
               for r in c.observer.reports.values()]
    if not reports:
        return None
    reverted = [x for r in reports for x in r.reverted]
    return (f"verify: {sum(r.verified for r in reports)} rewrites verified, {len(reverted)} "
            "reverted" + "".join(f"\n  reverted: {x.pattern} @ {x.module}: {x.error}" for x in reverted))


def run_backend(name: str, plan: Plan, drafts: dict[int, torch.Tensor],
                say: Callable[[str], None]) -> list[Row]:
    from k3compile import backend

    executor = f", executor {plan.options['executor']}" if name == "k3" else ""
    say(f"{name}: {'warming up' if name == 'eager' else 'compiling'} batch "
        f"{', '.join(map(str, plan.batches))} (T={plan.T}{executor}) ...")
    first = len(backend._compiled)
    step = make_step(name, plan.model, plan.options)
    rows = []
    with torch.no_grad():
        for batch in plan.batches:
            prompt, draft = plan.prompt[:batch], drafts[batch] if plan.T > 1 else None
            t0, before = time.perf_counter(), compile_counts()
            decode(step, plan.model, prompt, 2, plan.T, draft)  # compile, warm, capture
            ready, warm = time.perf_counter() - t0, compile_counts()
            tokens, seconds = decode(step, plan.model, prompt, plan.steps, plan.T, draft)
            recompiles = sum(compile_counts()) - sum(warm)
            built = (f": {warm[0] - before[0]} Dynamo graph(s), {warm[1] - before[1]} k3 "
                     "bucket(s) compiled" if name != "eager" else "")
            say(f"{name}: batch {batch} ready in {ready:.1f} s{built}")
            rows.append(Row(name, batch, plan.T, plan.steps, seconds, ready, recompiles, tokens,
                            plan.layers))
    verified = verify_summary(first) if name == "k3" else None
    if verified:
        say(f"{name}: {verified}")
    return rows


def compare(rows: list[Row], refs: dict[int, torch.Tensor], exact: bool) -> tuple[list[str], bool]:
    """One line per backend and batch where the greedy tokens differ from the reference."""
    lines, same = [], True
    for r in rows:
        ref = refs[r.batch]
        diff = (r.tokens != ref).nonzero()
        if len(diff) == 0:
            continue
        same = False
        b, i = diff[0].tolist()
        why = "" if exact else " (expected in reduced precision: greedy ties round apart)"
        lines.append(f"TOKENS DIFFER: {r.backend} at batch {r.batch}: {len(diff)} of "
                     f"{ref.numel()} tokens differ from eager's greedy decode; first: request {b}, "
                     f"token {i}: {r.tokens[b, i].item()} vs {ref[b, i].item()}{why}")
    return lines, same


def table(rows: list[Row]) -> str:
    head = (f"{'backend':<9} {'batch':>5} {'T':>3} {'tokens/s':>10} {'ms/step':>9} "
            f"{'us/layer':>9} {'ready s':>8} {'recompiles':>10}")
    out = [head]
    for r in rows:
        out.append(f"{r.backend:<9} {r.batch:>5} {r.T:>3} {r.tokens_per_s:>10.1f} "
                   f"{r.ms_per_step:>9.3f} {r.us_per_layer:>9.1f} {r.ready:>8.1f} "
                   f"{r.recompiles:>10}")
    return "\n".join(out)


def plot(rows: list[Row], path: str, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    batches = sorted({r.batch for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r.backend for r in rows):
        per = {r.batch: r.us_per_layer for r in rows if r.backend == name}
        ax.plot(range(len(batches)), [per.get(b, math.nan) for b in batches], marker="o",
                label=name)
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("batch bucket")
    ax.set_ylabel("µs per layer (step / layers)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


# ---- the model and the prompt ---------------------------------------------------------------

def folder_config(directory: Path, base):
    """`base` with the fields the folder's config.json names (its `text_config` if nested)."""
    path = directory / "config.json"
    if not path.exists():
        return base, None
    data = json.loads(path.read_text())
    data = data.get("text_config", data)
    fields = {f.name for f in dataclasses.fields(base)} - {"name", "tp_size"}
    known = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields}
    return dataclasses.replace(base, **known), f"{path.name}: {len(known)} fields"


def load_model(args, device: torch.device, max_batch: int, max_seq_len: int):
    from k3compile.models import build_model, get_config

    cfg = get_config(args.config)
    note = None
    if args.checkpoint:
        cfg, note = folder_config(Path(args.checkpoint), cfg)
    if args.layers:
        cfg = cfg.with_layers(args.layers)
    model = build_model(cfg, device=device, dtype=getattr(torch, args.dtype),
                        max_batch=max_batch, max_seq_len=max_seq_len)
    if args.checkpoint:
        from k3compile.models.loader import load_checkpoint

        load_checkpoint(model, args.checkpoint)
    return model, cfg, note


def prompt_tensor(ids: list[int], batch: int, T: int, device: torch.device) -> torch.Tensor:
    """[batch, P] with every request the same prompt, left-padded with id 0 to a multiple of T."""
    pad = -len(ids) % T
    row = torch.tensor([0] * pad + ids, dtype=torch.long, device=device)
    return row.expand(batch, -1).contiguous()


# ---- the command line -----------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--config", default="tiny", help="built-in config (tiny, small, k3_tp16, ...), "
                   "or the architecture of --checkpoint")
    p.add_argument("--checkpoint", metavar="DIR", help="load weights from a checkpoint folder")
    p.add_argument("--layers", type=positive_int, help="cut the config to its first N layers")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help=f"text, one id per UTF-8 byte (default {DEFAULT_PROMPT!r})")
    src.add_argument("--prompt-ids", type=id_list, metavar="IDS", help="token ids, e.g. 1,2,3")
    p.add_argument("--tokens", type=positive_int, default=16,
                   help="tokens to generate per request (rounded up to whole verify steps)")
    p.add_argument("--batch", type=positive_int, nargs="+", default=[2],
                   help="batch size(s): one timed decode each")
    p.add_argument("--verify-rows", type=positive_int, default=1, metavar="T",
                   help="speculative verify rows: every step takes [B, T] ids (default 1)")
    p.add_argument("--backends", type=backend_list, metavar="LIST",
                   help="comma-separated, from eager,inductor,k3 (default: eager,k3 on CPU, "
                   "all three on CUDA: Inductor's C++ build costs ~30 s per graph on a small CPU)")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="float32 (default): every backend must produce eager's greedy tokens")
    p.add_argument("--device", type=device_type, help="cpu or cuda (default: cuda where available)")
    p.add_argument("--option", action="append", default=[], type=option, metavar="KEY=VALUE",
                   help="a k3 backend option (e.g. executor=aten; default executor: aten on "
                   "CPU, inductor on CUDA); repeatable")
    p.add_argument("--warm-start", action="store_true",
                   help="torch's caching precompile for the k3 backend (k3compile/precompile.py): "
                        "this run saves Dynamo's packages, the next run with the same model "
                        "loads them instead of tracing; not with inductor (torch keys a package "
                        "by the function, not the backend)")
    p.add_argument("--plot", metavar="PNG", help="plot per-layer time per batch bucket")
    p.add_argument("--json", metavar="PATH", help="also write the rows (and tokens) as JSON")
    p.add_argument("--threads", type=positive_int,
                   help="torch's CPU threads for this run (default: torch's own choice)")
    p.set_defaults(run=functools.partial(_run_cli, p))
    return p


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[torch.device, dict]:
    from k3compile.models import get_config
    from k3compile.settings import Options

    try:
        cfg = get_config(args.config)
    except ValueError as e:
        parser.error(f"--config {args.config}: {e}")
    if args.layers and args.layers > cfg.num_hidden_layers:
        parser.error(f"--layers {args.layers}: config {args.config} has {cfg.num_hidden_layers} "
                     "layers")
    if args.checkpoint and not Path(args.checkpoint).is_dir():
        parser.error(f"--checkpoint {args.checkpoint}: not a folder")
    if args.checkpoint and args.prompt is not None:
        parser.error("--prompt TEXT uses the byte tokenizer of the built-in configs; give a "
                     "checkpoint's token ids with --prompt-ids")
    ids = args.prompt_ids or byte_encode(args.prompt if args.prompt is not None else DEFAULT_PROMPT)
    vocab = cfg.vocab_size // cfg.tp_size
    if not ids or max(ids) >= vocab:
        parser.error(f"prompt ids must be in [0, {vocab}) for config {args.config}")
    args.ids = ids
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    args.backends = args.backends or (list(BACKENDS) if device.type == "cuda" else ["eager", "k3"])
    if args.warm_start and "inductor" in args.backends:
        parser.error("--warm-start compiles the model's forward under k3 only (torch keys a "
                     "saved package by the function, not the backend): drop inductor from "
                     "--backends")
    options = dict(args.option)
    options.setdefault("executor", "inductor" if device.type == "cuda" else "aten")
    buckets = Options.make(options).buckets
    if "k3" in args.backends and max(args.batch) > max(buckets):
        parser.error(f"--batch {max(args.batch)} is above the largest bucket {max(buckets)} "
                     "(it would run uncompiled): add a bucket with --option buckets=[...]")
    return device, options


def _run_cli(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    device, options = _check(parser, args)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        return _generate(args, device, options)
    finally:
        torch.set_num_threads(threads)


def _generate(args: argparse.Namespace, device: torch.device, options: dict) -> int:
    T, batches = args.verify_rows, sorted(set(args.batch))
    steps = -(-max(args.tokens - 1, 1) // T)
    prompt = prompt_tensor(args.ids, max(batches), T, device)
    say = functools.partial(print, flush=True)
    say(f"k3compile generate: building {args.config}"
        f"{' from ' + args.checkpoint if args.checkpoint else ''} ({args.dtype}, {device}) ...")
    model, cfg, note = load_model(args, device, max(batches),
                                  prompt.shape[1] + steps * T + 2 * T + 1)
    rank = (f"; one of {cfg.tp_size} tensor-parallel ranks at world size 1 (logits over its "
            f"1/{cfg.tp_size} of the vocabulary)" if cfg.tp_size > 1 else "")
    say(f"model: {cfg.name}, {cfg.num_hidden_layers} layers{rank}"
        + (f" ({note})" if note else ""))
    say(f"prompt: {prompt.shape[1]} ids{' (left-padded to a multiple of T)' if len(args.ids) % T else ''}"
        f"; {1 + steps * T} tokens per request: 1 from the prompt's last step, then {steps} timed "
        f"step(s) of T={T} at batch {', '.join(map(str, batches))}")
    plan = Plan(model, cfg.num_hidden_layers, prompt, T, steps, batches, options)
    say("reference: eager greedy decode, one row per step (untimed) ...")
    with torch.no_grad():
        refs = {b: reference(plan, b) for b in batches}
    rows = []
    # --warm-start: torch's switch, read by torch.compile and each trace, on for the run only
    with torch._dynamo.config.patch(caching_precompile=args.warm_start or
                                    torch._dynamo.config.caching_precompile):
        for name in args.backends:
            rows += run_backend(name, plan, refs, say)
        if args.warm_start:
            saved = precompile.save()
            say(f"warm start: {len(precompile.RESTORED)} graph(s) restored without a Dynamo "
                f"trace, {saved} saved for the next run")
    say("")
    say(table(rows))
    exact = args.dtype == "float32"
    differ, same = compare(rows, refs, exact)
    for line in differ:
        say(line)
    if same:
        say(f"tokens: every backend produced eager's greedy tokens ({refs[batches[0]].shape[1]} "
            f"per request)")
    recompiled = [r for r in rows if r.recompiles]
    for r in recompiled:
        say(f"RECOMPILED inside the timed steps: {r.backend} at batch {r.batch} ({r.recompiles})")
    text = byte_decode(refs[batches[0]][0].tolist()) if not args.checkpoint else None
    if text is not None:
        say(f"request 0 (byte tokenizer, random weights): {text!r}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"rows": [r.as_dict() for r in rows],
             "reference": {str(b): t.tolist() for b, t in refs.items()}}, indent=1) + "\n")
        say(f"json: {args.json}")
    if args.plot:
        say(plot(rows, args.plot, f"{cfg.name}, {cfg.num_hidden_layers} layers, T={T}, "
                 f"{args.dtype}, {device}"))
    return 1 if recompiled or (not same and exact) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="python -m k3compile.tools.generate",
                                                   description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
