"""GPU check: kda_edu's KimiDeltaAttention against fla's, in fla's chunk mode and with gradients.

On a CPU only fla's fused_recurrent kernel runs (tests/layers/test_fla_compat.py); fla's chunk kernel, which fla's
layer always uses with gradients, needs a GPU. This script builds fla's layer, copies its weights into ours
(`KimiDeltaAttention.from_fla_state_dict`; ours runs kda_edu.kernels.chunk_kda and its backward, backend
"auto"), and compares in float32:

  * outputs and the gradients of the input and of every weight (ours converted to fla's names with
    `to_fla_state_dict`'s layout), for a full batch, a right-padded batch (attention_mask) and packed
    sequences (cu_seqlens);
  * relative error ||ours - fla|| / ||fla||, bound 1e-2: fla's chunk kernel takes float32 products in TF32
    (test_kda_layer.py measured 1.2e-3 between fla's own chunk and fused_recurrent modes at T = 200), ours
    in exact float32.

    python tests/layers/test_fla_layer_gpu.py --out $OUT/fla_layer.json     (about a minute on one H200)

Collected by pytest; skipped without CUDA.
"""

import argparse
import copy
import json
import sys

import pytest
import torch

from kda_edu.layers.fla_compat import KimiDeltaAttention

BOUND = 1e-2
CASES = {
    "softplus_gva": dict(hidden_size=256, head_dim=64, num_heads=2, num_v_heads=4),
    "lower_bound_expand_v": dict(hidden_size=256, head_dim=64, expand_v=2, num_heads=2, lower_bound=-5.0),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _grad_as_fla(ours: KimiDeltaAttention) -> dict[str, torch.Tensor]:
    """Our parameters' gradients in fla's names and shapes (the same conversion as the weights)."""
    holder = copy.deepcopy(ours)
    holder.load_state_dict({name: p.grad for name, p in ours.named_parameters()})
    return holder.to_fla_state_dict()


def compare(name: str, kwargs: dict, T: int = 300, seed: int = 0) -> dict:
    from fla.layers.kda import KimiDeltaAttention as FlaKDA

    torch.manual_seed(seed)
    theirs = FlaKDA(mode="chunk", **kwargs).cuda()
    with torch.no_grad():
        theirs.g_proj[1].bias.normal_()
        theirs.o_norm.weight.uniform_(0.5, 1.5)
    ours = KimiDeltaAttention.from_fla_state_dict(theirs.state_dict(), **kwargs)
    x = torch.randn(2, T, kwargs["hidden_size"], device="cuda")
    mask = torch.ones(2, T, dtype=torch.long, device="cuda")
    mask[1, T // 2 :] = 0
    packed = torch.randn(1, T, kwargs["hidden_size"], device="cuda")
    cu = torch.tensor([0, T // 3, T // 3 + 7, T], dtype=torch.int32, device="cuda")
    results = {}
    for variant, inp, extra in (
        ("full", x, {}),
        ("padded", x, {"attention_mask": mask}),
        ("packed", packed, {"cu_seqlens": cu}),
    ):
        errs = {}
        outs, grads = {}, {}
        for who, layer in (("fla", theirs), ("ours", ours)):
            layer.zero_grad()
            xi = inp.clone().requires_grad_()
            o = layer(xi, **extra)[0]
            o.square().mean().backward()
            outs[who], grads[who] = o.detach(), xi.grad
        errs["output"] = rel(outs["ours"], outs["fla"])
        errs["input_grad"] = rel(grads["ours"], grads["fla"])
        fla_grads = {n: p.grad for n, p in theirs.named_parameters()}
        for n, g in _grad_as_fla(ours).items():
            errs[f"grad:{n}"] = rel(g, fla_grads[n])
        results[variant] = errs
    worst = max(v for errs in results.values() for v in errs.values())
    return {"case": name, "kwargs": kwargs, "T": T, "errors": results, "worst": worst, "ok": worst <= BOUND}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's chunk kernel needs a CUDA GPU")
@pytest.mark.parametrize("name", list(CASES))
def test_matches_fla_chunk_mode_with_gradients(name):
    pytest.importorskip("fla.layers.kda")
    result = compare(name, CASES[name])
    assert result["ok"], result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    results = [compare(name, kwargs) for name, kwargs in CASES.items()]
    with open(args.out, "w") as f:
        json.dump({"bound": BOUND, "device": torch.cuda.get_device_name(), "results": results}, f, indent=2)
    for r in results:
        print(
            f"{r['case']}: worst relative error {r['worst']:.2e} ({'ok' if r['ok'] else 'FAIL'} at {BOUND})"
        )
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
