"""The "fitted" recipe (issue 31): the paper's learned router with W_r fitted on calibration text by ridge regression,
written into the converted checkpoint in the permuted head order. Tiny models, offline."""

import json

import pytest
import torch

from mhmoe.convert import ConversionError, convert, main
from mhmoe.convert.calibrate import (
    CALIBRATION_BLOCK,
    calibration_blocks,
    head_recipe,
    measure_heads,
    read_calibration,
)
from tests.convert.test_convert import TINY, _llama_dir


def _reference_fit(model, blocks, ridge=1e-2):
    """Independent reference: per layer, the attention input rows X and the log head-contribution norms Y collected
    one block at a time, each head's o_proj contribution computed directly, and the ridge solution from lstsq on the
    augmented system [X; √λ I] W = [Y; 0]. Returns (W (H, d) per layer, R² per layer)."""
    heads, d = model.config.num_attention_heads, model.config.hidden_size
    head_dim = d // heads
    xs, outs = {}, {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        hooks.append(
            attention.register_forward_pre_hook(
                lambda m, a, k, i=i: xs.setdefault(i, []).append(k["hidden_states"].reshape(-1, d)), with_kwargs=True
            )
        )
        hooks.append(attention.o_proj.register_forward_pre_hook(lambda m, a, i=i: outs.setdefault(i, []).append(a[0])))
    with torch.no_grad():
        for row in blocks:
            model(row[None])
    for hook in hooks:
        hook.remove()
    weights, r2 = [], []
    for i, layer in enumerate(model.model.layers):
        x = torch.cat(xs[i]).double()  # (N, d)
        a = torch.cat(outs[i]).reshape(-1, heads, head_dim).double()  # (N, H, hd)
        w_o = layer.self_attn.o_proj.weight.double()
        y = torch.stack(
            [(a[:, h] @ w_o[:, h * head_dim : (h + 1) * head_dim].T).norm(dim=-1) for h in range(heads)], dim=1
        )
        y = y.clamp_min(1e-6).log()  # (N, H)
        lam = ridge * x.pow(2).sum(0).mean()
        augmented = torch.cat([x, lam.sqrt() * torch.eye(d, dtype=x.dtype)])
        target = torch.cat([y, torch.zeros(d, heads, dtype=y.dtype)])
        w = torch.linalg.lstsq(augmented, target).solution  # (d, H)
        residual = (y - x @ w).pow(2).sum(0)
        r2.append((1 - residual / (y - y.mean(0)).pow(2).sum(0)).mean().item())
        weights.append(w.T)
    return weights, r2


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


def test_fit_against_lstsq_on_the_augmented_system():
    model = _tiny_llama()
    blocks = torch.randint(0, TINY["vocab_size"], (5, 12), generator=torch.Generator().manual_seed(3))
    stats = measure_heads(model, blocks, fit_router=True)
    weights, r2 = _reference_fit(model, blocks)
    fit = stats.router_fit
    assert len(fit.weights) == TINY["num_hidden_layers"]
    for ours, reference in zip(fit.weights, weights, strict=True):
        assert ours.shape == (TINY["num_attention_heads"], TINY["hidden_size"])
        torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-5)
    assert fit.r2 == pytest.approx(r2, abs=1e-4)
    assert all(v < 1 for v in fit.r2)  # no intercept: R² may be below 0 on a random model
    assert measure_heads(model, blocks).router_fit is None  # only when asked


def _calibration_file(tmp_path, corpus):
    path = tmp_path / "calibration.jsonl"
    path.write_text(open(corpus["train"]).read())
    return path


def test_fitted_conversion_writes_the_fitted_router_in_the_permuted_order(tmp_path, tokenizer_dir, corpus):
    """--recipe fitted: config `learned` + straight-through; each layer's routed_weight = the reference fit's rows of
    the routed heads in the permuted order (the converted model's router scores are that map of its hidden states);
    W_s, W_h zero; all heads on = the source (the converter's check and here); recorded in the record and the card."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mhmoe.convert.verify import all_heads_active
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    calibration = _calibration_file(tmp_path, corpus)
    out = tmp_path / "out"
    report = convert(
        str(source),
        str(out),
        0.25,
        0.625,
        recipe="fitted",
        calibration_file=str(calibration),
        calibration_tokens=300,
        progress=False,
    )
    assert report.verification["all_heads_equal"] and report.router == "learned"
    assert "recipe fitted" in report.format()
    config = json.loads((out / "config.json").read_text())
    assert config["moh_router"] == "learned" and config["moh_straight_through"] is True
    assert "moh_head_norm_mean" not in config or config["moh_head_norm_mean"] is None
    record = json.loads((out / "moh_conversion.json").read_text())
    assert record["recipe"] == {"name": "fitted", "shared_heads": "importance", "router": "fitted"}
    fit = record["router_fit"]
    assert fit["tokens"] == record["calibration"]["tokens"] == 300 - 300 % CALIBRATION_BLOCK
    assert len(fit["lambda"]) == len(fit["r2"]) == 2 and "0.01" in fit["ridge"]
    card = (out / "README.md").read_text()
    assert "router fit" in card and "ridge regression" in card and "`learned` router" in card

    dense = AutoModelForCausalLM.from_pretrained(str(source)).eval()
    text, _ = read_calibration(str(calibration))
    blocks = calibration_blocks(AutoTokenizer.from_pretrained(str(source)), text, 300, CALIBRATION_BLOCK)
    reference, _ = _reference_fit(dense, blocks)
    moh = MoHLlamaForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))
    assert any(layer["head_order"] != list(range(8)) for layer in record["layers"])  # a permutation is exercised
    seen = {}
    for i, layer in enumerate(moh.model.layers):
        router = layer.self_attn.head_router
        order = record["layers"][i]["head_order"]
        expected = reference[i][order[2:]].float()  # (R, d): the routed heads in the converted order
        torch.testing.assert_close(router.routed_weight.detach(), expected, rtol=1e-4, atol=1e-5)
        assert not router.shared_weight.any() and not router.stage_weight.any()
        router.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, (a[0], out)))
    with torch.no_grad():
        routed = moh(ids).logits
        for i, (hidden, (gates, logits, _)) in seen.items():
            routed_rows = reference[i][record["layers"][i]["head_order"][2:]].float()  # (R, d)
            torch.testing.assert_close(logits, hidden.float() @ routed_rows.T, rtol=1e-4, atol=1e-5)
            assert set(gates.unique().tolist()) <= {0.0, 1.0} and gates.sum(-1).eq(2 + 3).all()
        with all_heads_active(moh):
            torch.testing.assert_close(moh(ids).logits, dense(ids).logits, rtol=0, atol=1e-5)
    assert not torch.allclose(routed, dense(ids).logits, atol=1e-3)  # routing on changes the output


def test_continue_tuning_the_fitted_model_trains_its_router(tmp_path, corpus, tokenizer_dir):
    """mhmoe-convert --recipe fitted --train_file: a continue-tuning run starts from the fitted W_r and moves it
    (the straight-through gates pass the gradient to the learned router)."""
    from safetensors.torch import load_file

    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    out = tmp_path / "tuned"
    main(
        [
            "--input_dir", str(source), "--output_dir", str(out), "--shared_heads_ratio", "0.25",
            "--active_heads_ratio", "0.625", "--recipe", "fitted", "--calibration_tokens", "256",
            "--train_file", corpus["train"], "--block_size", "16", "--per_device_train_batch_size", "4",
            "--max_steps", "2", "--warmup_steps", "0", "--learning_rate", "1e-3", "--disable_tqdm",
        ]
    )  # fmt: skip
    name = "model.layers.1.self_attn.head_router.routed_weight"
    converted = load_file(out / "converted" / "model.safetensors")[name]
    tuned = load_file(out / "model.safetensors")[name]
    assert converted.abs().sum() > 0  # the fitted start, not zeros
    assert not torch.equal(converted, tuned)  # the run moved W_r
    model = MoHLlamaForCausalLM.from_pretrained(str(out / "converted")).train()
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(4))
    model(ids, labels=ids).loss.backward()
    for layer in model.model.layers:  # through the straight-through gates (not weight decay alone)
        assert layer.self_attn.head_router.routed_weight.grad.abs().sum() > 0


def test_fitted_refusals(tmp_path, tokenizer_dir, capsys):
    """The fitted router needs calibration, so a tokenizer: one-line errors, nothing written."""
    bare = _llama_dir(tmp_path / "bare")
    for recipe in ("fitted", head_recipe("paper", router="fitted")):
        with pytest.raises(ConversionError, match="tokenizer") as error:
            convert(str(bare), str(tmp_path / "out"), recipe=recipe, progress=False)
        assert "\n" not in str(error.value) and not (tmp_path / "out").exists()
    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    with pytest.raises(ConversionError, match="--calibration_file .* holds no text"):
        empty = tmp_path / "empty.txt"
        empty.write_text("  \n")
        convert(str(source), str(tmp_path / "out"), recipe="fitted", calibration_file=str(empty), progress=False)
    with pytest.raises(SystemExit):
        main(["--input_dir", str(source), "--output_dir", str(tmp_path / "out"), "--moh_router", "fitting"])
    assert "fitted" in capsys.readouterr().err
    assert head_recipe("paper", router="fitted").name == "paper (shared heads first, router fitted)"


def test_calibrated_head_budgets_are_measured_with_the_fitted_router(tmp_path, tokenizer_dir):
    """--recipe fitted --head_budget calibrated: the recorded sensitivities are those of the model written (its
    fitted router), re-measured here on the reloaded checkpoint; the budgets are their allocation."""
    from transformers import AutoTokenizer

    from mhmoe.convert.calibrate import default_calibration_text
    from mhmoe.convert.head_budget import allocate_budgets, measure_sensitivity
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    source = _llama_dir(tmp_path / "src", tokenizer_dir, initializer_range=0.3)
    out = tmp_path / "out"
    convert(
        str(source), str(out), 0.25, 0.625, recipe="fitted", calibration_tokens=256, progress=False,
        head_budget="calibrated",
    )  # fmt: skip
    record = json.loads((out / "moh_conversion.json").read_text())
    kl = record["head_budget"]["kl"]
    moh = MoHLlamaForCausalLM.from_pretrained(str(out)).eval()
    blocks = calibration_blocks(
        AutoTokenizer.from_pretrained(str(source)), default_calibration_text(), 256, CALIBRATION_BLOCK
    )
    again = measure_sensitivity(moh, blocks)
    assert sum(kl, []) == pytest.approx(sum(again, []), rel=1e-3, abs=1e-6) and max(map(max, kl)) > 0
    budgets = allocate_budgets(kl, 2 * 3)
    assert moh.config.moh_active_heads_per_layer == budgets
    assert [layer.self_attn.head_router.active_heads for layer in moh.model.layers] == budgets


def test_fitted_router_in_a_sharded_bf16_checkpoint(tmp_path, tokenizer_dir):
    """The router's tensors go into the shard of their layer's o_proj, in the checkpoint's dtype, and into the index;
    the converted checkpoint loads without missing or unexpected keys and passes the converter's logit check."""
    from safetensors import safe_open

    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    source = _llama_dir(tmp_path / "src", tokenizer_dir, dtype=torch.bfloat16, shard_size="40KB")
    out = tmp_path / "out"
    report = convert(str(source), str(out), 0.25, 0.625, recipe="fitted", calibration_tokens=256, progress=False)
    assert report.verification["all_heads_equal"] and report.shards > 1
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for i in range(TINY["num_hidden_layers"]):
        for key, rows in (("routed_weight", 6), ("shared_weight", 2), ("stage_weight", 2)):
            name = f"model.layers.{i}.self_attn.head_router.{key}"
            assert weight_map[name] == weight_map[f"model.layers.{i}.self_attn.o_proj.weight"]
            with safe_open(str(out / weight_map[name]), framework="pt") as f:
                tensor = f.get_tensor(name)
            assert tensor.dtype == torch.bfloat16 and tensor.shape == (rows, TINY["hidden_size"])
            assert tensor.any() == (key == "routed_weight")
    _, info = MoHLlamaForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_disk_space_check_counts_the_fitted_router(tmp_path, tokenizer_dir, monkeypatch):
    """The free-space check covers the tensors calibration adds (the fitted router): with room for the source's
    tensors but not the router's, a one-line refusal and nothing written; with room for both, the conversion runs."""
    from collections import namedtuple

    from mhmoe._plumbing import checkpoint_files
    from mhmoe.convert.plan import plan_conversion

    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    without_router = plan_conversion(str(source), 0.25, 0.625).total_bytes
    heads, d = TINY["num_attention_heads"], TINY["hidden_size"]
    shared = 2  # a quarter of 8 heads
    router = TINY["num_hidden_layers"] * (heads - shared + shared + 2) * d * 4  # W_r, W_s, W_h per layer, fp32
    usage = namedtuple("usage", "total used free")
    for free, fits in ((without_router + router // 2, False), (without_router + router, True)):
        monkeypatch.setattr(checkpoint_files.shutil, "disk_usage", lambda path, free=free: usage(10**12, 0, free))
        out = tmp_path / f"out-{fits}"
        if fits:
            report = convert(
                str(source), str(out), 0.25, 0.625, recipe="fitted", calibration_tokens=256, progress=False
            )
            assert report.bytes == without_router + router  # the router counted as planned
        else:
            with pytest.raises(ConversionError, match="not enough disk space") as error:
                convert(str(source), str(out), 0.25, 0.625, recipe="fitted", calibration_tokens=256, progress=False)
            assert "\n" not in str(error.value) and not out.exists()
            assert not list(tmp_path.glob(".out-*"))  # no temporary folder left
