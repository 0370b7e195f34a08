"""Decoder layers 1-4 of Kimi K3 (KDA, KDA, MLA, KDA, all MoE) at one TP16 rank's shapes: time,
kernels and bytes per layer for eager, Inductor + CUDA graph and `backend="k3"` + CUDA graph.

    python benchmarks/decode_layer.py                          # GPU: k3_tp16, bf16, MLA context 4096
    python benchmarks/decode_layer.py --config tiny --smoke    # CPU, seconds: the same code paths (CI)
                                                               # (k3 on CPU: executor aten, --cpu-executor)
    python benchmarks/decode_layer.py --model hf               # the second spelling, same shapes
    K3_MOONSHOT_DIR=... python benchmarks/decode_layer.py --model moonshot   # Moonshot's code

`--model hf`: the same layers written the second way (`k3compile/models/hf_k3.py`, transformers
style), built from the built-in model with its weights shared (`from_reference(share=True)`: only
the stacked q|k|v and gate|up are new tensors) and its state copied, fed the same inputs (its
layer 1 reads prefix + delta, the running sum), timed and checked the same way; the JSON says
which model (`meta.model`, per bucket `model`) and is decode_layer_hf.json. Bytes are counted on
the built-in layers: the same weights and state.

`--model moonshot`: the same layers in Moonshot's released modeling code (K3_MOONSHOT_DIR), loaded
as a user loads the release and adapted by `k3compile.adapt`: the built-in model at one rank's
widths as a TP1 model (`rank_config`: heads, intermediates and vocab / tp) written as a checkpoint
in the release's layout (`save_checkpoint`; experts compressed-tensors MXFP4, group 32) beside a
config.json derived from the release's (`moonshot_config`: the rank's widths, its 5 layers, the
release's `quantization_config`), `moonshot.from_pretrained` (`load_moonshot`; needs
compressed-tensors), `adapt` with the built-in model's decode state copied in (`moonshot_stack`),
fed the same inputs as `--model hf`. Bytes are counted on the built-in layers.
decode_layer_moonshot.json.

Both other spellings' stacks return the running sum after layer 4, which their layer adds in its
last line (Moonshot's `prefix_sum = prefix_sum + hidden_states`); the built-in stack returns
(prefix, delta) unsummed. So their step runs one elementwise add kernel more (+0.25 in
`kernels_per_layer`), which a whole model's next layer or final depth mix takes
(tests/adapt/test_decode_layer_moonshot.py, docs/decisions.md session 18 hidx).

Per batch bucket (B = 1..64 single-token decode, and B = 1 with T = 8 verify rows):

* correctness: every compiled variant on fresh random inputs, outputs (prefix, delta) and state
  updates (KDA recurrent and conv state, the MLA cache rows written), against eager bf16 and an
  fp32 copy of the stack; it passes where its error to fp32 is within 2x eager bf16's own (3x for
  the max). Weights for the check (`check_weights`): a router bias that alone decides the top-k,
  so no rounding difference can flip an expert;
* time: the model's own weights again; CUDA events, median over CUDA-graph replays (eager: over
  plain calls), one step of 4 layers divided by 4;
* kernels: CUDA kernels of one step (profiler; for graphs also the graph's kernel nodes), / 4;
* bytes: every non-expert weight once, the distinct experts the step routed to (counted from its
  own routing), KDA state read + write, conv state read + write, MLA cache read (context x 576 x 2);
  floor = bytes / device-to-device copy bandwidth measured at the start (read + write counted).

The 4 layers hold about 4.7 GB of weights (3.9 GB of them experts) and a step reads >= 0.8 GB, far
above the H200's 60 MB L2, so replays need no weight rotation.

Writes decode_layer.json (and decode_layer.png if matplotlib is installed) under --out.
`--compile-only` compiles the listed buckets and exits: run several at once to fill Inductor's
on-disk caches before the timed run (see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from k3compile.models import build_model, get_config
from k3compile.models.hf_k3 import from_reference

STACK_LAYERS = (1, 2, 3, 4)
VARIANTS = ("eager", "inductor", "k3", "k3-novalidate", "k3-grouped", "k3-inductorcheck")
# A/B variants of k3 (need k3 in --variants): k3-novalidate is `validate="off"` (the input
# check's cost), k3-grouped `K3_MOE_GROUPED` (the routed experts by expert at 8-64 rows),
# k3-inductorcheck `K3_CHECK_KERNEL=0` (the input check by Inductor, not the default CuTe launch;
# CUDA only). Each compiles
# and captures a step of its own (`own_backend`); a `kernels` variant that did not is an error.
DEFAULT_VARIANTS = VARIANTS[:3]
# A variant passes where, against an fp32 evaluation of the same weights and inputs, each output
# and state error is at most `factor` x eager-bf16's own (max_err: x `factor_max`), or `floor`.
# Errors: max_err = max|out - ref| / max|ref|, rel_l2 = |out - ref| / |ref|.
TOL = {"factor": 2.0, "factor_max": 3.0, "floor": 1e-3}
STATE_BUFFERS = ("conv_state", "recurrent_state", "kv_cache", "latent_cache")  # latent: hf
CACHES = ("kv_cache", "latent_cache")  # MLA: [slots, max_len, C + R]
MODELS = ("k3", "hf", "moonshot")


@dataclass(frozen=True)
class Bucket:
    batch: int
    tokens: int = 1

    @property
    def name(self) -> str:
        return f"B{self.batch}" if self.tokens == 1 else f"B{self.batch}xT{self.tokens}"


class LayerStack(nn.Module):
    """Decoder layers of one K3 model, called the way K3Model calls them. Layers 1-4 sit in the
    first AttnRes block, whose bank holds only the embedding. `group`: the tensor-parallel process
    group the layers all-reduce over (None: world size 1)."""

    outputs = ("prefix", "delta")

    def __init__(self, layers, group=None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.group = group

    def forward(self, prefix, delta, embedding, slots, positions):
        blocks = [embedding]
        for layer in self.layers:
            prefix, delta, blocks = layer(prefix, delta, blocks, slots, positions, self.group)
        return prefix, delta


class HFLayerStack(nn.Module):
    """Decoder layers of the second spelling (`k3compile/models/hf_k3.py`), called as its model
    calls them, on the built-in stack's inputs: the running sum is prefix + delta, the completed
    blocks the embedding alone. Returns the running sum after the last layer."""

    outputs = ("hidden",)

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.group = None  # one rank at world size 1: the spelling has no collectives

    def forward(self, prefix, delta, embedding, slots, positions):
        hidden, blocks = prefix + delta, [embedding]
        for layer in self.layers:
            hidden, blocks = layer(hidden, blocks, slots, positions)
        return (hidden,)


class MoonshotLayerStack(nn.Module):
    """Moonshot's decoder layers, adapted (`k3compile.adapt`), called as their model calls them on
    the built-in stack's inputs: the prefix sum is prefix + delta, the block residual the
    embedding alone [B*T, 1, D] (layer 0's bank), their cache the adapter's `SlotCache` over these layers' state.
    Returns the prefix sum after the last layer."""

    outputs = ("hidden",)

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.group = None  # one rank at world size 1

    def forward(self, prefix, delta, embedding, slots, positions):
        from k3compile.adapt.kimi_linear import SlotCache

        hidden = prefix + delta
        D = hidden.shape[-1]
        # the bank as their model builds it: empty, then layer 0 appends its input (the embedding)
        blocks = torch.cat([hidden.new_zeros(hidden[..., 0].numel(), 0, D),
                            embedding.view(-1, D).unsqueeze(1)], dim=1)
        cache = SlotCache({layer.layer_idx: layer.self_attn for layer in self.layers}, slots,
                          positions)
        for layer in self.layers:
            hidden, blocks = layer(hidden, past_key_values=cache, block_residual=blocks)
        return (hidden,)


class TopkRecorder(TorchFunctionMode):
    """Records the expert indices of every torch.topk (only the MoE router calls it)."""

    def __init__(self):
        super().__init__()
        self.indices: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.topk:
            self.indices.append(out.indices.detach().clone())
        return out


# ---- device helpers ----------------------------------------------------------------------------

def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """GB/s of a large device-to-device copy, bytes read + written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    times = time_calls(lambda: dst.copy_(src), device, warmup=2, iters=10, max_s=5.0)
    return 2 * nbytes / (statistics.median(times) * 1e-6) / 1e9


def time_calls(run, device: torch.device, warmup: int, iters: int, max_s: float,
               before=None) -> list[float]:
    """Microseconds per call; each call timed alone (device events on CUDA, wall clock on CPU).
    `before()`, if given, runs untimed ahead of every timed call (tensor parallel: a barrier)."""
    for _ in range(warmup):
        run()
    sync(device)
    times: list[float] = []
    t_end = time.perf_counter() + max_s
    for _ in range(iters):
        if before is not None:
            before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e6)
        if time.perf_counter() > t_end and len(times) >= 3:
            break
    return times


def count_kernels(run, device: torch.device) -> dict:
    """Kernels one call launches. On CPU there are no kernels: leaf profiler ops stand in."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        run()
        sync(device)
    events = prof.events()
    if device.type != "cuda":
        leaves = [e for e in events if e.device_type == DeviceType.CPU and not e.cpu_children]
        return {"kernels": len(leaves), "method": "cpu_leaf_ops"}
    dev = [e for e in events if e.device_type == DeviceType.CUDA]
    copies = [e for e in dev if e.name.startswith(("Memcpy", "Memset"))]
    # where one call's GPU time goes: kernels by name, busiest first (durations from the trace)
    by_name: dict[str, list] = {}
    for e in dev:
        entry = by_name.setdefault(e.name[:100], [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us()
    top = sorted(([name, n, round(us, 2)] for name, (n, us) in by_name.items()),
                 key=lambda row: -row[2])
    return {"kernels": len(dev) - len(copies), "memcpy_memset": len(copies), "method": "profiler",
            "kernel_us_sum": round(sum(row[2] for row in top), 2), "top_kernels": top[:25]}


def graph_nodes(graph) -> dict:
    """Node types of a captured CUDA graph through cuda-python, or {"error": why}."""
    try:
        from cuda.bindings import runtime as cudart

        raw = cudart.cudaGraph_t(init_value=graph.raw_cuda_graph())
        err, _, n = cudart.cudaGraphGetNodes(raw, 0)
        if err == cudart.cudaError_t.cudaSuccess:
            err, nodes, n = cudart.cudaGraphGetNodes(raw, n)
        if err != cudart.cudaError_t.cudaSuccess:
            return {"error": str(err)}
        counts: dict[str, int] = {}
        for node in nodes[:n]:
            err, kind = cudart.cudaGraphNodeGetType(node)
            key = kind.name.removeprefix("cudaGraphNodeType")
            counts[key] = counts.get(key, 0) + 1
        return counts
    except Exception as e:  # noqa: BLE001 - a cross-check only; the profiler count stands
        return {"error": f"{type(e).__name__}: {e}"[:300]}


# ---- model, state, inputs ----------------------------------------------------------------------

def build(config, device: torch.device, max_batch: int, context: int, seed: int, group=None,
          spelling: str = "k3"):
    """config: a name or a K3Config; group: the tensor-parallel process group (None: world 1);
    spelling "hf": the stack is `hf_stack` of the built model (world 1); "moonshot": the model is
    built at `rank_config` and the stack is `moonshot_stack` of it (world 1)."""
    cfg = get_config(config) if isinstance(config, str) else config
    cfg = cfg.with_layers(max(STACK_LAYERS) + 1)
    if spelling == "moonshot":
        cfg = rank_config(cfg)
    model = build_model(cfg, device=device, seed=seed, group=group, max_batch=max_batch,
                        max_seq_len=context)
    stack = LayerStack([model.language_model.model.layers[i] for i in STACK_LAYERS], group)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        # never time or check on zeros: a real cache and real recurrent states
        for name, buf in state_buffers(model).items():
            scale = 0.05 if name.endswith("recurrent_state") else 1.0
            buf.copy_(torch.randn(buf.shape, generator=gen, device=device) * scale)
    if spelling == "moonshot":
        return cfg, model, moonshot_stack(load_moonshot(model), model, max_batch, context)
    return cfg, model, hf_stack(model) if spelling == "hf" else stack


def hf_stack(model) -> HFLayerStack:
    """The stack's layers in the second spelling: the built-in model's weights shared (q|k|v and
    gate|up the only new tensors), its decode state copied."""
    hf = from_reference(model, share=True)
    ours = {"conv_state": "conv_state", "recurrent_state": "recurrent_state",
            "latent_cache": "kv_cache"}
    for mine, theirs in zip(hf.model.layers, model.language_model.model.layers, strict=True):
        for name, buf in mine.self_attn.named_buffers():
            buf.copy_(getattr(theirs.self_attn, ours[name]))
    return HFLayerStack([hf.model.layers[i] for i in STACK_LAYERS])


def rank_config(cfg):
    """One tensor-parallel rank's widths as a TP1 model (what Moonshot's code, which has no
    tensor parallelism, builds): heads, intermediates and vocabulary / tp; the latents, router
    and expert count replicated as a rank holds them."""
    tp = cfg.tp_size
    return dataclasses.replace(
        cfg, tp_size=1, name=f"{cfg.name}_rank", vocab_size=cfg.vocab_size // tp,
        intermediate_size=cfg.intermediate_size // tp, kda_num_heads=cfg.kda_num_heads // tp,
        moe_intermediate_size=cfg.moe_intermediate_size // tp,
        num_attention_heads=cfg.num_attention_heads // tp)


def moonshot_config(cfg) -> dict:
    """The release's config.json (K3_MOONSHOT_DIR) at `cfg`'s widths and layers, its
    `quantization_config` (compressed-tensors MXFP4, group 32, its ignore list) kept, the
    AttnRes and latent projections added to the ignore list; the vision
    tower cut to one block (decode never runs it; transformers initialises it, not in the
    checkpoint); the padding id the vocabulary's last, as in the release."""
    from k3compile.adapt import moonshot

    release = json.loads((moonshot.moonshot_dir() / "config.json").read_text())
    text = release["text_config"]
    layers = range(1, cfg.num_hidden_layers + 1)  # the release numbers layers from 1
    text.update(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers, intermediate_size=cfg.intermediate_size,
        rms_norm_eps=cfg.rms_norm_eps, activation_situ_beta=cfg.situ_beta,
        activation_situ_linear_beta=cfg.situ_linear_beta,
        first_k_dense_replace=cfg.first_k_dense_replace, num_experts=cfg.num_experts,
        num_experts_per_token=cfg.num_experts_per_token,
        num_shared_experts=cfg.num_shared_experts,
        moe_intermediate_size=cfg.moe_intermediate_size,
        routed_expert_hidden_size=cfg.routed_expert_hidden_size,
        routed_scaling_factor=cfg.routed_scaling_factor,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, attn_res_block_size=cfg.attn_res_block_size)
    text["linear_attn_config"].update(
        num_heads=cfg.kda_num_heads, head_dim=cfg.kda_head_dim,
        short_conv_kernel_size=cfg.short_conv_kernel_size, gate_lower_bound=cfg.gate_lower_bound,
        kda_layers=[i for i in layers if not cfg.is_mla(i - 1)],
        full_attn_layers=[i for i in layers if cfg.is_mla(i - 1)])
    # Linears the release's ignore list leaves targeted that its code cannot run packed (the
    # AttnRes projections' `.weight` is read directly; the latent projections run as plain
    # Linears): dense, as in tests/adapt/test_kimi_k3.py
    text["quantization_config"]["ignore"] += ["re:.*_res_proj$",
                                              "re:.*routed_expert_(down|up)_proj$"]
    for entry in (release, text):  # the release's (last) id, within the cut vocabulary
        entry["pad_token_id"] = cfg.vocab_size - 1
    release["vision_config"].update(vt_num_hidden_layers=1, text_hidden_size=cfg.hidden_size,
                                    _attn_implementation="eager")
    return release


def load_moonshot(model):
    """Moonshot's model of `model`'s weights, loaded as a user loads the release: a checkpoint in
    the release's layout with `moonshot_config`, `moonshot.from_pretrained` (transformers'
    compressed-tensors quantizer: the experts stay packed), on `model`'s device."""
    import importlib.util

    from k3compile.adapt import moonshot
    from k3compile.models.loader import save_checkpoint

    if importlib.util.find_spec("compressed_tensors") is None:
        raise SystemExit("--model moonshot: compressed-tensors is not installed; transformers "
                         "needs it to load the release's MXFP4 experts (pip install "
                         "compressed-tensors)")
    weight = model.language_model.lm_head.weight
    with tempfile.TemporaryDirectory(prefix="k3-moonshot-") as folder:
        # A_log per head: transformers refuses the release's padded [128] in their KDA module
        save_checkpoint(model, folder, pad_a_log=False)
        (Path(folder) / "config.json").write_text(json.dumps(moonshot_config(model.config)))
        # on a GPU with fla installed, their classes import fla's own (as the user's would)
        return moonshot.from_pretrained(folder, dtype=weight.dtype, device=weight.device)


def moonshot_stack(loaded, model, max_batch: int, context: int) -> MoonshotLayerStack:
    """Layers `STACK_LAYERS` of `k3compile.adapt(loaded)`, `model`'s decode state copied into the
    adapter's."""
    from k3compile.adapt import adapt

    step = adapt(loaded, max_batch=max_batch, max_seq_len=context)
    for mine, theirs in zip(step.lm.model.layers, model.language_model.model.layers,
                            strict=True):
        for name, buf in mine.self_attn.named_buffers():
            if name in STATE_BUFFERS:
                buf.copy_(getattr(theirs.self_attn, name))
    return MoonshotLayerStack([step.lm.model.layers[i] for i in STACK_LAYERS])


def builtin_stack(model) -> LayerStack:
    return LayerStack([model.language_model.model.layers[i] for i in STACK_LAYERS], model.group)


def state_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b for n, b in module.named_buffers() if n.rsplit(".", 1)[-1] in STATE_BUFFERS}


def snapshot(bufs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in bufs.items()}


def restore(bufs: dict[str, torch.Tensor], snap: dict[str, torch.Tensor]):
    for n, b in bufs.items():
        b.copy_(snap[n])  # in place: compiled graphs and CUDA graphs hold these addresses


def written_state(bufs: dict[str, torch.Tensor], bucket: Bucket, context: int) -> dict:
    """The state a step of this bucket writes: its slots, and the cache rows of its new tokens."""
    B, T = bucket.batch, bucket.tokens
    out = {}
    for n, b in bufs.items():
        out[n] = b[:B, context - T:context] if n.endswith(CACHES) else b[:B]
    return {n: t.clone() for n, t in out.items()}


def make_inputs(model, bucket: Bucket, context: int, gen: torch.Generator):
    """Random tokens through the embedding and layer 0 (eager): realistic (prefix, delta, bank)."""
    m = model.language_model.model
    device = m.embed_tokens.weight.device
    B, T = bucket.batch, bucket.tokens
    ids = torch.randint(0, m.embed_tokens.num_embeddings, (B, T), generator=gen, device=device)
    slots = torch.arange(B, device=device)
    positions = torch.full((B,), context - T, dtype=torch.long, device=device)  # cache full
    emb = m.embed_tokens(ids)
    prefix, delta, blocks = m.layers[0](emb, torch.zeros_like(emb), [], slots, positions,
                                        model.group)
    return [prefix, delta, blocks[0], slots, positions]


def check_weights(stack: LayerStack, seed: int) -> dict[str, torch.Tensor]:
    """Replacement weights that keep the check's comparisons away from discrete flips.

    Router: a bias that alone decides the top-k: k random experts at 10, 12, 14, ..., all others
    at -10. Sigmoid scores lie in (0, 1), so no rounding difference between variants can change
    which experts are chosen or their order; the unbiased scores still weight them.
    The AttnRes pseudo-queries (`*_res_proj`) need nothing: the seeded init draws them like every
    linear (std D^-1/2), so the depth-mix scores are O(1) and the softmax smooth.
    """
    gen = torch.Generator().manual_seed(seed + 2)
    out = {}
    for name, p in stack.named_parameters():
        if name.endswith("gate.e_score_correction_bias"):
            E, k = p.numel(), stack.get_submodule(name.rsplit(".", 1)[0]).top_k
            chosen = torch.randperm(E, generator=gen)[:k]
            bias = torch.full((E,), -10.0)
            bias[chosen] = 10.0 + 2.0 * torch.arange(k, dtype=torch.float32)
            out[name] = bias.to(p)
    return out


def load_weights(module: nn.Module, weights: dict[str, torch.Tensor]):
    for name, p in module.named_parameters():
        if name in weights:
            p.copy_(weights[name])  # in place: compiled graphs and CUDA graphs hold the address


# ---- bytes -------------------------------------------------------------------------------------

def layer_bytes(layer, bucket: Bucket, context: int, experts_routed: int) -> dict:
    """Bytes one step must move through device memory for this layer (activations left out:
    < 1% at every bucket)."""
    B, T = bucket.batch, bucket.tokens
    weights, expert_slice = 0, 0
    for name, p in layer.named_parameters():
        if name.startswith("mlp.experts."):
            expert_slice += p[0].numel() * p.element_size()
        else:
            weights += p.numel() * p.element_size()
    out = {"weights": weights, "experts": experts_routed * expert_slice, "state": 0, "kv_cache": 0}
    attn = layer.self_attn
    if layer.is_mla:
        row = attn.kv_cache.shape[-1] * attn.kv_cache.element_size()
        out["kv_cache"] = B * context * row + B * T * row  # read the whole context, write T rows
    else:
        for buf in (attn.recurrent_state, attn.conv_state):
            out["state"] += 2 * B * buf[0].numel() * buf.element_size()  # read + write
    out["total"] = sum(out.values())
    out["expert_slice"] = expert_slice
    return out


def stack_bytes(stack: LayerStack, bucket: Bucket, context: int, routing: list[torch.Tensor]):
    distinct = [int(idx.unique().numel()) for idx in routing]
    per_layer = [layer_bytes(layer, bucket, context, n) for layer, n in zip(stack.layers, distinct)]
    mean = sum(p["total"] for p in per_layer) / len(per_layer)
    return {"per_layer_mean": mean, "layers": per_layer, "distinct_experts": distinct}


# ---- correctness -------------------------------------------------------------------------------

def fp32_twin(stack: LayerStack) -> LayerStack:
    """The stack in fp32 for a reference: floating weights and state upcast, MXFP4 experts shared."""
    memo = {id(p): p for p in stack.parameters() if not p.is_floating_point()}
    memo[id(stack.group)] = stack.group  # a process group is shared, never copied
    return copy.deepcopy(stack, memo).float()


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    o, r = out.float(), ref.float()
    return {
        "max_err": float((o - r).abs().max() / r.abs().max().clamp_min(1e-30)),
        "rel_l2": float((o - r).norm() / r.norm().clamp_min(1e-30)),
        "finite": bool(torch.isfinite(o).all()),
    }


def check(got: dict, eager: dict, ref32: dict) -> dict:
    """got/eager/ref32: name -> tensor (outputs and written state) of the variant, of eager bf16
    and of the fp32 twin. Judged against fp32, with eager's own bf16 error as the yardstick."""
    parts = {}
    for name, r in ref32.items():
        err, base = compare(got[name], r), compare(eager[name], r)
        tol_rel = max(TOL["factor"] * base["rel_l2"], TOL["floor"])
        tol_max = max(TOL["factor_max"] * base["max_err"], TOL["floor"])
        parts[name] = {
            "vs_fp32": err, "eager_vs_fp32": base, "vs_eager": compare(got[name], eager[name]),
            "tol_rel_l2": tol_rel, "tol_max_err": tol_max,
            "passed": err["finite"] and err["rel_l2"] <= tol_rel and err["max_err"] <= tol_max,
        }
    worst = max(parts, key=lambda n: parts[n]["vs_fp32"]["max_err"] / parts[n]["tol_max_err"])
    return {
        "passed": all(p["passed"] for p in parts.values()),
        "max_err": parts[worst]["vs_fp32"]["max_err"],  # vs fp32, of the part nearest its bound
        "tol_max_err": parts[worst]["tol_max_err"],
        "worst": worst,
        "max_err_vs_eager": max(p["vs_eager"]["max_err"] for p in parts.values()),
        "rel_l2_vs_eager": max(p["vs_eager"]["rel_l2"] for p in parts.values()),
        "parts": parts,
    }


def step_result(outs, bufs, bucket: Bucket, context: int, names=("prefix", "delta")) -> dict:
    res = {name: t.clone() for name, t in zip(names, outs, strict=True)}
    res.update({f"state:{n}": t for n, t in written_state(bufs, bucket, context).items()})
    return res


# ---- variants ----------------------------------------------------------------------------------

def resolve_k3() -> tuple[object | None, str]:
    """(backend or None, note). The registered "k3" backend; where the package is only on
    PYTHONPATH (no entry point), the entry point's target `k3compile.backend:k3_backend`."""
    import torch._dynamo as dynamo

    try:
        if "k3" in dynamo.list_backends(exclude_tags=()):
            backend = dynamo.lookup_backend("k3")
        else:
            from k3compile.backend import k3_backend as backend
    except Exception as e:  # noqa: BLE001 - the backend is optional
        return None, f"n/a: backend 'k3' not available ({type(e).__name__}: {e})"
    return backend, "k3"


class Runner:
    """One variant at one bucket: `run()` executes a step on the static inputs, returns outputs."""

    def __init__(self, name, stack, inputs, device, backend=None, options=None, graphs=True,
                 compiled=None):
        """compiled: one `torch.compile` of the stack shared by the [B] buckets (--dynamic); the
        batch of the inputs is marked (`mark_batch`), so Dynamo traces the stack once."""
        self.name, self.device, self.inputs = name, device, inputs
        self.graph = self.out = None
        self.compile_s = 0.0
        if backend is None and compiled is None:
            self.fn = stack
            return
        if compiled is not None:
            from k3compile.backend import mark_batch

            mark_batch(*inputs)
            self.fn = compiled
        else:
            self.fn = torch.compile(stack, backend=backend, dynamic=False, options=options)
        t0 = time.perf_counter()
        self.fn(*inputs)  # compiles
        sync(device)
        self.compile_s = time.perf_counter() - t0
        if graphs and device.type == "cuda":
            self._capture()

    def _capture(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the capture stream (autotuning, workspaces)
            for _ in range(2):
                self.fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        try:
            self.graph = torch.cuda.CUDAGraph(keep_graph=True)  # keep it to count its nodes
        except TypeError:
            self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.fn(*self.inputs)
        if hasattr(self.graph, "instantiate"):
            try:
                self.graph.instantiate()
            except RuntimeError:
                pass  # already instantiated (keep_graph=False)
        sync(self.device)

    def run(self):
        if self.graph is None:
            return self.fn(*self.inputs)
        self.graph.replay()
        return self.out

    def kernels(self) -> dict:
        info = count_kernels(self.run, self.device)
        if self.graph is not None:
            nodes = info["graph_nodes"] = graph_nodes(self.graph)
            if "error" not in nodes:
                info["kernels_profiler"] = info["kernels"]
                info["kernels"] = nodes.get("Kernel", 0)
                info["method"] = "cuda_graph_nodes"
        return info


@contextlib.contextmanager
def kernel_settings(changes: dict):
    """`settings.KERNELS` with `changes` while a variant compiles and captures its graph."""
    from k3compile.settings import KERNELS

    old = {k: getattr(KERNELS, k) for k in changes}
    for k, v in changes.items():
        setattr(KERNELS, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(KERNELS, k, v)


def compiled_variants(args, device) -> dict[str, dict]:
    """name -> how to build it, or a note why it is not run."""
    out: dict[str, dict] = {}
    if "inductor" in args.variants:
        backend = "inductor" if device.type == "cuda" else args.cpu_backend
        out["inductor"] = {"backend": backend, "options": None, "graphs": True, "label": backend}
    if "k3" not in args.variants:
        out["k3"] = {"na": "n/a: not requested (--variants)"}
    else:
        backend, note = resolve_k3()
        if backend is None:
            out["k3"] = {"na": note}
        else:
            # the backend captures CUDA graphs itself unless told not to: switch that off and
            # capture it exactly as Inductor is captured
            options = {"cuda_graphs": False}
            if device.type != "cuda" and args.cpu_executor:
                options["executor"] = args.cpu_executor
            out["k3"] = {"backend": backend, "options": options, "graphs": True, "label": "k3"}
            if args.dynamic:  # one Dynamo graph for the [B] buckets
                out["k3"]["buckets"] = tuple(sorted({b.batch for b in buckets_in_order(args)
                                                     if b.tokens == 1}))
            if "k3-novalidate" in args.variants:
                out["k3-novalidate"] = {**out["k3"], "label": "k3 validate=off",
                                        "options": {**options, "validate": "off"}}
            if "k3-grouped" in args.variants:
                out["k3-grouped"] = {**out["k3"], "label": "k3 K3_MOE_GROUPED",
                                     "backend": own_backend(backend),
                                     "kernels": {"moe_grouped": True}}
            if "k3-inductorcheck" in args.variants and device.type != "cuda":
                out["k3-inductorcheck"] = {"na": "n/a: K3_CHECK_KERNEL changes only the check of "
                                                 "CUDA inputs (CPU runs the torch reference)"}
            elif "k3-inductorcheck" in args.variants:
                out["k3-inductorcheck"] = {**out["k3"], "label": "k3 K3_CHECK_KERNEL=0",
                                           "backend": own_backend(backend),
                                           "kernels": {"check_kernel": False}}
    return out


def own_backend(backend):
    """`backend` as a callable of its own, for a variant that differs from k3 only in
    `settings.KERNELS`: torch.compile's backend wrappers compare equal for an equal backend and
    options, so Dynamo would hand the variant k3's compiled step from its cache (session 22:
    k3-checkkernel, then an A/B variant, at k3's kernel counts, "compile 0.0 s")."""
    return functools.partial(backend)


def own_compile(spec: dict, entry: dict, redirects: dict) -> None:
    """Raise where a `kernels` variant, compiled here, did not compile a step of its own with its
    settings: Dynamo made no graph (a cached one answered), or `check_kernel` on and no step took
    the CuTe input check, or off and one took it (`redirects`: input_check's answers during the
    compile)."""
    if not spec.get("kernels"):
        return
    if entry["dynamo"]["graphs"] == 0:
        raise RuntimeError(f"{spec['label']}: Dynamo compiled no graph, a cached step answered "
                           "(its settings reached no compile)")
    check = spec["kernels"].get("check_kernel")
    if check and not redirects.get("kernel"):
        raise RuntimeError(f"{spec['label']}: no step took the CuTe input check (input_check: "
                           f"{dict(redirects) or 'never asked: no device-side check'})")
    if check is False and redirects.get("kernel"):
        raise RuntimeError(f"{spec['label']}: a step took the CuTe input check with "
                           f"K3_CHECK_KERNEL off (input_check: {dict(redirects)})")


def shared(spec: dict, stack, bucket: Bucket):
    """The variant's one compiled step for every [B] bucket where --dynamic made it one
    (`spec["buckets"]`), made at its first use; None otherwise (a compile per bucket)."""
    if not spec.get("buckets") or bucket.tokens != 1:
        return None
    if "compiled" not in spec:
        spec["compiled"] = torch.compile(stack, backend=spec["backend"],
                                         options={**spec["options"], "buckets": spec["buckets"]})
    return spec["compiled"]


# ---- one bucket --------------------------------------------------------------------------------

def run_bucket(args, device, model, stack, twin, bucket: Bucket, variants: dict) -> dict:
    gen = torch.Generator(device=device).manual_seed(args.seed + 1000 * bucket.batch + bucket.tokens)
    bufs = state_buffers(stack)
    res = {"name": bucket.name, "batch": bucket.batch, "tokens": bucket.tokens,
           "model": args.model, "variants": {}}

    def result(outs, buffers):
        return step_result(outs, buffers, bucket, args.context, stack.outputs)

    # correctness under `check_weights`, every variant from one state snapshot
    tamed = check_weights(stack, args.seed)
    natural = {n: p.clone() for n, p in stack.named_parameters() if n in tamed}
    load_weights(stack, tamed)
    load_weights(twin, tamed)
    inputs = make_inputs(model, bucket, args.context, gen)
    s0 = snapshot(bufs)
    restore(state_buffers(twin), s0)
    ref32 = result(twin(*[t.float() if t.is_floating_point() else t for t in inputs]),
                   state_buffers(twin))
    with TopkRecorder() as rec:
        eager = result(stack(*inputs), bufs)
    res["check_routing_distinct_experts"] = [int(i.unique().numel()) for i in rec.indices]
    restore(bufs, s0)
    runners = {"eager": Runner("eager", stack, inputs, device)}
    res["variants"]["eager"] = {"status": "ok", "check": check(eager, eager, ref32)}
    for name, spec in variants.items():
        if "na" in spec:
            res["variants"][name] = {"status": "n/a", "reason": spec["na"]}
            continue
        entry = res["variants"][name] = {"backend": spec["label"]}
        try:
            hits0, dynamo0, checks0 = _cache_counters(), _dynamo_counters(), _check_counters()
            compiled = shared(spec, stack, bucket)
            with kernel_settings(spec.get("kernels", {})):  # captured with them
                runner = Runner(name, stack, inputs, device, spec["backend"], spec["options"],
                                spec["graphs"], compiled)
            entry["compile_s"] = runner.compile_s
            entry["fx_graph_cache"] = _cache_counters(hits0)
            entry["dynamo"] = _dynamo_counters(dynamo0)
            entry["input_check"] = _check_counters(checks0)
            if compiled is None:  # a step compiled for this bucket alone
                own_compile(spec, entry, entry["input_check"])
            dyn = entry["dynamo"]
            if dyn["graphs"] > 1 or dyn["graph_breaks"] or dyn["unimplemented"]:
                log(f"  {bucket.name} {name}: Dynamo made {dyn['graphs']} graphs (frames "
                    f"{dyn['frames']}); graph breaks: {dyn['graph_breaks'] or 'none counted'}; "
                    f"not traced: {dyn['unimplemented'] or 'nothing counted'}")
            entry["cuda_graph"] = runner.graph is not None
            restore(bufs, s0)
            entry["check"] = check(result(runner.run(), bufs), eager, ref32)
            entry["status"] = "ok" if entry["check"]["passed"] else "check failed"
            runners[name] = runner
        except Exception as e:  # noqa: BLE001 - one variant failing must not end the run
            entry.update(status="error", reason=f"{type(e).__name__}: {e}"[:2000])
        finally:
            restore(bufs, s0)
        c = entry.get("check", {})
        log(f"  {bucket.name} {name}: {entry['status']}"
            + (f", compile {entry['compile_s']:.1f} s" if "compile_s" in entry else "")
            + (f", vs eager max_err {c['max_err_vs_eager']:.1e} rel_l2 {c['rel_l2_vs_eager']:.1e}"
               f"; worst vs fp32 {c['worst']} {c['max_err']:.1e} (bound {c['tol_max_err']:.1e})"
               if c else "")
            + (f" ({entry['reason'][:300]})" if "reason" in entry else ""))

    # timing and bytes with the model's own weights, on fresh inputs
    load_weights(stack, natural)
    fresh = make_inputs(model, bucket, args.context, gen)
    for static, new in zip(inputs, fresh):
        static.copy_(new)
    with TopkRecorder() as rec:
        stack(*inputs)
    restore(bufs, s0)
    # the built-in layers: the same weights and state as the second spelling's
    res["bytes"] = stack_bytes(builtin_stack(model), bucket, args.context, rec.indices)
    for name, runner in runners.items():
        entry = res["variants"][name]  # a failed check is reported, and timed all the same
        times = time_calls(runner.run, device, args.warmup, args.iters, args.max_time_s)
        entry["us_per_step"] = statistics.median(times)
        entry["us_per_layer"] = entry["us_per_step"] / len(STACK_LAYERS)
        entry["us_spread"] = [min(times), max(times), len(times)]
        k = runner.kernels()
        entry["kernels_per_layer"] = k["kernels"] / len(STACK_LAYERS)
        entry["kernel_count"] = k
    restore(bufs, s0)
    return res


def _cache_counters(before: dict | None = None) -> dict:
    from torch._dynamo.utils import counters

    now = {k: counters["inductor"].get(f"fxgraph_cache_{k}", 0) for k in ("hit", "miss", "bypass")}
    return now if before is None else {k: now[k] - before[k] for k in now}


def _check_counters(before: dict | None = None) -> dict:
    """kernels/input_check.py's redirect answers ("kernel", "refused") so far, or since `before`."""
    from k3compile.kernels import input_check

    now = dict(input_check.redirects)
    return now if before is None else {k: v - before.get(k, 0) for k, v in now.items()
                                       if v != before.get(k, 0)}


def _dynamo_counters(before: dict | None = None) -> dict:
    """Dynamo's graphs and frames so far, its graph-break reasons and what it could not trace
    (reason -> count), or their change since `before`: a step that should be one graph and is
    several says why here (a frame Dynamo gave up on counts in `unimplemented`, not as a break)."""
    from torch._dynamo.utils import counters

    now = {"graphs": counters["stats"]["unique_graphs"],
           "frames": dict(counters["frames"]),
           "graph_breaks": dict(counters["graph_break"]),
           "unimplemented": dict(counters["unimplemented"])}
    if before is None:
        return now
    change = {"graphs": now["graphs"] - before["graphs"]}
    for part in ("frames", "graph_breaks", "unimplemented"):
        change[part] = {str(k)[:300]: v - before[part].get(k, 0) for k, v in now[part].items()
                        if v != before[part].get(k, 0)}
    return change


def _ratio(a, b):
    return a / b if a and b else None


def derive(res: dict, copy_gbps: float):
    """Achieved bandwidth, floor and ratios of one bucket."""
    nbytes = res["bytes"]["per_layer_mean"]
    res["floor_us_per_layer"] = nbytes / (copy_gbps * 1e3)
    for entry in res["variants"].values():
        if "us_per_layer" in entry:
            entry["gbps"] = nbytes / (entry["us_per_layer"] * 1e3)
            entry["over_floor"] = entry["us_per_layer"] / res["floor_us_per_layer"]
    t = {n: e.get("us_per_layer") for n, e in res["variants"].items()}
    res["ratios"] = {
        "k3_over_inductor": _ratio(t.get("k3"), t.get("inductor")),
        "k3_over_floor": _ratio(t.get("k3"), res["floor_us_per_layer"]),
        "inductor_over_floor": _ratio(t.get("inductor"), res["floor_us_per_layer"]),
    }


# ---- output ------------------------------------------------------------------------------------

def _fmt(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "n/a"


def table(results: dict) -> str:
    names = [v for v in VARIANTS if any(v in b["variants"] for b in results["buckets"])]
    head = f"{'bucket':<8}" + "".join(f"{n + ' us':>12}{'kern':>7}" for n in names)
    head += f"{'floor us':>10}{'MB/layer':>10}{'ind GB/s':>10}{'ind/floor':>10}{'k3/ind':>8}"
    lines = [head, "-" * len(head)]
    for b in sorted(results["buckets"], key=lambda b: (b["tokens"], b["batch"])):
        row = f"{b['name']:<8}"
        for n in names:
            e = b["variants"].get(n, {})
            row += f"{_fmt(e.get('us_per_layer'), '12.1f'):>12}"
            row += f"{_fmt(e.get('kernels_per_layer'), '7.1f'):>7}"
        ind = b["variants"].get("inductor", {})
        row += f"{_fmt(b.get('floor_us_per_layer'), '10.1f'):>10}"
        row += f"{_fmt(b['bytes']['per_layer_mean'] / 1e6, '10.1f'):>10}"
        row += f"{_fmt(ind.get('gbps'), '10.0f'):>10}"
        row += f"{_fmt(b['ratios']['inductor_over_floor'], '10.2f'):>10}"
        row += f"{_fmt(b['ratios']['k3_over_inductor'], '8.2f'):>8}"
        lines.append(row)
    return "\n".join(lines)


def plot(results: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    buckets = sorted(results["buckets"], key=lambda b: (b["tokens"], b["batch"]))
    x = list(range(len(buckets)))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for n in VARIANTS:
        y = [b["variants"].get(n, {}).get("us_per_layer", math.nan) for b in buckets]
        if not all(math.isnan(v) for v in y):
            ax.plot(x, y, marker="o", label=n if n == "eager" else f"{n} + CUDA graph")
    ax.plot(x, [b["floor_us_per_layer"] for b in buckets], "k--", label="floor (bytes / copy BW)")
    ax.set_xticks(x, [b["name"] for b in buckets])
    ax.set_yscale("log")
    ax.set_ylabel("µs per layer")
    meta = results["meta"]
    ax.set_title(f"K3 layers 1-4 ({meta['config']}, model {meta.get('model', 'k3')}, "
                 f"ctx {meta['context']}) on {meta['device_name']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def json_name(model: str) -> str:
    return "decode_layer.json" if model == "k3" else f"decode_layer_{model}.json"


def write(results: dict, out: Path):
    name = json_name(results["meta"].get("model", "k3"))
    (out / name).write_text(json.dumps(results, indent=1, default=str))


# ---- main --------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="k3_tp16")
    p.add_argument("--model", choices=MODELS, default="k3",
                   help="hf: the second spelling (k3compile/models/hf_k3.py) of the same layers; "
                        "moonshot: Moonshot's released code (K3_MOONSHOT_DIR), adapted")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--context", type=int, help="MLA context (default 4096; smoke 64)")
    p.add_argument("--batches", help="comma list or none (default 1,2,4,8,16,32,64; smoke 2)")
    p.add_argument("--verify", type=int, help="T of the B=1 verify bucket (default 8; smoke 2; 0: none)")
    p.add_argument("--max-batch", type=int,
                   help="state slots (default: the largest bucket); the graphs, and so Inductor's "
                        "cache keys, depend on it")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--cpu-backend", default="aot_eager",
                   help="the 'inductor' variant's backend on CPU (Inductor's C++ build takes about "
                        "a minute per bucket on 2 cores)")
    p.add_argument("--cpu-executor", default="aten",
                   help="the 'k3' variant's executor on CPU (aten: the rewritten graph op by op; "
                        "'' leaves K3_EXECUTOR's; Inductor's C++ build takes ~30 s per graph "
                        "on 2 cores)")
    p.add_argument("--iters", type=int, help="timed calls (default 50; smoke 3)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-time-s", type=float, default=3.0, help="stop timing a variant after")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds; start no new bucket after (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="few buckets, small context, 3 iterations")
    p.add_argument("--dynamic", action="store_true",
                   help="k3: one torch.compile for the [B] buckets, the batch marked "
                        "(mark_batch): Dynamo traces the stack once, the backend compiles each "
                        "bucket from that graph (BxT buckets: their own)")
    p.add_argument("--compile-only", action="store_true",
                   help="only compile the buckets (fills the on-disk caches)")
    p.add_argument("--out", default="out")
    a = p.parse_args(argv)
    a.context = a.context or (64 if a.smoke else 4096)
    batches = a.batches or ("2" if a.smoke else "1,2,4,8,16,32,64")
    a.batches = [] if batches == "none" else [int(b) for b in batches.split(",")]
    a.iters = a.iters or (3 if a.smoke else 50)
    if a.verify is None:
        a.verify = 2 if a.smoke else 8
    if a.smoke:
        a.warmup, a.max_time_s = 1, 1.0
    a.variants = [v for v in a.variants.split(",") if v]
    return a


def buckets_in_order(args) -> list[Bucket]:
    """Most telling first, so a time budget drops the least: B=1, verify, B=64, B=8, the rest."""
    buckets = [Bucket(b) for b in args.batches]
    if args.verify:
        buckets.append(Bucket(1, args.verify))
    rank = {(1, 1): 0, (1, args.verify): 1, (64, 1): 2, (8, 1): 3}
    return sorted(buckets, key=lambda b: (rank.get((b.batch, b.tokens), 4), b.batch))


def configure_dynamo(args):
    import torch._dynamo.config as dcfg

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(dcfg, name):  # one graph per bucket and backend, all kept
            setattr(dcfg, name, max(getattr(dcfg, name), 256))
    if args.compile_only:
        import torch._inductor.config as icfg

        # kernels autotuned while other compile jobs share the GPU would be cached mistuned
        icfg.autotune_local_cache = False


def log(msg: str):
    print(msg, flush=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configure_dynamo(args)
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    buckets = buckets_in_order(args)
    if not buckets:
        raise SystemExit("no buckets: give --batches or --verify")
    max_batch = max(args.max_batch or 0, *(b.batch for b in buckets))

    meta = {
        "date": time.strftime("%Y-%m-%d"), "config": args.config, "model": args.model,
        "context": args.context,
        "layers": list(STACK_LAYERS), "dtype": "bfloat16", "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "max_batch": max_batch,
        "argv": sys.argv if argv is None else ["benchmarks/decode_layer.py", *argv],
        "smoke": args.smoke, "tol": TOL,
        "check_weights": "router bias alone decides top-k (see check_weights); timing and "
                         "bytes: the model's own weights, fresh inputs",
    }
    copy_bytes = (4 << 30) if device.type == "cuda" else (256 << 20)
    if not args.compile_only:
        meta["copy_gbps"] = copy_bandwidth(device, copy_bytes)
        meta["copy_bytes"] = copy_bytes
        log(f"copy bandwidth {meta['copy_gbps']:.0f} GB/s ({copy_bytes >> 20} MiB, read + write)")

    t0 = time.perf_counter()
    with torch.no_grad():
        cfg, model, stack = build(args.config, device, max_batch, args.context, args.seed,
                                  spelling=args.model)
        sync(device)
    meta["build_s"] = time.perf_counter() - t0
    meta["stack_weight_bytes"] = sum(p.numel() * p.element_size() for p in stack.parameters())
    twin = None if args.compile_only else fp32_twin(stack)
    log(f"built {args.config} ({cfg.num_hidden_layers} layers, model {args.model}) on {device} in "
        f"{meta['build_s']:.1f} s;"
        f" layers {STACK_LAYERS} hold {meta['stack_weight_bytes'] / 1e9:.2f} GB")
    variants = compiled_variants(args, device)
    meta["variants"] = {n: v.get("na", v.get("label")) for n, v in variants.items()}
    results = {"meta": meta, "buckets": [], "skipped": []}

    for bucket in buckets:
        elapsed = time.perf_counter() - t_start
        if args.time_budget and elapsed > args.time_budget:
            results["skipped"].append(bucket.name)
            log(f"{bucket.name}: skipped, {elapsed:.0f} s used of a {args.time_budget:.0f} s budget")
            continue
        t0 = time.perf_counter()
        with torch.no_grad():
            if args.compile_only:
                compile_bucket(args, device, model, stack, bucket, variants)
                continue
            res = run_bucket(args, device, model, stack, twin, bucket, variants)
        derive(res, meta["copy_gbps"])
        res["wall_s"] = time.perf_counter() - t0
        results["buckets"].append(res)
        write(results, out)
        log(f"{bucket.name}: done in {res['wall_s']:.1f} s")
        if device.type == "cuda":
            torch.cuda.empty_cache()

    meta["total_s"] = time.perf_counter() - t_start
    if args.compile_only:
        return results
    write(results, out)
    log("\n" + table(results))
    log(plot(results, out / json_name(args.model).replace(".json", ".png")))
    log(f"json: {out / json_name(args.model)}")
    return results


def compile_bucket(args, device, model, stack, bucket, variants):
    gen = torch.Generator(device=device).manual_seed(args.seed)
    inputs = make_inputs(model, bucket, args.context, gen)
    for name, spec in variants.items():
        if "na" in spec:
            continue
        t0 = time.perf_counter()
        try:
            with kernel_settings(spec.get("kernels", {})):
                Runner(name, stack, inputs, device, spec["backend"], spec["options"], graphs=False,
                       compiled=shared(spec, stack, bucket))
            log(f"  compile-only {bucket.name} {name}: {time.perf_counter() - t0:.1f} s")
        except Exception as e:  # noqa: BLE001
            log(f"  compile-only {bucket.name} {name}: {type(e).__name__}: {e}"[:500])


if __name__ == "__main__":
    main()
