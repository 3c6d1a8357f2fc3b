"""benchmarks/studies/moh_router_variants.py: the sequential refit against the converter's own fit, on a tiny Llama."""

import sys
from pathlib import Path

import torch

from tests.convert.test_convert import TINY, _llama_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "studies"))

import moh_router_variants as variants  # noqa: E402


def test_sequential_refit_refits_each_layer_on_the_converted_models_inputs(tmp_path, tokenizer_dir, corpus):
    """Layer 0 sees the same inputs in the parent and the converted model, so its refit is the converter's fit (the
    routed heads' rows, in the permuted order); a later layer sees what the routed layers before it give, so its refit
    differs, and the routers stay in place (the model's forward still runs with them)."""
    from transformers import AutoTokenizer

    from mhmoe.convert import convert
    from mhmoe.convert.calibrate import CALIBRATION_BLOCK, calibration_blocks, read_calibration
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    calibration = tmp_path / "calibration.jsonl"
    calibration.write_text(open(corpus["train"]).read())
    out = tmp_path / "out"
    convert(str(source), str(out), 0.25, 0.625, recipe="fitted", calibration_file=str(calibration),
            calibration_tokens=300, progress=False, verify_logits=False)  # fmt: skip
    model = MoHLlamaForCausalLM.from_pretrained(str(out)).eval()
    fitted = [layer.self_attn.head_router.routed_weight.detach().clone() for layer in model.model.layers]
    text, _ = read_calibration(str(calibration))
    blocks = calibration_blocks(AutoTokenizer.from_pretrained(str(source)), text, 300, CALIBRATION_BLOCK)
    variants.sequential_refit(model, blocks, ridge=1e-2)
    refitted = [layer.self_attn.head_router.routed_weight.detach() for layer in model.model.layers]
    assert len(refitted) == TINY["num_hidden_layers"] >= 2
    torch.testing.assert_close(refitted[0], fitted[0], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(refitted[1], fitted[1], rtol=1e-3, atol=1e-4)
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
