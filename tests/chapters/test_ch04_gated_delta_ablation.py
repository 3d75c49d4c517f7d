"""The 2 x 2 ablation (kda_edu.chapters.ch04_gated_delta_ablation) and chapter 3's rewrite stream it uses."""

import pytest
import torch

from kda_edu.chapters import ch04_gated_delta_ablation as ablate
from kda_edu.ops.gated_delta import gated_delta_recurrent
from kda_edu.ops.linear_attention import linear_attention_recurrent
from kda_edu.ops.online_regression import overwrite_errors, overwrite_stream, relative_squared_error


def test_relative_squared_error_scores_zero_answers_one():
    target = torch.randn(4, 3, 1, 5)
    torch.testing.assert_close(
        relative_squared_error(torch.zeros_like(target), target), torch.ones(3, dtype=torch.float64)
    )
    assert relative_squared_error(target, target).abs().max() == 0


def test_overwrite_stream_rewrites_one_key():
    q, k, v, latest = overwrite_stream(3, 2, 8, batch=4, seed=1)
    assert q.shape == k.shape == v.shape == latest.shape == (4, 9, 1, 8)
    torch.testing.assert_close(k[:, 3], k[:, 0])  # block 2 starts with k* again
    torch.testing.assert_close(latest[:, 5], v[:, 3])  # in block 2 the latest value is block 2's


def test_overwrite_errors_linear_attention_sums_values():
    # no fillers: linear attention returns the sum of r values, squared error about r - 1 (pooled over 256)
    err = overwrite_errors(1.0, 6, 0, 16, batch=256)
    torch.testing.assert_close(
        err["linear attention"][1:], torch.arange(1.0, 6, dtype=torch.float64), rtol=0.15, atol=0
    )
    assert err["delta rule"].max() < 1e-10


def test_run_heads_matches_the_chapter_functions():
    B, T, K = 2, 20, 6
    q, k, v = (
        torch.randn(B, T, 1, K),
        torch.nn.functional.normalize(torch.randn(B, T, 1, K), dim=-1),
        torch.randn(B, T, 1, K),
    )
    o = ablate.run_heads(q, k, v, [0.0, -0.3], delta_rule=False)
    torch.testing.assert_close(
        o[:, :, :1], linear_attention_recurrent(q, k, v, scale=1.0)[0], rtol=1e-5, atol=1e-5
    )
    o = ablate.run_heads(q, k, v, [0.0, -0.3], delta_rule=True, beta=0.5)
    g = torch.full((B, T, 1), -0.3)
    want = gated_delta_recurrent(q, k, v, g, torch.full((B, T, 1), 0.5), scale=1.0)[0]
    torch.testing.assert_close(o[:, :, 1:], want, rtol=1e-5, atol=1e-5)


def test_ablation_reports_each_model_at_its_best_gate():
    grid = [0.0, -0.05, -0.5]
    result = ablate.ablation(ablate.document_task(n_old=32, n_new=4, dim=8, batch=8), grid)
    assert list(result) == list(ablate.MODELS)
    for name, r in result.items():
        assert r["error"] == min(r["errors"])
        assert len(r["errors"]) == (len(grid) if ablate.MODELS[name]["decay"] else 1)
    # without decay the decaying models' g = 0 entry is the undecayed model
    assert result["decay only (Mamba-2, RetNet)"]["errors"][0] == pytest.approx(
        result["linear attention"]["error"], rel=1e-6
    )
    assert result["Gated DeltaNet"]["errors"][0] == pytest.approx(result["DeltaNet"]["error"], rel=1e-6)


def test_ablation_rejects_positive_gates():
    with pytest.raises(ValueError, match="grid"):
        ablate.ablation(ablate.rewrite_task(n_rewrites=2, fillers=1, dim=4, batch=2), [0.1])


@pytest.mark.parametrize("make", [ablate.rewrite_task, ablate.document_task])
def test_tasks_and_heads_run_on_the_requested_device(make):
    """Tasks land on `device` and the models' gates follow their inputs there (chapter 4 runs them on a GPU).

    The "meta" device stands in for a GPU: it computes shapes only, and mixing it with CPU tensors raises, as
    mixing CUDA and CPU tensors does.
    """
    q, k, v, target, steps = make(dim=4, batch=2, device="meta")
    assert {t.device.type for t in (q, k, v, target)} == {"meta"}
    o = ablate.run_heads(k, k, v, [0.0, -0.1], delta_rule=True)  # the document task reads with fewer queries
    assert o.device.type == "meta" and o.shape == (*v.shape[:2], 2, v.shape[-1])
