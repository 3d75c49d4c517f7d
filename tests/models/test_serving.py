"""The serving decoder: its step's logits equal the reference forward's, with sequences joining and leaving."""

import pytest
import torch

from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLAConfig
from kda_edu.models.model import HybridConfig, HybridLM
from kda_edu.models.serving import ServingDecoder

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels run where the backend does

CONFIG = HybridConfig(
    vocab_size=40,
    d_model=16,
    n_layers=4,
    kda=KDAConfig(num_heads=2, head_dim=8, chunk_size=8),
    mla=MLAConfig(num_heads=2, kv_rank=12, qk_head_dim=8, v_head_dim=8, rope_head_dim=4),
)


def model(dtype=torch.float64) -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(CONFIG).to(device=DEVICE, dtype=dtype).eval()


@pytest.mark.parametrize("kernels", [False, True])
def test_step_logits_equal_the_reference_forward(kernels):
    """Prefill 5 tokens, decode 4 through the pools: every step's logits are the full forward's at that
    position. PyTorch path in float64 (1e-10: the same maths in another order); the Triton kernels (CPU
    interpreter) compute in float32, so float32 model and 1e-4 (float32 rounding over 4 layers and a
    softmax; a wrong slot or position gives errors of order 1)."""
    dtype = torch.float32 if kernels else torch.float64
    lm = model(dtype)
    ids = torch.randint(0, 40, (9,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        full = lm(ids[None])[0]
    decoder = ServingDecoder(lm, max_seqs=3, max_len=16, kernels=kernels, cuda_graph=False)
    slot, last = decoder.add(ids[:5])
    tol = dict(rtol=1e-4, atol=1e-4) if kernels else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last, full[4], **tol)
    for t in range(5, 9):
        logits = decoder.step(ids[t : t + 1], torch.tensor([slot], device=DEVICE))
        torch.testing.assert_close(logits[0], full[t], **tol)
    assert int(decoder.lengths[slot]) == 9


@pytest.mark.parametrize("kernels", [False, True])
def test_continuous_batching_equals_independent_decoding(kernels):
    """Three sequences join at different steps, one leaves and a fourth reuses its row, the batch order
    changes between steps: each sequence's logits equal decoding it alone with the reference model."""
    dtype = torch.float32 if kernels else torch.float64
    tol = dict(rtol=1e-4, atol=1e-4) if kernels else dict(rtol=1e-10, atol=1e-10)
    lm = model(dtype)
    gen = torch.Generator().manual_seed(2)
    seqs = {
        name: torch.randint(0, 40, (n,), generator=gen).to(DEVICE)
        for name, n in (("a", 9), ("b", 7), ("c", 8), ("d", 6))
    }
    with torch.no_grad():
        alone = {name: lm(ids[None])[0] for name, ids in seqs.items()}
    prompt = {"a": 3, "b": 4, "c": 2, "d": 3}
    joins = {0: ["a"], 1: ["b"], 3: ["c"], 4: ["d"]}  # step -> sequences that join before it
    leaves = {3: ["b"]}  # "b" leaves before step 3 (after 2 decoded tokens); "d" reuses its row
    decoder = ServingDecoder(lm, max_seqs=3, max_len=12, kernels=kernels, cuda_graph=False)
    slot, done = {}, {}
    for step in range(6):
        for name in leaves.get(step, []):
            decoder.release(slot.pop(name))
        for name in joins.get(step, []):
            slot[name], last = decoder.add(seqs[name][: prompt[name]])
            torch.testing.assert_close(last, alone[name][prompt[name] - 1], **tol)
            done[name] = prompt[name]
        names = [n for n in sorted(slot, reverse=step % 2 == 1) if done[n] < len(seqs[n])]
        tokens = torch.stack([seqs[n][done[n]] for n in names])
        logits = decoder.step(tokens, torch.tensor([slot[n] for n in names], device=DEVICE))
        for row, n in enumerate(names):
            torch.testing.assert_close(logits[row], alone[n][done[n]], **tol)
            done[n] += 1
    assert slot["d"] in (0, 1, 2) and done["a"] == 9


def test_pools_are_preallocated_and_bad_use_is_named():
    lm = model(torch.float32).cpu()
    decoder = ServingDecoder(lm, max_seqs=2, max_len=8, cuda_graph=False)
    before = [t.data_ptr() for pool in decoder.pools for t in pool.values()]
    slot, _ = decoder.add(torch.tensor([1, 2, 3]))
    decoder.step(torch.tensor([4]), torch.tensor([slot]))
    assert [t.data_ptr() for pool in decoder.pools for t in pool.values()] == before
    mla_rows = [p["latent"] for p in decoder.pools if "latent" in p]
    assert mla_rows[0].shape == (3, 8, 12 + 4)
    with pytest.raises(ValueError, match="prompt must be"):
        decoder.add(torch.arange(8))
    with pytest.raises(ValueError, match="slot 1 is not in use"):
        decoder.release(1)
    decoder.add(torch.tensor([1]))
    with pytest.raises(RuntimeError, match="all 2 rows are in use"):
        decoder.add(torch.tensor([1]))
    with pytest.raises(ValueError, match="cuda_graph=True needs"):
        ServingDecoder(lm, 1, 4, cuda_graph=True)


def test_a_prompt_the_model_refuses_takes_no_row():
    """A prefill that raises (a token id outside the vocabulary) leaves the rows as they were: the one free
    row still takes the next prompt."""
    decoder = ServingDecoder(model(torch.float32).cpu(), max_seqs=1, max_len=8, cuda_graph=False)
    with pytest.raises(ValueError, match="input_ids must lie in"):
        decoder.add(torch.tensor([1, CONFIG.vocab_size]))
    slot, _ = decoder.add(torch.tensor([1, 2]))
    assert slot == 0


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_mla_decode_kernel_equals_the_reference_in_any_split(splits):
    """The split-context kernel (CPU interpreter, float32) against the gathering PyTorch reference, two
    new tokens per sequence each masking what follows it: rows in
    any order, lengths from 1 to the pool's full length, heads not a multiple of the head block; float32
    products over 20 numbers and a softmax: 1e-5."""
    from kda_edu.kernels.mla_decode import mla_absorbed_attention
    from kda_edu.layers.mla import mla_absorbed_reference

    gen = torch.Generator().manual_seed(0)
    q, cache = torch.randn(3, 2, 3, 20, generator=gen), torch.randn(5, 70, 20, generator=gen)
    slots, lengths = torch.tensor([4, 0, 2]), torch.tensor([2, 37, 70], dtype=torch.int32)
    q, cache, slots, lengths = (t.to(DEVICE) for t in (q, cache, slots, lengths))
    out = mla_absorbed_attention(q, cache, slots, lengths, 0.3, 16, num_splits=splits)
    reference = mla_absorbed_reference(q, cache, slots, lengths, 0.3, 16)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    # the first token of the shortest sequence sees one position: its output is that row's latent
    torch.testing.assert_close(out[0, 0], cache[4, 0, :16].expand(3, 16), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="lengths must be int32/int64"):
        mla_absorbed_attention(q, cache, slots, lengths[:2], 0.3, 16)


def test_fused_recurrent_state_indices_update_only_their_rows():
    """`fused_recurrent_kda(state_indices=...)` on a pool equals the same step on gathered states, writes
    the listed rows and leaves the others untouched (same float32 kernel arithmetic: 1e-6)."""
    from kda_edu.kernels import fused_recurrent_kda

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 2, 8, generator=gen), torch.randn(2, 1, 2, 8, generator=gen)
    v, g = torch.randn(2, 1, 2, 8, generator=gen), -torch.rand(2, 1, 2, 8, generator=gen)
    beta, pool = torch.rand(2, 1, 2, generator=gen), torch.randn(5, 2, 8, 8, generator=gen)
    rows = torch.tensor([3, 0])
    q, k, v, g, beta, pool, rows = (t.to(DEVICE) for t in (q, k, v, g, beta, pool, rows))
    o_ref, s_ref = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool[rows], output_final_state=True)
    updated = pool.clone()
    o, _ = fused_recurrent_kda(
        q, k, v, g, beta, initial_state=updated, inplace_final_state=True, state_indices=rows
    )
    torch.testing.assert_close(o, o_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(updated[rows], s_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(updated[[1, 2, 4]], pool[[1, 2, 4]])  # untouched rows: the same bits
    with pytest.raises(ValueError, match="needs the pool as initial_state and inplace_final_state=True"):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=updated, state_indices=rows)


@pytest.mark.parametrize("mode", ["mha", "mqa"])
@pytest.mark.parametrize("kernels", [False, True])
def test_append_into_preallocated_rows_equals_the_layer(mode, kernels):
    """`mla_append` of 5 tokens after 7 equals the reference layer over all 12 (float32; MHA through SDPA,
    MQA through the kernel under the interpreter or the PyTorch reference: 1e-5), and writes the new rows."""
    from kda_edu.layers.mla import MLA
    from kda_edu.models.serving import mla_append

    torch.manual_seed(0)
    layer = MLA(16, CONFIG.mla).to(DEVICE).eval()
    x = torch.randn(2, 12, 16).to(DEVICE)
    with torch.no_grad():
        full = layer(x)
        rows = torch.zeros(2, 20, CONFIG.mla.cache_width, device=DEVICE)
        rows[:, :7] = layer.latents(x[:, :7])
    out = mla_append(layer, x[:, 7:], rows, 7, mode, kernels=kernels)
    torch.testing.assert_close(out, full[:, 7:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows[:, 7:12], layer.latents(x[:, 7:]).detach())
    assert rows[:, 12:].abs().max() == 0


def pools_snapshot(decoder: ServingDecoder) -> list[torch.Tensor]:
    return [decoder.lengths.clone(), *(t.clone() for pool in decoder.pools for t in pool.values())]


@pytest.mark.parametrize("pattern", ["KKKA", "K"])
def test_a_step_past_max_len_raises_before_changing_anything(pattern):
    """A sequence already max_len tokens long: the step used to advance its KDA states and then raise an
    IndexError in the MLA layer ("index 6 is out of bounds for dimension 1 with size 6"), or, without an MLA
    layer, to go on past max_len silently. Now a ValueError names the slot and max_len, and every pool is as
    it was."""
    config = CONFIG if pattern == "KKKA" else HybridConfig(**{**CONFIG.__dict__, "layer_pattern": "K"})
    torch.manual_seed(0)
    lm = HybridLM(config).double().eval()
    decoder = ServingDecoder(lm, max_seqs=2, max_len=6, cuda_graph=False)
    other, _ = decoder.add(torch.tensor([1, 2]))
    slot, _ = decoder.add(torch.tensor([1, 2, 3, 4, 5]))
    decoder.step(torch.tensor([6]), torch.tensor([slot]))  # the 6th token: the row is full
    before = pools_snapshot(decoder)
    with pytest.raises(ValueError, match=f"slot {slot} already holds max_len = 6 tokens"):
        decoder.step(torch.tensor([3, 7]), torch.tensor([other, slot]))
    assert all(torch.equal(a, b) for a, b in zip(before, pools_snapshot(decoder), strict=True))
    decoder.step(torch.tensor([3]), torch.tensor([other]))  # the other sequence goes on
    decoder.release(slot)
    again, _ = decoder.add(torch.tensor([1]))
    decoder.step(torch.tensor([2]), torch.tensor([again]))


def test_step_arguments_are_checked_before_anything_changes():
    lm = model(torch.float32).cpu()
    decoder = ServingDecoder(lm, max_seqs=3, max_len=8, cuda_graph=False)
    slot, _ = decoder.add(torch.tensor([1, 2]))
    before = pools_snapshot(decoder)
    bad = [
        (torch.tensor([1, 2]), torch.tensor([slot, slot]), f"slot {slot} is listed twice"),
        (torch.tensor([1]), torch.tensor([2]), "slot 2 is not in use"),
        (torch.tensor([1]), torch.tensor([3]), "slot 3 is not in use"),  # the scratch row
        (
            torch.tensor([CONFIG.vocab_size]),
            torch.tensor([slot]),
            r"tokens must lie in \[0, vocab_size = 40\)",
        ),
        (torch.tensor([1]), torch.tensor([slot], dtype=torch.int32), r"slots must be an int64 tensor \[B\]"),
        (torch.tensor([[1]]), torch.tensor([slot]), r"tokens must be an int64 tensor \[B\]"),
        (torch.tensor([1, 2]), torch.tensor([slot]), "must both have length B"),
    ]
    for tokens, slots, words in bad:
        with pytest.raises(ValueError, match=words):
            decoder.step(tokens, slots)
    assert all(torch.equal(a, b) for a, b in zip(before, pools_snapshot(decoder), strict=True))
