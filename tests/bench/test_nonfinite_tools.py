"""The tools that found the DeltaNet NaN of chapter 12's sweep: bench.experiments.bisect_recall_run's
--watch hooks and bench.experiments.replay_nonfinite's emulated arithmetic."""

import importlib

import torch


def load(name: str):
    return importlib.import_module(f"bench.experiments.{name}")


class Breaks(torch.nn.Module):
    """A block whose inner projection turns large values into NaN: its input is finite, its output is not."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x):
        y = self.proj(x)
        return self.norm(torch.where(y > 1.5, torch.nan, y))


def test_watch_names_the_module_that_breaks_and_saves_its_input(tmp_path):
    watch = load("bisect_recall_run").watch_nonfinite
    events = {}
    handles = watch(events, tmp_path / "capture.pt")
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), Breaks(), torch.nn.Linear(4, 1))
        with torch.no_grad():
            model[1].proj.weight.copy_(torch.eye(4))
            model[1].proj.bias.zero_()
        x = torch.zeros(3, 5, 4)
        x[1, 2] = 10.0  # only batch row 1 can break
        with torch.no_grad():
            model[0].weight.copy_(torch.eye(4))
            model[0].bias.zero_()
        model(x)
    finally:
        for h in handles:
            h.remove()
    # The first module with a non-finite output is the norm (its input already broken); the source is the block.
    assert events["forward"]["module"] == "1.norm" and not events["forward"]["inputs finite"]
    assert events["source"]["module"] == "1" and events["source"]["bad batch rows"] == 1
    saved = torch.load(tmp_path / "capture.pt")
    assert torch.equal(saved["args"][0], x[1:2])  # the broken row, as the block received it
    assert set(saved["state"]) == {"proj.weight", "proj.bias", "norm.weight", "norm.bias"}


def test_watch_names_the_step_whose_update_breaks_a_parameter():
    watch = load("bisect_recall_run").watch_nonfinite
    events = {}
    handles = watch(events)
    try:
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        for lr in (1e-3, 1e-3, 1e38):  # the third step overflows the weights
            opt.param_groups[0]["lr"] = lr
            opt.zero_grad()
            (model(torch.full((4, 2), 1e3)) ** 2).sum().backward()
            opt.step()
    finally:
        for h in handles:
            h.remove()
    assert events["parameter"]["step"] == 2 and "weight" in events["parameter"]["parameters"]
    assert "gradient" not in events  # the gradients were finite; the update was not


def test_tf32_rounding_keeps_ten_mantissa_bits():
    replay = load("replay_nonfinite")
    x = torch.tensor([1 + 2**-12, 1 + 3 * 2**-12, -(1 + 3 * 2**-12)])
    assert replay.tf32(x).tolist() == [1.0, 1 + 2**-10, -(1 + 2**-10)]  # nearest
    assert replay.tf32_truncated(x).tolist() == [1.0, 1.0, -1.0]  # dropped bits


def test_the_float64_chunked_form_is_the_recurrence():
    """With the exact inverse and no rounding, replay's chunked delta rule and its recurrence are the library's
    delta rule (`delta_rule_recurrent`; float64: 1e-12, many orders above its rounding, far below any difference
    the inverses make); T is not a multiple of 64. The replay keeps its own copies because it imports an old
    build's kda_edu, which cannot share a process with the current one."""
    from kda_edu.ops.delta_rule import delta_rule_recurrent

    replay = load("replay_nonfinite")
    gen = torch.Generator().manual_seed(0)
    T, K, V = 150, 8, 6
    q, k = (
        torch.nn.functional.normalize(torch.randn(T, K, generator=gen, dtype=torch.float64), dim=-1)
        for _ in "qk"
    )
    v = torch.randn(T, V, generator=gen, dtype=torch.float64)
    beta = torch.rand(T, generator=gen, dtype=torch.float64)
    ref = delta_rule_recurrent(*(x[None, :, None] for x in (q, k, v, beta)), scale=K**-0.5)[0][0, :, 0]
    mine = replay.recurrence(q, k, v, beta, K**-0.5)
    out, norms, errors = replay.chunked(q, k, v, beta, K**-0.5, replay.INVERSES["exact float64"])
    assert (mine - ref).abs().max() < 1e-12 and (out - ref).abs().max() < 1e-12
    assert len(norms) == 3 and max(errors) < 1e-12


def test_the_product_form_loses_accuracy_on_nearly_parallel_keys_in_tf32():
    """Sixteen copies of one unit key with beta near 1: the product form's partial products reach thousands
    (|L^8| up to C(14, 7) = 3432), so TF32's 2^-10 relative rounding leaves errors of order one in an inverse
    whose entries are at most 1; float32 substitution stays within 1e-5 (its worst case here is ~1e-7)."""
    replay = load("replay_nonfinite")
    L = torch.tril(torch.full((16, 16), 0.99, dtype=torch.float64), -1)
    exact = torch.linalg.inv(torch.eye(16, dtype=torch.float64) + L)
    assert (replay.INVERSES["substitution, float32"](L) - exact).abs().max() < 1e-5
    assert (replay.INVERSES["product form, TF32 truncated"](L) - exact).abs().max() > 0.1
