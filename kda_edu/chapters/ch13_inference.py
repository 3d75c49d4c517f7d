"""Serving a hybrid model, measured: caches after real prefills, appends, and decoding speed (chapter 13).

- `forward_in_pieces(module, x, sizes)`: feed a sequence through a layer or model in pieces (a prefill, then
  appends and single decoded tokens) through one cache; the result must equal one forward pass.
- `measure_cache_bytes(config, lengths)`: build a `HybridLM`, prefill real tokens up to each length and read
  the live cache's bytes (`HybridCache.nbytes_by_kind()`).
- `synthetic_cache(model, batch, context_len)`: a cache of the shapes `context_len` tokens would leave, filled
  with random numbers. Decoding time depends on the cache's shapes, not its contents, so timing runs use it
  instead of a long (and, for full attention, quadratic) prefill.
- `decode_step_seconds(model, cache)`, `decode_row(model, batch, context_len)` and `decode_throughput(...)`:
  tokens per second of one decoding step over a batch, at one or several context lengths.
- `mla_append_seconds(layer, history, appended, mode)`: the time of one MLA append in MHA or MQA mode.
- `decode_step_bytes(config, context_len)`: the temporary memory of one decoding step on top of the caches.
- `max_batch(config, context_len, budget_bytes)`: how many sequences decode within a memory budget (their
  caches and one step's temporaries).
- `largest_batch_rows(result, pattern)` and `batch_one_rows(result, pattern)` pick, per context length, the
  measured row with the largest batch, or the row at batch 1, from a `bench_decode_throughput` result.
- `weight_bytes(config)`: the bytes of a `HybridLM`'s parameters, counted without allocating them.
- `count_ops(fn)` and `dispatched_ops(fn)`: how many PyTorch operations a call dispatches (the length of a step's
  chain of operations), and which.
- `decode_bytes_per_step(config, context_len, batch)`: the bytes a decoding step must move (its bound).
- `mla_causal_token_cost(config, d_model, context_len, appended)`: an MLA append's cost with the masked half
  of causal scores not counted (a prefill's attention is about T^2 / 2 scores, not T^2).
- `chunked_context_attention(layer, q, rows, chunk)`: MHA mode with the context expanded a chunk at a time
  into a bounded workspace, the chunks merged by their softmax statistics; `largest_tensor_bytes(fn)` the
  largest tensor a call creates.
"""

import math
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kda_edu.layers.kda_layer import KDACache
from kda_edu.layers.mla import MLACache
from kda_edu.models.costs import TokenCost, cache_bytes, mla_token_cost
from kda_edu.models.model import HybridCache, HybridConfig, HybridLM
from kda_edu.ops.attention import MQA_SLICE_NUMBERS

# Where bench/kernels/bench_decode_throughput.py writes its GPU results (absent until it has been run on a GPU).
GPU_RESULTS = "h200_decode_throughput.json"  # under bench/results, read with kda_edu.book.bench_result


def forward_in_pieces(module, x: torch.Tensor, sizes: list[int], **kwargs) -> torch.Tensor:
    """Run `module` over x in consecutive pieces of the given sizes through one fresh cache.

    Args:
        module: a `KDALayer`, an `MLA` or a `HybridLM` (anything with `new_cache()` and `forward(x, cache=)`).
        x: `[B, T, D]` hidden states, or `[B, T]` token ids for a model.
        sizes: piece lengths summing to T, e.g. `[100, 1, 1, 30, 1]`: a prefill, two decoded tokens, an append
            of 30 tokens, one more decoded token.
        kwargs: passed to every call (for example `mode="mqa"` for an MLA layer).

    Returns:
        The outputs of the pieces concatenated along time, the same shape as `module(x)`.
    """
    if sum(sizes) != x.shape[1] or min(sizes) < 1:
        raise ValueError(f"sizes must be >= 1 and sum to T = {x.shape[1]}, got {sizes}")
    cache = module.new_cache()
    outputs, start = [], 0
    with torch.no_grad():
        for n in sizes:
            outputs.append(module(x[:, start : start + n], cache=cache, **kwargs))
            start += n
    return torch.cat(outputs, dim=1)


def measure_cache_bytes(
    config: HybridConfig,
    lengths: list[int],
    batch: int = 1,
    piece: int = 256,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> list[dict]:
    """Prefill random tokens into a fresh `HybridLM`'s cache and read its bytes at each length.

    The tokens arrive in pieces of at most `piece` (appends through the cache, which is how a long prompt is
    prefilled in chunks); after reaching each length the live cache is asked for its bytes. The model and its
    cache live on `device` (the tokens are drawn on the CPU, so every device sees the same ones).

    Returns:
        One dict per length: `{"context_len", "kda", "mla", "total"}` in bytes (whole batch).
    """
    torch.manual_seed(seed)
    model = HybridLM(config).to(device).eval()
    cache = model.new_cache()
    generator = torch.Generator().manual_seed(seed)
    rows, seen = [], 0
    with torch.no_grad():
        for length in sorted(lengths):
            while seen < length:
                n = min(piece, length - seen)
                tokens = torch.randint(0, config.vocab_size, (batch, n), generator=generator)
                model(tokens.to(device), cache=cache)
                seen += n
            by_kind = cache.nbytes_by_kind()
            rows.append({"context_len": length, **by_kind, "total": by_kind["kda"] + by_kind["mla"]})
    return rows


def synthetic_cache(model: HybridLM, batch: int, context_len: int, seed: int = 0) -> HybridCache:
    """A cache with the shapes and dtypes a real prefill of `context_len` tokens leaves, random contents.

    KDA layers get a random convolution window and a small random state (float32, or float64 for a float64
    model); MLA layers get `context_len` random latents. Tested to have the same bytes as a real prefill.
    """
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    generator = torch.Generator(device=device).manual_seed(seed)
    layers = []
    for block in model.blocks:
        cache = block.mixer.new_cache()
        if isinstance(cache, KDACache):
            cfg = block.mixer.config
            C = 2 * cfg.num_heads * cfg.head_dim + cfg.hv * cfg.v_dim
            cache.conv_window = torch.randn(
                batch, cfg.conv_size - 1, C, generator=generator, device=device, dtype=dtype
            )
            cache.state = 0.01 * torch.randn(
                batch, cfg.hv, cfg.head_dim, cfg.v_dim, generator=generator, device=device, dtype=state_dtype
            )
            cache.seq_len = context_len
        else:
            width = block.mixer.config.cache_width
            cache.latent = torch.randn(
                batch, context_len, width, generator=generator, device=device, dtype=dtype
            )
        layers.append(cache)
    return HybridCache(layers)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _truncate(cache: HybridCache, lengths: list[int | None]) -> None:
    """Cut the MLA latents back to the given lengths, so repeated timing runs see the same context."""
    for layer, n in zip(cache.layers, lengths, strict=True):
        if isinstance(layer, MLACache) and n is not None:
            layer.latent = layer.latent[:, :n]


def decode_step_seconds(
    model: HybridLM, cache: HybridCache, steps: int = 5, warmup: int = 2, max_seconds: float = math.inf
) -> float:
    """Seconds of one decoding step (one new token per sequence) from `cache`: the fastest of `steps` runs.

    After every run the MLA caches are cut back to their length before the run (the KDA caches have a fixed
    size), so every run decodes at the same context length. The minimum over runs, as in chapter 1: on a
    shared machine other work only adds time. `warmup` untimed runs come first (one-off costs: kernel
    compilation, library heuristics, memory allocation). Once `max_seconds` have passed, the warm-up ends
    after the current run and the timing after the next timed run, so a slow point costs at most a few steps.
    """
    param = next(model.parameters())
    batch = next(c.state.shape[0] if isinstance(c, KDACache) else c.latent.shape[0] for c in cache.layers)
    token = torch.zeros(batch, 1, dtype=torch.long, device=param.device)
    lengths = [c.seq_len if isinstance(c, MLACache) else None for c in cache.layers]
    best, runs, timed = math.inf, 0, 0
    begin = time.perf_counter()
    with torch.no_grad():
        while timed < steps:
            _sync(param.device)
            start = time.perf_counter()
            model._logits(token, cache)
            _sync(param.device)
            seconds = time.perf_counter() - start
            _truncate(cache, lengths)
            runs += 1
            over_time = time.perf_counter() - begin > max_seconds
            if runs > warmup:
                best, timed = min(best, seconds), timed + 1
                if over_time:
                    break
            elif over_time:
                warmup = runs  # the warm-up has used the time allowed: time the next run
    return best


def decode_row(
    model: HybridLM,
    batch: int,
    context_len: int,
    steps: int = 5,
    warmup: int = 2,
    seed: int = 0,
    max_seconds: float = math.inf,
) -> dict:
    """Decoding speed of `model` for `batch` sequences at `context_len`, from a `synthetic_cache`.

    Returns:
        `{"context_len", "batch", "step_s", "tokens_per_s", "cache_bytes"}`; tokens_per_s = batch / step_s
        (one token per sequence per step), cache_bytes the whole batch's cache, which one step reads in full
        (MLA latents) or reads and rewrites (KDA state and window).
    """
    cache = synthetic_cache(model, batch, context_len, seed=seed)
    step = decode_step_seconds(model, cache, steps=steps, warmup=warmup, max_seconds=max_seconds)
    return {
        "context_len": context_len,
        "batch": batch,
        "step_s": step,
        "tokens_per_s": batch / step,
        "cache_bytes": cache.nbytes(),
    }


def decode_throughput(
    config: HybridConfig,
    batch: int,
    context_lens: list[int],
    steps: int = 5,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> list[dict]:
    """Decoding speed of a randomly initialised `HybridLM` at several context lengths.

    Returns:
        One `decode_row` dict per context length: `{"context_len", "batch", "step_s", "tokens_per_s",
        "cache_bytes"}`.
    """
    torch.manual_seed(seed)
    model = HybridLM(config).to(device=device, dtype=dtype).eval()
    return [decode_row(model, batch, S, steps=steps, seed=seed) for S in context_lens]


def mla_append_seconds(
    layer,
    history: int,
    appended: int,
    mode: str,
    batch: int = 1,
    repeats: int = 3,
    threads: int | None = None,
) -> float:
    """Seconds for one MLA layer to append `appended` tokens to a cache of `history` latents, in `mode`.

    The cache is reset to the same `history` random latents before every run; the fastest run counts. On the
    CPU, `threads` sets PyTorch's thread count for the timing (None: leave it alone); it is restored after.
    """
    param = next(layer.parameters())
    before = torch.get_num_threads()
    if threads is not None and param.device.type == "cpu":
        torch.set_num_threads(threads)
    generator = torch.Generator(device=param.device).manual_seed(0)
    base = torch.randn(
        batch, history, layer.config.cache_width, generator=generator, device=param.device, dtype=param.dtype
    )
    x = torch.randn(
        batch, appended, layer.d_model, generator=generator, device=param.device, dtype=param.dtype
    )
    cache = layer.new_cache()
    best = math.inf
    try:
        with torch.no_grad():
            for i in range(repeats + 1):
                cache.latent = base
                _sync(param.device)
                start = time.perf_counter()
                layer(x, cache=cache, mode=mode)
                _sync(param.device)
                if i > 0:
                    best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return best


def decode_step_bytes(
    config: HybridConfig, context_len: int, batch_size: int = 1, dtype_bytes: int = 2
) -> int:
    """Bytes one decoding step allocates on top of the caches it starts from (weights not counted).

    An upper estimate from the shapes. The layers run one after another and free their temporaries, so the
    step's peak is that of its most demanding layer, plus the logits. Per sequence, with S = context_len + 1
    after the new token is appended and c = 4 bytes (8 for a float64 model):

    - an MLA layer (MQA mode): first `torch.cat` builds the longer latent cache next to the old one,
      `S r dtype_bytes`; then `causal_attention` holds the float32 scores and probabilities `[H, 1, S]`,
      `2 H S c`, two partial outputs `2 H r c`, and a float32 slice of the latents (at most
      `MQA_SLICE_NUMBERS` numbers for the whole batch; counted twice, with the slice's scores).
    - a KDA layer: the new state and two more of its size for the update, `3 HV K V c`, and a new window.
    - the hidden states and logits at the end: `2 (d_model + vocab_size) c`.
    """
    B, S, c = batch_size, context_len + 1, max(dtype_bytes, 4)
    kinds = config.layer_kinds
    mla_layer = kda_layer = 0
    if "A" in kinds:
        m = config.mla
        appended = B * S * m.cache_width * dtype_bytes
        positions = min(
            S, max(1, MQA_SLICE_NUMBERS // max(1, B * m.cache_width))
        )  # as causal_attention slices
        attention = B * 2 * m.num_heads * (S + m.kv_rank) * c + 2 * positions * B * m.cache_width * c
        mla_layer = max(appended, attention)
    if "K" in kinds:
        k = config.kda
        window = (k.conv_size - 1) * (2 * k.num_heads * k.head_dim + k.hv * k.v_dim) * dtype_bytes
        kda_layer = B * (3 * k.hv * k.head_dim * k.v_dim * c + window)
    logits = B * 2 * (config.d_model + config.vocab_size) * c
    return max(mla_layer, kda_layer) + logits


def max_batch(
    config: HybridConfig,
    context_len: int,
    budget_bytes: float,
    dtype_bytes: int = 2,
    include_step: bool = True,
) -> int:
    """How many sequences of `context_len` tokens can decode within `budget_bytes` (weights not counted).

    The budget holds the caches (`kda_edu.models.costs.cache_bytes`) and, with `include_step`, the temporaries of
    one decoding step (`decode_step_bytes`); without it, only the caches are counted.
    """

    def needed(batch: int) -> int:
        caches = sum(cache_bytes(config, context_len, batch_size=batch, dtype_bytes=dtype_bytes).values())
        step = decode_step_bytes(config, context_len, batch, dtype_bytes) if include_step else 0
        return caches + step

    per_sequence = sum(cache_bytes(config, context_len, batch_size=1, dtype_bytes=dtype_bytes).values())
    low, high = 0, int(budget_bytes // per_sequence) + 1  # needed(low) <= budget < needed(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if needed(mid) <= budget_bytes else (low, mid)
    return low


def largest_batch_rows(result: dict, pattern: str) -> list[dict]:
    """From a `bench_decode_throughput` result, the measured row with the largest batch at each context
    length of `pattern`, ordered by context length (rows marked `"skipped"` are left out)."""
    best: dict[int, dict] = {}
    for row in result["rows"]:
        if row.get("skipped") or row["pattern"] != pattern:
            continue
        if row["batch"] >= best.get(row["context_len"], {"batch": 0})["batch"]:
            best[row["context_len"]] = row
    return [best[S] for S in sorted(best)]


def batch_one_rows(result: dict, pattern: str) -> list[dict]:
    """From a `bench_decode_throughput` result, the measured rows of `pattern` at batch 1, ordered by context
    length (rows marked `"skipped"` are left out)."""
    rows = [
        row
        for row in result["rows"]
        if row["pattern"] == pattern and row["batch"] == 1 and not row.get("skipped")
    ]
    return sorted(rows, key=lambda row: row["context_len"])


def decode_bytes_per_step(config: HybridConfig, context_len: int, batch: int, dtype_bytes: int = 2) -> dict:
    """Bytes one decoding step must move through memory at least, by kind: `{"weights", "mla", "kda"}`.

    - weights: every parameter read once (`weight_bytes`; the tied embedding once, as the output head).
    - mla: every MLA layer reads each sequence's `context_len + 1` cached rows of `r + d_r` numbers once and
      writes the new one.
    - kda: every KDA layer reads and writes each sequence's float32 state `HV K V` and convolution window.

    Divided by the memory bandwidth this is the step's lower bound; activations (a few vectors per token)
    are left out.
    """
    kinds = config.layer_kinds
    m, k = config.mla, config.kda
    mla = kinds.count("A") * batch * (context_len + 2) * m.cache_width * dtype_bytes
    window = (k.conv_size - 1) * (2 * k.num_heads * k.head_dim + k.hv * k.v_dim) * dtype_bytes
    kda = kinds.count("K") * batch * 2 * (k.hv * k.head_dim * k.v_dim * 4 + window)
    return {"weights": weight_bytes(config, dtype_bytes), "mla": mla, "kda": kda}


def weight_bytes(config: HybridConfig, dtype_bytes: int = 2) -> int:
    """Bytes of the parameters of a `HybridLM` built from `config` (tied embeddings counted once).

    The model is built on PyTorch's "meta" device, which records shapes without allocating memory, so this
    is cheap even for a model far larger than the machine's memory.
    """
    with torch.device("meta"):
        model = HybridLM(config)
    return sum(p.numel() for p in model.parameters()) * dtype_bytes


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def dispatched_ops(fn) -> list[str]:
    """The names of the PyTorch (ATen) operations that calling `fn()` dispatches, in order (views and
    allocations included; `aten._local_scalar_dense` is a device-to-host read such as `.item()`)."""
    with torch.no_grad(), _OpRecorder() as recorder:
        fn()
    return recorder.names


def count_ops(fn) -> int:
    """The number of PyTorch (ATen) operations that calling `fn()` dispatches, views and allocations included.

    Every such operation is a separate call from Python into PyTorch, and on a GPU most of them launch a kernel;
    at a small batch a decoding step's time is largely the fixed cost of that chain.
    """
    return len(dispatched_ops(fn))


def mla_causal_token_cost(
    config, d_model: int, context_len: int, appended: int, mode: str = "mha"
) -> TokenCost:
    """`kda_edu.models.costs.mla_token_cost` with the attention counted causally: the masked scores not at all.

    Appended token i (of n, onto S = context_len - n cached ones) sees S + i + 1 keys, so the n tokens see
    `n S + n (n + 1) / 2` keys in all: on average `S + (n + 1) / 2` per token instead of the `S + n` a dense
    count charges. A fresh prefill (S = 0) does about half the dense count's attention work, `T (T + 1) / 2`
    scores instead of `T^2`; an append onto a long history saves little. The projections, the expansion (MHA
    mode) and the bytes are those of `mla_token_cost`.
    """
    dense = mla_token_cost(config, d_model, context_len, mode, appended=appended)
    S, n = context_len - appended, appended
    parts = dict(dense.parts)
    parts["attention"] = dense.parts["attention"] * (S + (n + 1) / 2) / context_len
    return TokenCost(flops=sum(parts.values()), bytes=dense.bytes, parts=parts)


def chunked_context_attention(layer, q: torch.Tensor, rows: torch.Tensor, chunk: int) -> torch.Tensor:
    """MLA's MHA-mode attention of n new tokens over cached rows, the context expanded `chunk` positions at a time.

    Expanding every cached latent of a long history into per-head keys and values at once costs memory in
    proportion to the history, `(S + n) H (d_k + d_r + d_v)` numbers. A serving engine expands the context in
    chunks into a workspace of a fixed size instead, attends to each chunk, and merges the chunks' partial
    results with their softmax statistics (the running maximum m and sum l of each query row, as flash
    attention does within a kernel):

        m' = max(m, m_c),  l' = l e^(m - m') + l_c e^(m_c - m'),  o' = o e^(m - m') + o_c e^(m_c - m'),

    and returns `o' / l'` at the end. The workspace holds one chunk's keys and values and scores, whatever S.

    Args:
        layer: an `MLA` (its `k_up`, `v_up` and config).
        q: the new tokens' queries `[1, n, H, d_k + d_r]` (`layer.q_proj` output), at positions S ... S + n - 1.
        rows: the cached rows of all S + n positions `[1, S + n, r + d_r]`, the new tokens' last.
        chunk: context positions expanded at a time, >= 1.

    Returns:
        `[1, n, H, d_v]`, equal to `causal_attention` over the fully expanded keys and values.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    cfg = layer.config
    H, r, dk, dr, dv = cfg.num_heads, cfg.kv_rank, cfg.qk_head_dim, cfg.rope_head_dim, cfg.v_head_dim
    n, total = q.shape[1], rows.shape[1]
    if q.shape != (1, n, H, dk + dr) or rows.shape != (1, total, r + dr) or total < n:
        raise ValueError(
            f"q must be [1, n, {H}, {dk + dr}] and rows [1, S + n, {r + dr}], got {tuple(q.shape)} and "
            f"{tuple(rows.shape)}"
        )
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = (dk + dr) ** -0.5
    query = q.to(dtype).transpose(1, 2) * scale  # [1, H, n, dk + dr]
    query_pos = torch.arange(total - n, total, device=q.device)
    m = torch.full((1, H, n, 1), float("-inf"), dtype=dtype, device=q.device)
    l = torch.zeros(1, H, n, 1, dtype=dtype, device=q.device)
    o = torch.zeros(1, H, n, dv, dtype=dtype, device=q.device)
    for a in range(0, total, chunk):
        part = rows[:, a : a + chunk]  # [1, c, r + dr]
        c = part.shape[1]
        k = layer.k_up(part[..., :r]).view(1, c, H, dk)
        if dr:
            k = torch.cat([k, part[:, :, None, r:].expand(1, c, H, dr)], dim=-1)
        v = layer.v_up(part[..., :r]).view(1, c, H, dv)
        scores = query @ k.to(dtype).permute(0, 2, 3, 1)  # [1, H, n, c]
        visible = torch.arange(a, a + c, device=q.device) <= query_pos[:, None]  # [n, c]
        scores = scores.masked_fill(~visible, float("-inf"))
        m_c = scores.amax(dim=-1, keepdim=True)
        m_new = torch.maximum(m, m_c)
        keep = torch.where(torch.isinf(m_new), 0.0, torch.exp(m - m_new))  # rows with no key yet stay at 0
        p = torch.exp(scores - torch.where(torch.isinf(m_new), 0.0, m_new))
        l = l * keep + p.sum(dim=-1, keepdim=True)
        o = o * keep + p @ v.to(dtype).transpose(1, 2)
        m = m_new
    return (o / l).transpose(1, 2).to(q.dtype)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and not t._is_view():
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def largest_tensor_bytes(fn) -> int:
    """The bytes of the largest tensor any PyTorch operation creates while `fn()` runs (views not counted).

    A lower bound on the call's extra memory that does not depend on an allocator or a device: whatever
    frees what, that tensor existed at once."""
    with torch.no_grad(), _LargestTensor() as recorder:
        fn()
    return recorder.largest
