"""Sweeps of recall-task training runs: every token mixer on every task, at several lengths, seeds and rates.

    python -m kda_edu.training.sweep --preset cpu --out FILE.json --workers 2
    python -m kda_edu.training.sweep --preset gpu --out FILE.json --workers 16

A preset (`PRESETS`) fixes the model (the same `RecallLM` for every mixer, at equal state size), the training
recipe, the tasks and their lengths, the mixers, the seeds and the learning rates. Every combination is one
run of `kda_edu.training.train.train`. Each finished run is appended to the JSON file at once (with its full task,
model and training configuration, its accuracy curve, its wall time and the invocation that trained it), and a
CSV with one row per run is written beside it; running the same command again skips the runs already in the file, so a sweep can be
split over several invocations (`--max-minutes`). Each invocation also records its wall time and GPU count
under "invocations", from which `--cost` reports the GPU-minutes the file's runs took.

The runs are trained by `RunPool`: worker processes that each train one run after another, so a worker pays
its start-up (importing PyTorch and Triton, creating a CUDA context, loading the compiled kernels) once rather
than once per run. A run's numbers do not depend on the worker or on what ran before it there: every run builds
its model, optimiser and data from its own seed, and nothing else it reads is process-wide state that a run
changes. A worker whose run raised is retired (its CUDA context may be broken) and a fresh one takes its place.

With `--batched M` a worker trains up to M runs of one cell (same task, length and mixer; other seeds and
learning rates) as one batched run (`run_batched`, `kda_edu.training.batched.train_batched`): the M models
stacked and trained by one vmapped step, which costs about as many kernel launches as one run. Each run keeps
its own record; `seconds` is then the group's wall time divided by M.

`summarize` reduces the runs as the Kimi Linear report does: for every task, length and mixer it takes the
learning rate with the best mean final accuracy over the seeds, and reports that rate's mean, min and max.
Chapter 12 reads the results (`kda_edu.chapters.ch12_recall_sweep`: the tables and figures).
"""

import argparse
import csv
import gc
import json
import os
import platform
import statistics
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from multiprocessing.connection import wait
from pathlib import Path

import torch

from kda_edu.layers.mixers import DELTA_RULE_KINDS, KINDS, LABELS, MixerConfig, TokenMixer
from kda_edu.models.recall import RecallConfig
from kda_edu.training.batched import check_batchable, train_batched
from kda_edu.training.tasks import make_task, task_to_dict
from kda_edu.training.train import EVAL_BATCH, GATE_PARAMETERS, TrainConfig, TrainResult, train

# Task parameters besides the length; MQAR's number of pairs grows with the length (`pairs_per_token`).
PRESETS = {
    # The committed CPU sweep: short lengths, small model.
    "cpu": {
        "model": {"d_model": 64, "n_layers": 2, "ffn_hidden": 128},
        "mixer": {"num_heads": 2, "head_dim": 16, "chunk_size": 32},
        "train": {"steps": 150, "batch_size": 64, "warmup": 15, "eval_every": 25, "eval_size": 128},
        "tasks": {
            "mqar": {"lengths": [32, 64], "pairs_per_token": 1 / 8, "num_keys": 16, "num_values": 16},
            "palindrome": {"lengths": [16, 32], "num_symbols": 16},
            "stack": {"lengths": [32, 64], "num_stacks": 4, "num_values": 16},
        },
        "mixers": [*KINDS, "decay_only"],
        "seeds": [0, 1, 2],
        "lrs": [2e-3, 5e-3],
    },
    # The GPU sweep: the report's model shape (2 layers, 2 heads; head dim 64 here), lengths up to 1024.
    # 216 runs (3 tasks x 3 lengths x 6 mixers x 2 rates x 2 seeds), in parts of `--max-minutes`. The
    # delta-rule mixers run through the Triton kernel: their chunked PyTorch forms launch thousands of small
    # kernels per step, which is what a GPU does worst.
    "gpu": {
        "model": {"d_model": 128, "n_layers": 2, "ffn_hidden": 256},
        "mixer": {
            "num_heads": 2,
            "head_dim": 64,
            "chunk_size": 64,
            "backend": "triton",
            "kernel_dtype": "bfloat16",
        },
        "train": {
            "steps": 1500,
            "batch_size": 64,
            "warmup": 100,
            "eval_every": 100,
            "eval_size": 512,
            "cuda_graph": True,
        },
        "tasks": {
            "mqar": {
                "lengths": [256, 512, 1024],
                "pairs_per_token": 1 / 8,
                "num_keys": 256,
                "num_values": 256,
            },
            "palindrome": {"lengths": [64, 128, 256], "num_symbols": 16},
            "stack": {"lengths": [256, 512, 1024], "num_stacks": 16, "num_values": 16},
        },
        "mixers": [*KINDS, "decay_only"],
        "seeds": [0, 1],
        "lrs": [1e-3, 3e-3],
    },
}


# The notebook's live run (under a minute on a CPU): two runs of the CPU sweep (MQAR at T = 32, linear attention
# and DeltaNet, the first seed and rate), so the chapter can compare what it trains with what was committed.
PRESETS["quick"] = {
    **PRESETS["cpu"],
    "tasks": {"mqar": {**PRESETS["cpu"]["tasks"]["mqar"], "lengths": [32]}},
    "mixers": ["linear_attention", "deltanet"],
    "seeds": [0],
    "lrs": [2e-3],
}


def task_for(name: str, seq_len: int, params: dict):
    """The task `name` at length `seq_len` with a preset's parameters (MQAR: `pairs_per_token * seq_len`
    pairs)."""
    params = {k: v for k, v in params.items() if k != "lengths"}
    if name == "mqar":
        params["num_pairs"] = max(1, round(params.pop("pairs_per_token") * seq_len))
    return make_task(name, seq_len=seq_len, **params)


def run_specs(preset: dict) -> list[dict]:
    """Every run of a preset: task, length, mixer, learning rate and seed, in a fixed order, seeds outermost
    (a sweep cut short has every cell at the first seeds rather than some cells at every seed)."""
    specs = []
    for seed in preset["seeds"]:
        for name, params in preset["tasks"].items():
            for seq_len in params["lengths"]:
                for lr in preset["lrs"]:
                    for mixer in preset["mixers"]:
                        specs.append(
                            {"task": name, "seq_len": seq_len, "mixer": mixer, "lr": lr, "seed": seed}
                        )
    return specs


def run_key(spec: dict) -> tuple:
    return (spec["task"], spec["seq_len"], spec["mixer"], spec["lr"], spec["seed"])


def needs_rerun(run: dict) -> bool:
    """A run recorded before the weight-decay fix (no `undecayed_gate_parameters`): it counts as pending, and
    its re-run replaces it (the old record moves to the file's "superseded" list).

    For KDA the old rule decayed its `[H, K]` dt_bias. The other mixers' gate parameters are vectors, which
    neither rule decayed, but their old runs came from earlier builds of the GPU path (one of them with an
    out-of-bounds read in the one-chunk variant, a kernel bug since fixed), and two of them do not reproduce
    on later builds: Gated DeltaNet's collapse on Palindrome 128 and DeltaNet's NaN on MQAR 1024. So the whole grid is re-run on one build."""
    return "undecayed_gate_parameters" not in run


def extends_preset(old: dict, new: dict) -> bool:
    """Whether preset configuration `new` is `old` with more seeds and/or more mixers (a sweep may go on)."""
    rest = {k: v for k, v in old.items() if k not in ("seeds", "mixers")}
    return (
        rest == {k: v for k, v in new.items() if k not in ("seeds", "mixers")}
        and set(old["seeds"]) <= set(new["seeds"])
        and set(old["mixers"]) <= set(new["mixers"])
    )


def run_setup(
    preset: dict, spec: dict, *, mixer: dict | None = None, train: dict | None = None
) -> tuple[object, RecallConfig, TrainConfig]:
    """The task, model configuration and training configuration of one run of a preset (`spec`: task,
    seq_len, mixer, lr, seed), as the sweep trains it; `mixer` and `train` override entries of the preset's
    mixer and training settings (the experiments in bench/experiments change one setting at a time)."""
    task = task_for(spec["task"], spec["seq_len"], preset["tasks"][spec["task"]])
    mixer_config = MixerConfig(kind=spec["mixer"], **{**preset["mixer"], **(mixer or {})})
    model_config = RecallConfig(vocab_size=task.vocab_size, mixer=mixer_config, **preset["model"])
    train_config = TrainConfig(lr=spec["lr"], seed=spec["seed"], **{**preset["train"], **(train or {})})
    return task, model_config, train_config


def add_spec_arguments(parser: argparse.ArgumentParser, mixer: str | None = None) -> None:
    """Add the options that name one run (`--task`, `--seq-len`, `--mixer`, `--lr`, `--seed`) to `parser`, for
    the scripts in bench/experiments that train a run of the sweep again; `mixer` is a default (else required).
    `spec_from_arguments` reads them back as a spec."""
    parser.add_argument("--task", required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--mixer", required=mixer is None, default=mixer)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)


def spec_from_arguments(args: argparse.Namespace) -> dict:
    """The spec (task, seq_len, mixer, lr, seed) of the options `add_spec_arguments` added."""
    return {"task": args.task, "seq_len": args.seq_len, "mixer": args.mixer, "lr": args.lr, "seed": args.seed}


def run_one(preset: dict, spec: dict, device: str = "cpu") -> dict:
    """Train one run of a preset and return its record (configs, accuracy curve, wall time)."""
    task, model_config, train_config = run_setup(preset, spec)
    result = train(task, model_config, train_config, device=device, progress=False)
    return _record(spec, task, model_config, train_config, result, device)


def batch_key(spec: dict) -> tuple:
    """What runs trained together by `run_batched` share: task, length and mixer (they differ in seed and rate)."""
    return (spec["task"], spec["seq_len"], spec["mixer"])


def run_batched(preset: dict, specs: list[dict], device: str = "cpu") -> list[dict]:
    """Train the runs `specs` of a preset together (`kda_edu.training.batched.train_batched`) and return a
    record per run, as `run_one` writes it, with `batched` (how many runs were trained together; `seconds` is
    the group's wall time divided by that).

    Raises:
        ValueError: `specs` is empty or differs in task, length or mixer, or `train_batched` refuses them.
    """
    if not specs or any(batch_key(sp) != batch_key(specs[0]) for sp in specs):
        raise ValueError(
            f"run_batched needs one or more specs of one task, length and mixer, got {[batch_key(sp) for sp in specs]}"
        )
    setups = [run_setup(preset, spec) for spec in specs]
    task, model_config = setups[0][:2]
    results = train_batched(task, model_config, [c for _, _, c in setups], device=device)
    return [
        {**_record(spec, task, model_config, config, result, device), "batched": len(specs)}
        for spec, (_, _, config), result in zip(specs, setups, results, strict=True)
    ]


def _record(
    spec, task, model_config: RecallConfig, train_config: TrainConfig, result: TrainResult, device
) -> dict:
    return {
        **spec,
        "final_acc": result.final_accuracy,
        "best_acc": max(h["eval_acc"] for h in result.history),
        "final_loss": result.history[-1]["eval_loss"],
        "seconds": round(result.seconds, 2),
        "num_parameters": result.model.num_parameters(),
        "state_size": model_config.mixer.state_size,
        "device": str(device),
        "task_config": task_to_dict(task),
        "model_config": model_config.to_dict(),
        "train_config": asdict(train_config),
        # Left out of AdamW's weight decay whatever their shape (runs without this field decayed KDA's
        # [H, K] dt_bias: the GPU sweep's first 78 runs; `needs_rerun` counts them as pending).
        "undecayed_gate_parameters": list(GATE_PARAMETERS),
        "history": result.history,
    }


@dataclass
class RunOutcome:
    """What `RunPool.next_results` hands back for one run.

    Attributes:
        spec: the run's spec, as submitted.
        device: where it ran.
        record: `run_one`'s record, or None when the run failed.
        error: the traceback (or how the worker died) when it failed, else None.
        pid: the worker process that ran it.
        run_index: how many runs that worker had finished before this one's group started (0: its first).
        wall: seconds from submission to result, the worker's start-up included when it started for this run.
    """

    spec: dict
    device: str
    record: dict | None
    error: str | None
    pid: int
    run_index: int
    wall: float


def _run_batched_caught(preset: dict, specs: list[dict], device: str) -> list[tuple[dict | None, str | None]]:
    """`run_batched`'s records, each as `(record, None)`, or the traceback for every spec when it raised."""
    try:
        return [(record, None) for record in run_batched(preset, specs, device)]
    except Exception as error:  # noqa: BLE001 - reported to the sweep, which records it
        return [(None, "".join(traceback.format_exception(error)))] * len(specs)


def _run_caught(preset: dict, spec: dict, device: str) -> tuple[dict | None, str | None]:
    """`(run_one's record, None)`, or `(None, traceback)`; on CUDA the run's work goes to a stream of its own,
    so the runs of a group (one thread each) can share the GPU at once."""
    own_stream = (
        torch.cuda.stream(torch.cuda.Stream(device)) if str(device).startswith("cuda") else nullcontext()
    )
    try:
        with own_stream:
            return run_one(preset, spec, device), None
    except Exception as error:  # noqa: BLE001 - reported to the sweep, which records it
        return None, "".join(traceback.format_exception(error))


def _work(conn, threads: int) -> None:
    """A worker process: train the `(preset, specs, device, batched)` jobs received on `conn` one after another
    (the specs of one job at the same time: one thread each, or, when `batched`, as one `run_batched`) and send
    back one `(record, error)` per spec; stop on None, or after a job in which a run failed."""
    torch.set_num_threads(threads)
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the sweep is gone
            return
        if job is None:
            return
        preset, specs, device, batched = job
        if batched:
            results = _run_batched_caught(preset, specs, device)
        elif len(specs) == 1:
            results = [_run_caught(preset, specs[0], device)]
        else:
            with ThreadPoolExecutor(len(specs)) as threads_of_job:
                n = len(specs)
                results = list(threads_of_job.map(_run_caught, [preset] * n, specs, [device] * n))
        conn.send(results)
        if any(error is not None for _, error in results):
            return
        del results
        gc.collect()  # the runs' models, optimisers and CUDA graphs go now, not during the next job
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()


class _Slot:
    """One place in the pool: its device, and the worker process there (None until needed)."""

    def __init__(self, device: str):
        self.device = device
        self.process, self.conn, self.runs, self.job, self.submitted = None, None, 0, None, 0.0


class RunPool:
    """Worker processes (spawned, one CPU thread each by default) that train runs one after another.

    Args:
        devices: one entry per worker, where it trains ("cpu", "cuda:0", ...).
        threads: `torch.set_num_threads` of each worker.
        runs_per_worker: retire a worker once it has trained this many runs and start a fresh one for the next
            (1: a fresh process per run); None keeps each worker for the whole sweep.

    `submit` hands one run, or a group of runs that the worker trains at the same time (in threads, on CUDA
    each on its own stream, or with `batched=True` as one batched run, `run_batched`), to an idle worker, starting one if that place has none; `next_results` waits for
    the next job to finish. A worker in which a run raised, or that died (killed, crashed), is replaced by a
    fresh process for the next job, so a broken CUDA context never reaches another run.
    """

    def __init__(self, devices: list[str], threads: int = 1, runs_per_worker: int | None = None):
        if not devices:
            raise ValueError("RunPool needs at least one device (one per worker), got none")
        if runs_per_worker is not None and runs_per_worker < 1:
            raise ValueError(f"runs_per_worker must be >= 1 or None, got {runs_per_worker}")
        self.slots = [_Slot(d) for d in devices]
        self.threads, self.runs_per_worker = threads, runs_per_worker
        self.context = torch.multiprocessing.get_context("spawn")

    def idle(self) -> int:
        """Workers free for a job."""
        return sum(slot.job is None for slot in self.slots)

    def busy(self) -> int:
        """Runs under way."""
        return sum(len(slot.job) for slot in self.slots if slot.job is not None)

    def submit(self, preset: dict, *specs: dict, batched: bool = False) -> str:
        """Hand the runs `specs` of `preset` to an idle worker, to train at the same time (with `batched`, as
        one `run_batched`); returns its device."""
        if not specs:
            raise ValueError("RunPool.submit needs at least one spec")
        slot = next((s for s in self.slots if s.job is None), None)
        if slot is None:
            raise RuntimeError("RunPool.submit: every worker is busy; call next_results first")
        if (
            not batched
            and len(specs) > 1
            and slot.device.startswith("cuda")
            and preset["train"].get("cuda_graph")
        ):
            # Measured on the H200: two threads capturing CUDA graphs at once
            # invalidate each other's capture (cudaErrorStreamCaptureInvalidated), so every run fails.
            raise ValueError(
                "runs trained together (--together > 1) cannot replay CUDA graphs: their captures, one per "
                "thread, invalidate each other; use more workers instead, or a preset with cuda_graph off"
            )
        if slot.process is None:
            slot.conn, child = self.context.Pipe()
            slot.process = self.context.Process(target=_work, args=(child, self.threads), daemon=True)
            slot.process.start()
            child.close()
            slot.runs = 0
        slot.job, slot.submitted = list(specs), time.perf_counter()
        slot.conn.send((preset, slot.job, slot.device, batched))
        return slot.device

    def next_results(self) -> list[RunOutcome]:
        """Wait for the next job to finish and return a `RunOutcome` per run of it, in submission order."""
        busy = [s for s in self.slots if s.job is not None]
        if not busy:
            raise RuntimeError("RunPool.next_results: no run is under way")
        ready = wait([s.conn for s in busy] + [s.process.sentinel for s in busy])
        slot = next(s for s in busy if s.conn in ready or s.process.sentinel in ready)
        pid = slot.process.pid
        try:
            results = slot.conn.recv()
        except (EOFError, OSError):
            slot.process.join()
            died = f"worker process {pid} died during the run (exit code {slot.process.exitcode})"
            results = [(None, died)] * len(slot.job)
        wall = time.perf_counter() - slot.submitted
        outcomes = [
            RunOutcome(spec, slot.device, record, error, pid, slot.runs, wall)
            for spec, (record, error) in zip(slot.job, results, strict=True)
        ]
        slot.job, slot.runs = None, slot.runs + len(outcomes)
        failed = any(o.error is not None for o in outcomes)
        if failed or (self.runs_per_worker is not None and slot.runs >= self.runs_per_worker):
            self._retire(slot)
        return outcomes

    def _retire(self, slot: _Slot) -> None:
        if slot.process.is_alive():
            try:
                slot.conn.send(None)
            except OSError:
                pass
        slot.process.join(timeout=60)
        if slot.process.is_alive():
            slot.process.kill()
            slot.process.join()
        slot.conn.close()
        slot.process, slot.conn = None, None

    def close(self) -> None:
        """Stop every worker (their runs under way are lost)."""
        for slot in self.slots:
            if slot.process is not None:
                if slot.job is not None:
                    slot.process.kill()
                self._retire(slot)
                slot.job = None

    def __enter__(self) -> "RunPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def warm_up_shapes(preset: dict) -> list[tuple[int, int]]:
    """The `(batch, length)` inputs the preset's runs hand the kernels: the training batch and the evaluation
    slices (`EVAL_BATCH` sequences, and what is left of the held-out set) at every length of its tasks."""
    train = preset["train"]
    leftover = train["eval_size"] % EVAL_BATCH
    batches = {train["batch_size"], min(EVAL_BATCH, train["eval_size"])} | ({leftover} if leftover else set())
    lengths = sorted({n for task in preset["tasks"].values() for n in task["lengths"]})
    return [(b, n) for n in lengths for b in sorted(batches)]


def warm_up_kernels(preset: dict, shapes: list[tuple[int, int]] | None = None) -> None:
    """Compile the Triton kernels the preset's delta-rule mixers use, once, in this process: they land in
    Triton's on-disk cache, so the worker processes load them instead of each compiling its own copy.

    Triton compiles one variant of a kernel per class of its integer arguments (equal to 1, divisible by 16,
    other), so the warm-up runs the shapes the runs will (`warm_up_shapes`, or `shapes`): the number of chunks
    in a launch is batch x chunks per sequence, and a batch of 2 gives a variant that a batch of 64 never uses.
    """
    t0 = time.perf_counter()
    d_model = preset["model"]["d_model"]
    for kind in DELTA_RULE_KINDS:
        mixer = TokenMixer(d_model, MixerConfig(kind=kind, **preset["mixer"])).cuda()
        for batch, length in warm_up_shapes(preset) if shapes is None else shapes:
            x = torch.randn(batch, length, d_model, device="cuda", requires_grad=True)
            mixer(x).sum().backward()  # the forward inside autograd launches the same kernels as without it
    torch.cuda.synchronize()
    print(f"Triton kernels compiled in {time.perf_counter() - t0:.0f} s", flush=True)


def load_results(path: str | os.PathLike) -> dict:
    """The JSON written by `run_sweep`."""
    return json.loads(Path(path).read_text())


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    columns = ["task", "seq_len", "mixer", "lr", "seed", "final_acc", "best_acc", "final_loss", "seconds",
               "num_parameters", "state_size", "device"]  # fmt: skip
    with open(path.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(data["runs"])


def expected_seconds(spec: dict, runs: list[dict]) -> float | None:
    """How long `spec` should take, from the file's runs of the current recipe (`needs_rerun` False, so
    trained the way this invocation trains): the longest recorded run of the same task, length and mixer, else
    of the same task and length, plus 10 % and 15 s for building the model and evaluating. None when neither
    has run yet."""
    current = [r for r in runs if not needs_rerun(r)]
    for same in (
        lambda r: (r["task"], r["seq_len"], r["mixer"]) == (spec["task"], spec["seq_len"], spec["mixer"]),
        lambda r: (r["task"], r["seq_len"]) == (spec["task"], spec["seq_len"]),
    ):
        seconds = [r["seconds"] for r in current if same(r)]
        if seconds:
            return 1.1 * max(seconds) + 15
    return None


def run_sweep(
    preset_name: str,
    out: str | os.PathLike,
    *,
    workers: int = 1,
    max_minutes: float | None = None,
    deadline_minutes: float | None = None,
    device: str | None = None,
    skip: tuple[tuple[str, int], ...] = (),
    runs_per_worker: int | None = None,
    together: int = 1,
    batched: int = 1,
) -> dict:
    """Run (or continue) the sweep of `PRESETS[preset_name]`, writing `out` (.json) and its .csv twin.

    Args:
        preset_name: a key of `PRESETS`.
        out: the JSON file; runs already in it (for the same preset) are skipped. A preset whose only change
            is more seeds continues the file.
        workers: runs trained at the same time, in separate processes with one CPU thread each (on a CUDA
            machine spread round-robin over its GPUs), each training one run after another (`RunPool`).
        max_minutes: start no new run after this many minutes (the finished runs are saved; rerun to go on).
        deadline_minutes: the invocation must end by then (a device call's limit): the runs start longest
            first (`expected_seconds`, so the long ones do not start last and get cut off), and a run starts
            only if it is expected to finish before the deadline; the others stay pending. A run with no
            estimate yet starts only in the first half of the time.
        device: "cpu" or "cuda"; None picks CUDA when available.
        skip: (task, length) cells to leave out of this invocation (they stay pending for the next one).
        runs_per_worker: start a fresh worker process after this many runs (1: one process per run); None
            keeps each worker for the whole invocation.
        together: runs a worker trains at the same time (consecutive runs of the sweep's order, one thread
            each, on CUDA each on its own stream, so their kernels can overlap, which separate processes'
            kernels cannot without MPS).
        batched: train up to this many runs that differ only in seed and learning rate (same task, length and
            mixer) as one batched run in one worker (`run_batched`: one vmapped model, one step for all of
            them); 1 trains every run on its own. Not with `together` > 1.

    Returns:
        The results dict as written.
    """
    preset = PRESETS[preset_name]
    out = Path(out)
    if isinstance(batched, bool) or not isinstance(batched, int) or batched < 1:
        raise ValueError(f"batched must be an int >= 1 (runs per batched run; 1: off), got {batched!r}")
    if batched > 1 and together > 1:
        raise ValueError(
            f"pass batched > 1 or together > 1, not both (got batched={batched}, together={together})"
        )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cuda" and preset["train"].get("cuda_graph"):
        # Every run would fail at its first step; say so once instead (a CUDA set-up gone wrong, usually).
        raise ValueError(
            f"preset {preset_name!r} replays CUDA graphs and needs a CUDA device, got {device!r}"
        )
    data = {"preset": preset_name, "config": preset, "runs": []}
    if out.exists():
        data = load_results(out)
        if data["preset"] != preset_name or not extends_preset(
            data["config"], json.loads(json.dumps(preset))
        ):
            raise ValueError(f"{out} holds another preset or configuration; pass another --out")
        data["config"] = preset  # more seeds or mixers may be added to a finished sweep
    data["environment"] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({platform.machine()})",
        "workers": workers,
        "updated": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    invocation = {
        "started": data["environment"]["updated"],
        "device": data["environment"]["device"],
        "gpus": gpus,
        "workers": workers,
        "runs_per_worker": runs_per_worker,
        "together": together,
        "batched": batched,
        # bench/device/mps.sh sets KDA_EDU_MPS when the workers share the GPU through NVIDIA's MPS.
        "mps": os.environ.get("KDA_EDU_MPS") == "1",
        "minutes": 0.0,
        "runs": 0,
    }
    data.setdefault("invocations", []).append(invocation)
    done = {run_key(r) for r in data["runs"] if not needs_rerun(r)}
    todo = [s for s in run_specs(preset) if run_key(s) not in done and (s["task"], s["seq_len"]) not in skip]
    print(
        f"{preset_name}: {len(done)} runs done, {len(todo)} to go, {workers} worker(s) on {device}",
        flush=True,
    )
    start = time.perf_counter()
    if batched > 1:  # refuse once, before any worker starts, what every batched run would refuse
        for mixer in {sp["mixer"] for sp in todo}:
            spec = next(sp for sp in todo if sp["mixer"] == mixer)
            _, model_config, train_config = run_setup(preset, spec)
            check_batchable(model_config, [train_config], device)
    if todo and device == "cuda" and preset["mixer"].get("backend") == "triton":
        warm_up_kernels(preset)

    def save() -> None:
        invocation["minutes"] = round((time.perf_counter() - start) / 60, 3)
        _write(out, data)

    # A run that fails is reported with its traceback and listed under "failed" in the file; the others go on,
    # and the next invocation tries it again.
    devices = [f"cuda:{i % gpus}" if gpus else "cpu" for i in range(workers)]
    if deadline_minutes is not None:
        estimate = {run_key(sp): expected_seconds(sp, data["runs"]) for sp in todo}
        # Longest first; runs with no estimate yet first of all (they are the ones worth learning about).
        todo.sort(key=lambda sp: -(estimate[run_key(sp)] or float("inf")))

    def fits(spec: dict) -> bool:
        if deadline_minutes is None:
            return True
        left = 60 * deadline_minutes - (time.perf_counter() - start)
        seconds = estimate[run_key(spec)]
        return left > 30 * deadline_minutes if seconds is None else seconds < left

    with RunPool(devices, threads=1, runs_per_worker=runs_per_worker) as pool:
        while todo or pool.busy():
            out_of_time = max_minutes is not None and time.perf_counter() - start > 60 * max_minutes
            while pool.idle() and not out_of_time:
                batch = [sp for sp in todo if fits(sp)][:together]
                if (
                    batch and batched > 1
                ):  # the first run that fits, and the runs that differ from it in seed and rate
                    batch = [sp for sp in todo if fits(sp) and batch_key(sp) == batch_key(batch[0])][:batched]
                if not batch:
                    break
                pool.submit(preset, *batch, batched=batched > 1)
                todo = [sp for sp in todo if sp not in batch]
            if not pool.busy():
                break
            for outcome in pool.next_results():
                spec = outcome.spec
                data["failed"] = [f for f in data.get("failed", []) if run_key(f) != run_key(spec)]
                if outcome.error is not None:
                    print(f"FAILED {spec} on {outcome.device}:\n{outcome.error}", flush=True)
                    data["failed"].append({**spec, "error": outcome.error[-2000:]})
                    save()
                    continue
                # Which invocation trained it (its "started" stamp): how many workers shared the GPU, and how.
                record = {**outcome.record, "invocation": invocation["started"]}
                old = [r for r in data["runs"] if run_key(r) == run_key(record)]
                data.setdefault("superseded", []).extend(old)
                data["runs"] = [r for r in data["runs"] if run_key(r) != run_key(record)] + [record]
                invocation["runs"] += 1
                save()
                print(
                    f"[{len(data['runs'])}/{len(data['runs']) + len(todo) + pool.busy()}] {record['task']} "
                    f"T={record['seq_len']} {record['mixer']} lr={record['lr']} seed={record['seed']}: "
                    f"acc {record['final_acc']:.3f} ({record['seconds']:.0f} s training, {outcome.wall:.0f} s "
                    f"in all, worker {outcome.pid} after {outcome.run_index} runs)",
                    flush=True,
                )
    save()
    return data


def cost(data: dict) -> dict:
    """What the invocations recorded in a results file cost: `gpu_minutes` (wall minutes times GPUs, summed
    over the invocations on a GPU), `runs` (runs those invocations finished), `per_run` (GPU-minutes per run),
    `untracked` (runs in the file from before invocations were recorded), `left` (runs of the preset not in
    the file) and `left_gpu_minutes` (`left * per_run`; None when no run has been timed)."""
    invocations = [i for i in data.get("invocations", []) if i["gpus"] > 0]
    gpu_minutes = sum(i["minutes"] * i["gpus"] for i in invocations)
    runs = sum(i["runs"] for i in invocations)
    all_runs = sum(i["runs"] for i in data.get("invocations", []))
    done = {run_key(r) for r in data["runs"] if not needs_rerun(r)}
    left = sum(run_key(sp) not in done for sp in run_specs(data["config"]))
    per_run = gpu_minutes / runs if runs else None
    return {
        "gpu_minutes": gpu_minutes,
        "runs": runs,
        "per_run": per_run,
        "untracked": len(data["runs"]) - all_runs,
        "left": left,
        "left_gpu_minutes": None if per_run is None else left * per_run,
    }


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (task, length, mixer): the best learning rate (highest mean final accuracy over the
    seeds) and that rate's `mean`, `min`, `max` and per-seed `accs` (and `n_seeds`)."""
    groups: dict[tuple, dict[float, list[float]]] = {}
    for r in runs:
        groups.setdefault((r["task"], r["seq_len"], r["mixer"]), {}).setdefault(r["lr"], []).append(
            r["final_acc"]
        )
    rows = []
    for (task, seq_len, mixer), by_lr in groups.items():
        lr, accs = max(by_lr.items(), key=lambda item: statistics.fmean(item[1]))
        rows.append(
            {
                "task": task,
                "seq_len": seq_len,
                "mixer": mixer,
                "best_lr": lr,
                "mean": statistics.fmean(accs),
                "min": min(accs),
                "max": max(accs),
                "n_seeds": len(accs),
                "accs": accs,
            }
        )
    order = {k: i for i, k in enumerate(LABELS)}  # decay-only beside linear attention
    return sorted(rows, key=lambda r: (r["task"], r["seq_len"], order.get(r["mixer"], len(order))))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--out", required=True, help="the results JSON (a .csv is written beside it)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--max-minutes", type=float, default=None)
    parser.add_argument(
        "--deadline-minutes",
        type=float,
        default=None,
        help="end by then: longest runs first, and only runs expected to finish in time",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument(
        "--skip", nargs="+", default=[], metavar="TASK:LEN", help="cells to leave for a later invocation"
    )
    parser.add_argument(
        "--runs-per-worker",
        type=int,
        default=None,
        help="start a fresh worker process after this many runs (1: one per run; default: never)",
    )
    parser.add_argument(
        "--together",
        type=int,
        default=1,
        help="runs a worker trains at the same time (threads, CUDA streams)",
    )
    parser.add_argument(
        "--batched",
        type=int,
        default=1,
        help="train up to this many runs of one task, length and mixer (other seeds and rates) as one batched "
        "run (vmap over stacked models); default 1: every run on its own",
    )
    parser.add_argument("--dry-run", action="store_true", help="list the runs and exit")
    parser.add_argument(
        "--cost", action="store_true", help="report the GPU-minutes recorded in --out and exit"
    )
    args = parser.parse_args(argv)
    skip = tuple((cell.split(":")[0], int(cell.split(":")[1])) for cell in args.skip)
    if args.dry_run:
        specs = run_specs(PRESETS[args.preset])
        print(f"{len(specs)} runs")
        for s in specs:
            print(s)
        return
    if args.cost:
        c = cost(load_results(args.out))
        per_run = "no run timed" if c["per_run"] is None else f"{c['per_run']:.2f} GPU-minutes per run"
        left = "" if c["left_gpu_minutes"] is None else f", about {c['left_gpu_minutes']:.0f} GPU-minutes"
        print(
            f"{args.out}: {c['gpu_minutes']:.1f} GPU-minutes recorded for {c['runs']} runs ({per_run}); "
            f"{c['untracked']} runs from before invocations were recorded; {c['left']} runs left{left}"
        )
        return
    data = run_sweep(
        args.preset,
        args.out,
        workers=args.workers,
        max_minutes=args.max_minutes,
        deadline_minutes=args.deadline_minutes,
        device=args.device,
        skip=skip,
        runs_per_worker=args.runs_per_worker,
        together=args.together,
        batched=args.batched,
    )
    for row in summarize(data["runs"]):
        print(
            f"{row['task']:>10} T={row['seq_len']:<5} {row['mixer']:>16} lr={row['best_lr']:<7g} "
            f"acc {row['mean']:.3f} [{row['min']:.3f}, {row['max']:.3f}]"
        )


if __name__ == "__main__":
    main()
