"""Serving an agent workload: time to first token, throughput and memory, with and without prefix caching.

What it measures. Concurrent agents (`kda_edu.models.serving.workload.agent_sessions`: each turn appends a
tool output to a growing history and asks for a short reply; a turn's prompt is the whole history) replayed
through `kda_edu.models.serving.Engine` for three models of one width and depth: the 3:1 hybrid ("hybrid",
layers KKKA repeated), all-MLA ("mla") and all-KDA ("kda"), each with prefix caching on and off. The agents
run concurrently and each waits for its reply: an agent's next turn is added to the engine right after the
step that finished its previous one, and the first turns of all agents are added at the start.

Per turn: the time to first token (TTFT), wall time from `add_request` to the end of the step that produced
the request's first token (on a GPU after `torch.cuda.synchronize`), the prompt's length and the prompt tokens
the prefix cache supplied. Per run: TTFT p50 and p90 over all turns, generated tokens per second (all replies'
tokens over the run's wall time), peak GPU memory (`torch.cuda.max_memory_allocated`, reset after the
engine is made: the weights, the preallocated pools, whose size `--pool-factor` sets, and everything the run
allocates, KDA snapshots included; None on a CPU), the memory the caches needed (the most blocks held at
once times `block_bytes`, the most KDA snapshots kept times `snapshot_bytes`), the prefix-cache hit rate
(hit / looked-up prompt tokens, `Engine.summary`), the engine's counters, and the wall time. Before each model's two timed runs, a short untimed replay (two agents, two
turns) compiles the kernels.

Sizes. `--size tiny` (the default): a model of width 32 on the CPU, sessions at `scale = 1/256` of an
agent's numbers (history 32 -> 512 tokens, tool outputs 4-32, replies 1-2; 4 agents of 8 turns), for a
smoke run of about ten seconds. `--size gpu`: models of Kimi Linear's mixer widths (d_model 2304, KDA 32 heads of 128, MLA 32 heads with a
512-wide latent and a 64-wide rope slot; 4 layers, vocabulary 32000, a small dense feed-forward layer), bf16,
the engine's Triton kernels, 16 agents at `scale = 0.25` (history 2K -> 32K tokens, tool outputs 256-2K,
replies 32-128); `--scale 1` is the agent of the full numbers (8K -> 128K, 1K-8K, 128-512), whose runs
without prefix caching recompute every history (about 27M prompt tokens per run). `--time-limit-s` stops
starting new turns in a run after that many seconds (the turns under way finish); such a run records
`cut_short: true` and the turns it did. The file is written after every run; with `--merge`, the runs already
in it for the same workload and settings are kept, so that several calls (`--models`, `--prefix-cache`) can
make the six runs. At `--size gpu` a run takes some thousands of engine steps (without prefix caching about
7M prompt tokens in chunks of `--token-budget`, and one step per reply token of the slowest agent's turns),
each a Python loop over the step's pieces and the layers: one model per call keeps each call short.

    python -m bench.serving.agent_trace --out DIR                     # tiny, CPU: DIR/agent_trace_cpu.json
    python -m bench.serving.agent_trace --size gpu --out DIR          # GPU: DIR/agent_trace_<gpu>.json
"""

import argparse
import gc
import json
import math
import os
from pathlib import Path

import torch

from bench.common import run_environment, write_result
from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLAConfig
from kda_edu.models.model import HYBRID, PURE_ATTENTION, PURE_KDA, HybridConfig, HybridLM
from kda_edu.models.serving import Engine
from kda_edu.models.serving.workload import AgentSession, agent_sessions, replay

PATTERNS = {"hybrid": HYBRID, "mla": PURE_ATTENTION, "kda": PURE_KDA}
SIZES = {
    "tiny": dict(
        agents=4, scale=1 / 256, max_turns=8, layers=4, block_size=4, token_budget=64, dtype="float32"
    ),
    "gpu": dict(
        agents=16, scale=0.25, max_turns=None, layers=4, block_size=64, token_budget=4096, dtype="bfloat16"
    ),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def model_config(model: str, size: str, layers: int) -> HybridConfig:
    """The model `model` ("hybrid", "mla", "kda") at `size`: the same width, depth and vocabulary for all."""
    if size == "tiny":
        return HybridConfig(
            vocab_size=64,
            d_model=32,
            n_layers=layers,
            layer_pattern=PATTERNS[model],
            kda=KDAConfig(num_heads=2, head_dim=16, gate="lower_bound", chunk_size=16),
            mla=MLAConfig(num_heads=2, kv_rank=16, qk_head_dim=16, v_head_dim=16, rope_head_dim=8),
            init_std=0.3,
        )
    return HybridConfig(
        vocab_size=32000,
        d_model=2304,
        n_layers=layers,
        layer_pattern=PATTERNS[model],
        kda=KDAConfig(num_heads=32, head_dim=128, gate="lower_bound"),
        mla=MLAConfig(num_heads=32, kv_rank=512, qk_head_dim=128, v_head_dim=128, rope_head_dim=64),
    )


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, linear between the closest ranks."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def pool_blocks(sessions: list[AgentSession], block_size: int, pool_factor: float) -> int:
    """Blocks for every agent's longest request at once (and one copy-on-write each), times `pool_factor`."""
    longest = max(s.history_tokens for s in sessions)
    return math.ceil(len(sessions) * (-(-longest // block_size) + 1) * pool_factor)


def run_one(model: HybridLM, sessions, args, device, prefix_cache: bool) -> dict:
    """One timed replay; the run's metrics."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    engine = Engine(
        model,
        block_size=args.block_size,
        num_blocks=pool_blocks(sessions, args.block_size, args.pool_factor),
        token_budget=args.token_budget,
        max_running=len(sessions),
        prefix_cache=prefix_cache,
        kernels=device.type == "cuda",
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the peak counts the model and the engine's pools
    result = replay(engine, sessions, device, args.time_limit_s)
    ttft = [t["ttft_s"] for t in result["turns"]]
    summary = engine.summary()
    return dict(
        prefix_cache=prefix_cache,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p90_s=percentile(ttft, 90),
        generated_tokens=result["generated_tokens"],
        generated_tokens_per_s=result["generated_tokens"] / result["wall_s"],
        peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        hit_rate=summary["hit_rate"],
        wall_s=result["wall_s"],
        turns_done=len(result["turns"]),
        cut_short=result["cut_short"],
        num_blocks=engine.blocks.num_blocks,
        peak_blocks_in_use=result["peak_blocks_in_use"],
        peak_snapshots=result["peak_snapshots"],
        block_bytes=sum(p[0].numel() * p.element_size() for p in engine.mla.pools.values()),
        snapshot_bytes=sum(
            engine.kda.state[i][0].numel() * engine.kda.state[i].element_size()
            + engine.kda.window[i][0].numel() * engine.kda.window[i].element_size()
            for i in engine.kda.layers
        ),
        engine=summary,
        turns=result["turns"],
    )


def prompt_lengths(session: AgentSession) -> int:
    """The prompt tokens of all the session's turns together (what a run without prefix caching computes)."""
    total, history = 0, len(session.system_prompt)
    for turn in session.turns:
        total += history + len(turn.tool_output)
        history += len(turn.tool_output) + turn.max_new_tokens
    return total


def merged_runs(path: Path, result: dict, models: list[str], caches: tuple[bool, ...]) -> list[dict]:
    """The runs of the file at `path` (if any) that this call does not redo; the file must describe the same
    workload, size, dtype, model dimensions and engine settings."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    for key in ("size", "dtype", "workload", "model", "engine"):
        if old.get(key) != result[key]:
            raise ValueError(f"--merge: {path} has {key} = {old.get(key)!r}, this call {result[key]!r}")
    return [r for r in old["runs"] if not (r["model"] in models and r["prefix_cache"] in caches)]


def gpu_name(device: torch.device) -> str:
    """A short name for file names: "h100" for "NVIDIA H100 80GB HBM3", "cpu" on a CPU."""
    if device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device).replace("NVIDIA", "").split()[0].lower()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="output directory (default $OUT, else .)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model widths and defaults")
    parser.add_argument("--models", nargs="+", choices=list(PATTERNS), default=list(PATTERNS))
    parser.add_argument(
        "--prefix-cache", choices=["both", "on", "off"], default="both", help="runs with prefix caching"
    )
    parser.add_argument("--agents", type=int, default=None)
    parser.add_argument("--scale", type=float, default=None, help="multiplies every length of the workload")
    parser.add_argument("--max-turns", type=int, default=None, help="turns per agent at most (0: no limit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--token-budget", type=int, default=None)
    parser.add_argument(
        "--pool-factor", type=float, default=1.25, help="pool blocks over all agents' longest"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--time-limit-s", type=float, default=None, help="per run: no new turns after it")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the runs of an existing output file of the same workload that this call does not redo",
    )
    args = parser.parse_args(argv)
    for name, value in SIZES[args.size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.max_turns = args.max_turns or None
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    out = args.out or Path(os.environ.get("OUT", "."))

    probe = model_config("hybrid", args.size, args.layers)
    sessions = agent_sessions(
        args.agents, vocab_size=probe.vocab_size, scale=args.scale, seed=args.seed, max_turns=args.max_turns
    )
    warmup = agent_sessions(2, vocab_size=probe.vocab_size, scale=args.scale, seed=args.seed + 1, max_turns=2)
    tools = [len(t.tool_output) for s in sessions for t in s.turns]
    news = [t.max_new_tokens for s in sessions for t in s.turns]
    caches = {"both": (True, False), "on": (True,), "off": (False,)}[args.prefix_cache]
    result = dict(
        environment=run_environment(),
        size=args.size,
        dtype=args.dtype,
        workload=dict(
            agents=args.agents,
            scale=args.scale,
            seed=args.seed,
            max_turns=args.max_turns,
            turns=sum(len(s.turns) for s in sessions),
            system_tokens=len(sessions[0].system_prompt),
            tool_tokens=[min(tools), max(tools)],
            new_tokens=[min(news), max(news)],
            longest_history=max(s.history_tokens for s in sessions),
            prompt_tokens=sum(prompt_lengths(s) for s in sessions),
        ),
        model=dict(d_model=probe.d_model, n_layers=probe.n_layers, vocab_size=probe.vocab_size),
        engine=dict(block_size=args.block_size, token_budget=args.token_budget, pool_factor=args.pool_factor),
        runs=[],
    )
    path = out / f"agent_trace_{gpu_name(device)}.json"
    kept = merged_runs(path, result, args.models, caches) if args.merge else []
    for name in args.models:
        config = model_config(name, args.size, args.layers)
        torch.manual_seed(0)
        model = HybridLM(config).to(device=device, dtype=dtype).eval()
        params = sum(p.numel() for p in model.parameters())
        for prefix_cache in caches:  # untimed: kernels compile here
            run_one(model, warmup, args, device, prefix_cache)
        for prefix_cache in caches:
            run = run_one(model, sessions, args, device, prefix_cache)
            run = dict(model=name, layer_pattern=config.layer_pattern, parameters=params, **run)
            result["runs"].append(run)
            write_result(path, {**result, "runs": kept + result["runs"]})  # a later run may not finish
            print(
                f"{name:6s} prefix_cache={prefix_cache!s:5s} ttft p50 {run['ttft_p50_s'] * 1e3:9.2f} ms "
                f"p90 {run['ttft_p90_s'] * 1e3:9.2f} ms  {run['generated_tokens_per_s']:9.1f} tok/s  "
                f"hit rate {run['hit_rate']:.3f}  wall {run['wall_s']:.1f} s",
                flush=True,
            )
        del model
        gc.collect()
    result["runs"] = kept + result["runs"]
    write_result(path, result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
