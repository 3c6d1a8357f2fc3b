"""Calibrated conversion (issue 24): GGUF input, GQA-respecting head permutation, calibration statistics and the
calibrated routers, distillation against the dense parent. Tiny models, offline."""

import itertools
import json

import pytest
import torch

from mhmoe.convert import ConversionError, convert, main
from mhmoe.convert.calibrate import head_recipe, read_calibration
from mhmoe.convert.distill import Distillation, dense_parent, distillation_loss
from mhmoe.convert.heads import head_order, kv_order, permute_state_dict
from tests.convert.test_convert import TINY, _leftovers, _llama_dir


def _brute_best(importance, shared, kv_heads):
    """Independent reference: the best total importance of `shared` heads over every group-respecting order."""
    heads = len(importance)
    g = heads // kv_heads
    best = float("-inf")
    for groups in itertools.permutations(range(kv_heads)):
        for inner in itertools.product(*(itertools.permutations(range(j * g, (j + 1) * g)) for j in groups)):
            order = [h for block in inner for h in block]
            best = max(best, sum(importance[h] for h in order[:shared]))
    return best


@pytest.mark.parametrize(
    "heads, kv_heads, shared", [(6, 2, 1), (6, 2, 2), (6, 2, 4), (6, 3, 3), (4, 4, 2), (6, 1, 3), (8, 2, 5)]
)
def test_head_order_is_the_best_group_respecting_choice(heads, kv_heads, shared):
    generator = torch.Generator().manual_seed(heads * 10 + shared)
    for _ in range(3):
        importance = torch.rand(heads, generator=generator).tolist()
        order = head_order(importance, shared, kv_heads)
        assert sorted(order) == list(range(heads))
        kv = kv_order(order, kv_heads)  # raises when a group is split
        g = heads // kv_heads
        assert all(order[p] // g == kv[p // g] for p in range(heads))
        assert sum(importance[h] for h in order[:shared]) == pytest.approx(_brute_best(importance, shared, kv_heads))


def test_kv_order_refuses_a_split_group():
    with pytest.raises(ValueError, match="splits a key/value group"):
        kv_order([0, 2, 1, 3], 2)


def _moh(llama, orders, shared=2, active=3, **fields):
    from mhmoe.models.moh_llama import MoHLlamaConfig, MoHLlamaForCausalLM

    config = MoHLlamaConfig(
        **{k: v for k, v in llama.config.to_dict().items() if k in TINY or k == "head_dim"},
        moh_shared_heads=shared,
        moh_active_heads=active,
        **fields,
    )
    model = MoHLlamaForCausalLM(config)
    state = permute_state_dict(llama.state_dict(), orders, config.num_key_value_heads, config.head_dim)
    model.load_state_dict(state)
    return model.eval(), state


def test_permuted_heads_compute_the_source_and_all_heads_on_equals_it_exactly():
    from transformers import LlamaConfig, LlamaForCausalLM

    from mhmoe.convert.verify import all_heads_active

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**TINY)).eval()  # 8 heads, 2 key/value heads: groups of 4
    orders = [[4, 6, 5, 7, 0, 1, 2, 3], [3, 1, 0, 2, 7, 6, 5, 4]]
    moh, state = _moh(llama, orders)
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    permuted = LlamaForCausalLM(llama.config).eval()
    permuted.load_state_dict(state)
    with torch.no_grad():
        source, same = llama(ids).logits, permuted(ids).logits
        with all_heads_active(moh):
            dense = moh(ids).logits
        routed = moh(ids).logits
    assert torch.equal(dense, same)  # all heads on = the permuted source, bit for bit
    torch.testing.assert_close(same, source, rtol=0, atol=1e-5)  # = the source up to summation order
    assert (routed - source).abs().max() > 1e-3  # routing on changes something (the test could fail)
    # the GQA groups stayed intact: head 4 (group 1) now at position 0 uses key/value head 1, now at position 0
    k_src = llama.model.layers[0].self_attn.k_proj.weight.view(2, -1, TINY["hidden_size"])
    k_new = moh.model.layers[0].self_attn.k_proj.weight.view(2, -1, TINY["hidden_size"])
    assert torch.equal(k_new[0], k_src[1]) and torch.equal(k_new[1], k_src[0])
    assert set(moh.state_dict()) == set(llama.state_dict())  # Llama's layout


def test_calibrated_router_scores_against_per_head_statistics():
    from mhmoe.models.moh.head_routers import HEAD_ROUTERS

    mean = [[1.0, 1.0, 2.0, 4.0, 1.0, 3.0]]
    std = [[1.0, 1.0, 0.5, 2.0, 1.0, 1.0]]
    norms = torch.tensor([[[9.0, 9.0, 3.0, 5.0, 2.0, 3.5]]])  # (B, T, H); routed heads 2..5
    queries = norms[..., None] * torch.nn.functional.normalize(torch.ones(1, 1, 6, 4), dim=-1)
    for kind, expected in (("l2_standardized", [2.0, 0.5, 1.0, 0.5]), ("l2_relative", [1.5, 1.25, 2.0, 3.5 / 3])):
        router = HEAD_ROUTERS[kind](8, 6, 2, 1, True, (mean[0], std[0]))
        gates, logits, index = router(torch.zeros(1, 1, 8), queries)
        torch.testing.assert_close(logits[0, 0], torch.tensor(expected))
        assert index[0, 0].tolist() == [expected.index(max(expected))]
        assert gates[0, 0].tolist() == [1.0, 1.0] + [float(i == expected.index(max(expected))) for i in range(4)]


def test_calibrated_router_needs_its_statistics():
    from mhmoe.models.moh_llama import MoHLlamaConfig

    with pytest.raises(Exception, match="needs moh_head_norm_mean"):
        MoHLlamaConfig(**TINY, moh_shared_heads=2, moh_active_heads=2, moh_router="l2_standardized")
    with pytest.raises(Exception, match="2 layers × 8 heads"):
        MoHLlamaConfig(
            **TINY,
            moh_shared_heads=2,
            moh_active_heads=2,
            moh_router="l2_relative",
            moh_head_norm_mean=[[1.0] * 8],
            moh_head_norm_sigma=[[1.0] * 8] * 2,
        )


def test_calibrated_conversion_end_to_end(tmp_path, tokenizer_dir, corpus):
    """--recipe calibrated: most important heads shared (permuted within GQA groups), standardised l2 router with the
    statistics in config.json, recorded in moh_conversion.json; all heads on = source (checked by the converter and
    here), reloads with routing on."""
    from transformers import AutoModelForCausalLM

    from mhmoe.convert.verify import all_heads_active
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    calibration = tmp_path / "calibration.jsonl"
    texts = [json.loads(line)["text"] for line in open(corpus["train"])]
    calibration.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    out = tmp_path / "out"
    recipe = head_recipe("calibrated", router="l2_standardized")  # the calibrated recipe with its other router
    report = convert(
        str(source),
        str(out),
        0.25,
        0.625,
        recipe=recipe,
        calibration_file=str(calibration),
        calibration_tokens=512,
        progress=False,
    )
    assert report.verification["all_heads_equal"] and report.router == "l2_standardized"
    assert (
        "recipe calibrated (shared heads importance, router l2_standardized), router l2_standardized" in report.format()
    )
    record = json.loads((out / "moh_conversion.json").read_text())
    assert record["recipe"] == {
        "name": "calibrated (shared heads importance, router l2_standardized)",
        "shared_heads": "importance",
        "router": "l2_standardized",
    }
    assert record["calibration"]["source"] == "calibration.jsonl" and len(record["calibration"]["sha256"]) == 64
    config = json.loads((out / "config.json").read_text())
    assert config["moh_router"] == "l2_standardized" and len(config["moh_head_norm_mean"]) == 2
    for layer in record["layers"]:  # the 2 shared heads are the 2 most important ones of one key/value group of 4
        importance, order = layer["importance"], layer["head_order"]
        assert order[:2] == layer["shared_source_heads"] or sorted(order[:2]) == layer["shared_source_heads"]
        best = max(sorted((importance[h] for h in range(j * 4, j * 4 + 4)), reverse=True)[:2] for j in range(2))
        assert sorted((importance[h] for h in order[:2]), reverse=True) == pytest.approx(best)
        assert {h // 4 for h in order[:4]} == {order[0] // 4}
    dense = AutoModelForCausalLM.from_pretrained(str(source)).eval()
    moh = MoHLlamaForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), all_heads_active(moh):
        torch.testing.assert_close(moh(ids).logits, dense(ids).logits, rtol=0, atol=1e-5)
    assert moh.model.layers[1].self_attn.head_router.name == "l2_standardized"


def test_recipe_paper_copies_bytes_and_recipe_flags(tmp_path, tokenizer_dir):
    """--recipe paper copies the weights as they are; the default (auto) calibrates a source with a tokenizer (the
    fitted recipe) and falls back to paper, saying so, without one."""
    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    convert(str(source), str(tmp_path / "paper"), progress=False, recipe="paper")
    assert (tmp_path / "paper" / "model.safetensors").read_bytes()[-4096:] == (
        source / "model.safetensors"
    ).read_bytes()[-4096:]
    record = json.loads((tmp_path / "paper" / "moh_conversion.json").read_text())
    assert (
        record["recipe"] == {"name": "paper", "shared_heads": "first", "router": "l2"} and "calibration" not in record
    )
    assert head_recipe("paper", router="l2_relative").router == "l2_relative"
    with pytest.raises(ConversionError, match="--recipe must be one of"):
        head_recipe("best")
    with pytest.raises(ConversionError, match="change a named recipe"):
        head_recipe("auto", router="l2")
    convert(str(source), str(tmp_path / "auto"), progress=False, calibration_tokens=128)
    record = json.loads((tmp_path / "auto" / "moh_conversion.json").read_text())
    assert record["recipe"] == {"name": "fitted", "shared_heads": "importance", "router": "fitted"}
    bare = _llama_dir(tmp_path / "bare")
    report = convert(str(bare), str(tmp_path / "auto-bare"), progress=False)
    record = json.loads((tmp_path / "auto-bare" / "moh_conversion.json").read_text())
    assert record["recipe"]["name"] == "paper" and "calibration needs" in report.format()


def test_read_calibration_refusals(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ConversionError, match='line 2: no "text"'):
        read_calibration(str(bad))
    with pytest.raises(ConversionError, match="missing.txt"):
        read_calibration(str(tmp_path / "missing.txt"))
    text, label = read_calibration(None)
    assert len(text) > 10_000 and "default" in label


# ------------------------------------------------------------------------------------------------------------ GGUF


def _tiny_gguf(path, tokenizer_dir):
    """A tiny llama GGUF (f32 tensors) written with the gguf package's writer, with a GPT-2 style BPE tokenizer, and
    the LlamaForCausalLM it should load as (weights in Transformers' layout)."""
    gguf = pytest.importorskip("gguf")
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = dict(TINY, vocab_size=300, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    heads, kv, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]

    def to_gguf_rope(weight, n_head):  # llama.cpp's q/k layout (Transformers un-permutes it when loading)
        return (
            weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2)
            .reshape(weight.shape)
        )

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv_: kv_[1])][: cfg["vocab_size"]]
    tokens += [f"<extra_{i}>" for i in range(cfg["vocab_size"] - len(tokens))]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    writer.add_tensor("output.weight", sd["lm_head.weight"])
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for i in range(cfg["num_hidden_layers"]):
        for ours, theirs in names.items():
            weight = sd[f"model.layers.{i}.{ours}.weight"]
            if theirs in ("attn_q", "attn_k"):
                weight = to_gguf_rope(weight, heads if theirs == "attn_q" else kv)
            writer.add_tensor(f"blk.{i}.{theirs}.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def test_gguf_input_converts_and_verifies(tmp_path, tokenizer_dir, capsys):
    from mhmoe.convert.verify import all_heads_active
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    folder = tmp_path / "llm_folder"
    folder.mkdir()
    reference = _tiny_gguf(folder / "tiny.gguf", tokenizer_dir)
    out = tmp_path / "out"
    main(
        [
            "--input_dir",
            str(folder),
            "--gguf_file",
            "tiny.gguf",
            "--output_dir",
            str(out),
            "--disable_tqdm",
            "--shared_heads_ratio",
            "0.5",
            "--active_heads_ratio",
            "0.75",
        ]
    )
    printed = capsys.readouterr().out
    assert "dequantised tiny.gguf (GGUF)" in printed and "-> OK" in printed
    record = json.loads((out / "moh_conversion.json").read_text())
    assert record["input_dir"] == "tiny.gguf" and record["verification"]["all_heads_equal"]  # the file, not a folder
    card = (out / "README.md").read_text()
    assert record["base_model"] is None and "base_model" not in card.split("---")[1]  # the metadata: Hub ids only
    assert "Converted from the dense checkpoint `tiny.gguf`" in card
    assert "llm_folder" not in card + json.dumps(record) and ".tmp" not in card + json.dumps(record)
    assert "dequantised tiny.gguf" in record["notes"][0]  # the GGUF notes are in the record written with the folder
    assert (out / "tokenizer.json").is_file() and not _leftovers(tmp_path, "out")
    moh = MoHLlamaForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), all_heads_active(moh):  # the GGUF's weights, independent of the converter's own check
        torch.testing.assert_close(moh(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)


def test_gguf_head_split_is_checked_before_dequantising(tmp_path, tokenizer_dir, capsys, monkeypatch):
    """Ratios that give no whole heads, or counts: known from the GGUF's metadata, before the (long) dequantisation."""
    import mhmoe.convert.gguf as gguf_module

    folder = tmp_path / "gguf"
    folder.mkdir()
    _tiny_gguf(folder / "tiny.gguf", tokenizer_dir)

    def never(*args, **kwargs):
        raise AssertionError("dequantised before the head split was checked")

    monkeypatch.setattr(gguf_module, "dequantise_gguf", never)
    for flags, words in (
        (["--shared_heads_ratio", "0.3"], "give no whole number of heads of 8"),
        (["--shared_heads", "2", "--active_heads", "9"], "--active_heads 9 must be between 0 and"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(
                [
                    "--input_dir",
                    str(folder),
                    "--gguf_file",
                    "tiny.gguf",
                    "--output_dir",
                    str(tmp_path / "o"),
                    "--disable_tqdm",
                    *flags,
                ]
            )
        assert exit_info.value.code == 2 and words in capsys.readouterr().err


def test_gguf_refusals(tmp_path, capsys, monkeypatch):
    pytest.importorskip("gguf")
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "notgguf.gguf").write_bytes(b"NOPE" + bytes(64))
    for name, message in (("missing.gguf", "no such file"), ("notgguf.gguf", "not a GGUF file")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--input_dir", str(folder), "--gguf_file", name, "--output_dir", str(tmp_path / "o")])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # as if the gguf package were not installed
    with pytest.raises(ConversionError, match=r'pip install "mhmoe\[gguf\]"'):
        convert(str(folder), str(tmp_path / "o"), gguf_file="notgguf.gguf")
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------------------------------- distillation


def test_distillation_loss_against_a_hand_computed_kl():
    torch.manual_seed(5)
    student, parent = torch.randn(2, 5, 7), torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    mixed, kl, lm = distillation_loss(student, parent, ids, temperature=2.0, weight=0.25)
    p = torch.softmax(parent[:, :-1] / 2, -1)
    q = torch.softmax(student[:, :-1] / 2, -1)
    expected_kl = (p * (p.log() - q.log())).sum(-1).mean() * 4
    expected_lm = -torch.log_softmax(student[:, :-1], -1).gather(-1, ids[:, 1:, None]).mean()
    torch.testing.assert_close(kl, expected_kl)
    torch.testing.assert_close(lm, expected_lm)
    torch.testing.assert_close(mixed, 0.25 * expected_kl + 0.75 * expected_lm)
    with pytest.raises(ConversionError, match="--distill_weight"):
        Distillation(2.0, 1.5)


def test_dense_parent_is_the_source_and_the_hook_mixes_the_loss():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    moh, _ = _moh(llama, [list(range(8))] * 2)
    parent = dense_parent(moh)
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(parent(ids).logits, llama(ids).logits, rtol=0, atol=1e-5)
    distillation = Distillation(temperature=1.5, weight=0.5)
    handle = distillation.attach(moh)
    moh.train()
    out = moh(input_ids=ids, labels=ids)
    with torch.no_grad():
        _, kl, lm = distillation_loss(out.logits, llama(ids).logits, ids, 1.5, 0.5)
    torch.testing.assert_close(out.loss, 0.5 * kl + 0.5 * lm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["distill_kl_loss"], kl, rtol=1e-4, atol=1e-5)
    assert kl > 0 and distillation.steps == 1 and distillation.parent_bytes > 0
    out.loss.backward()
    assert moh.model.layers[0].self_attn.q_proj.weight.grad is not None
    assert all(p.grad is None for p in distillation._parent.parameters())
    moh.eval()
    assert "distill_kl_loss" not in moh(input_ids=ids, labels=ids)  # evaluation is untouched
    handle.remove()


def test_convert_and_distill_cli(tmp_path, corpus, tokenizer_dir, capsys):
    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    out = tmp_path / "tuned"
    main(
        [
            "--input_dir",
            str(source),
            "--output_dir",
            str(out),
            "--shared_heads_ratio",
            "0.25",
            "--active_heads_ratio",
            "0.625",
            "--recipe",
            "calibrated",
            "--calibration_tokens",
            "256",
            "--train_file",
            corpus["train"],
            "--validation_file",
            corpus["val"],
            "--block_size",
            "16",
            "--per_device_train_batch_size",
            "4",
            "--max_steps",
            "3",
            "--warmup_steps",
            "0",
            "--learning_rate",
            "1e-3",
            "--distill",
            "--distill_temperature",
            "2",
            "--distill_weight",
            "0.7",
            "--disable_tqdm",
        ]
    )
    record = json.loads((out / "distillation.json").read_text())
    assert record["temperature"] == 2.0 and record["weight"] == 0.7 and record["parent_forwards"] == 3
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("distill_kl_loss" in r for r in metrics)
    assert json.loads((out / "converted" / "config.json").read_text())["moh_router"] == "l2_relative"
    with pytest.raises(SystemExit):
        main(["--input_dir", str(source), "--output_dir", str(tmp_path / "x"), "--distill"])
    assert "--distill continue-tunes" in capsys.readouterr().err


def test_exported_card_names_the_recipe_and_the_calibration(tmp_path, tokenizer_dir):
    """mhmoe-export of a calibrated conversion: the card's table gives the recipe, the calibration data's hash and the
    shared heads; the exported folder (remote code) computes the converted model's logits with routing on."""
    from transformers import AutoModelForCausalLM

    from mhmoe.hub import export_pretrained
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    out = tmp_path / "moh"
    convert(str(source), str(out), 0.25, 0.625, recipe="calibrated", calibration_tokens=256, progress=False)
    record = json.loads((out / "moh_conversion.json").read_text())
    exported = export_pretrained(str(out), tmp_path / "exported")
    card = (exported / "README.md").read_text()
    assert "`calibrated`: shared heads `importance`, routed-head score `l2_relative`" in card
    assert record["calibration"]["sha256"][:16] in card and "pydoc_data.topics (default)" in card
    assert f"0: {record['layers'][0]['shared_source_heads']}" in card
    assert "per-head query-norm statistics" in card
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(7))
    remote = AutoModelForCausalLM.from_pretrained(str(exported), trust_remote_code=True).eval()
    ours = MoHLlamaForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(remote(ids).logits, ours(ids).logits, rtol=0, atol=0)


def test_measure_heads_against_a_direct_computation():
    """Importance = mean over tokens of ‖o_proj restricted to head h (attention output of h)‖, query-norm mean/std:
    recomputed here from the attention module's own inputs, head by head, without the Gram-matrix shortcut."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mhmoe.convert.calibrate import measure_heads

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    blocks = torch.randint(0, TINY["vocab_size"], (3, 10), generator=torch.Generator().manual_seed(8))
    stats = measure_heads(model, blocks)
    captured = {}
    layer = model.model.layers[1].self_attn
    h1 = layer.q_proj.register_forward_hook(lambda m, a, out: captured.setdefault("q", []).append(out))
    h2 = layer.o_proj.register_forward_pre_hook(lambda m, a: captured.setdefault("o", []).append(a[0]))
    with torch.no_grad():
        for row in blocks:
            model(row[None])
    h1.remove(), h2.remove()
    q = torch.cat(captured["q"], 1).view(-1, 8, 4)
    o = torch.cat(captured["o"], 1).view(-1, 8, 4)
    norms = q.norm(dim=-1)
    weight = layer.o_proj.weight
    importance = [(o[:, h] @ weight[:, h * 4 : (h + 1) * 4].T).norm(dim=-1).mean().item() for h in range(8)]
    assert stats.tokens == 30
    assert stats.importance[1] == pytest.approx(importance, rel=1e-4)
    assert stats.norm_mean[1] == pytest.approx(norms.mean(0).tolist(), rel=1e-5)
    assert stats.norm_std[1] == pytest.approx(norms.std(0, correction=0).tolist(), rel=1e-3)
