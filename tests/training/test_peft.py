"""PEFT: default LoRA targets for mhmoe / moh_llama, LoRA on the 3-D experts, adapter save/load, merge, training."""

import os

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from transformers import AutoModelForCausalLM

import mhmoe  # noqa: F401  (registers the PEFT defaults)
from mhmoe.training import TrainArguments
from mhmoe.training import train as _train
from mhmoe.training.peft import ATTENTION_TARGETS, expert_target_parameters, lora_config
from tests.fixtures.training import fresh_accelerate_state


def _lora_module_names(model):
    return sorted(name for name, module in model.named_modules() if isinstance(module, LoraLayer))


def test_default_targets_registered_for_model_types():
    for model_type in ("mhmoe", "moh_llama"):
        assert TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING[model_type] == ATTENTION_TARGETS


def test_get_peft_model_without_targets(checkpoint_dir):
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir)
    peft_model = get_peft_model(model, LoraConfig(r=4))  # no target_modules: PEFT's table for "mhmoe"
    expected = sorted(f"base_model.model.model.layers.{i}.self_attn.{p}" for i in range(2) for p in ATTENTION_TARGETS)
    assert _lora_module_names(peft_model) == expected


def test_get_peft_model_moh_llama(moh_llama_type):
    """moh_llama (the real model once registered, else a Llama stand-in): default targets, no experts."""
    from transformers import AutoConfig

    from tests.fixtures.training import MOH_CONFIG

    fields = {k: v for k, v in MOH_CONFIG.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("moh_llama", **fields))
    assert expert_target_parameters(model) == []
    names = _lora_module_names(get_peft_model(model, LoraConfig(r=4)))
    assert sorted(n.rsplit(".", 1)[-1] for n in names) == sorted(ATTENTION_TARGETS * 2)


def test_expert_lora_save_load_merge(tmp_path, checkpoint_dir):
    """LoRA on attention + the 3-D experts: changes the output, trains, saves, reloads and merges exactly."""
    base = AutoModelForCausalLM.from_pretrained(checkpoint_dir).eval()
    assert expert_target_parameters(base) == ["experts.down_proj", "experts.gate_up_proj"]
    input_ids = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        base_logits = base(input_ids).logits

    config = lora_config(base, r=4, init_lora_weights=False)  # non-zero B so the adapter does something
    model = get_peft_model(base, config)
    expert_lora = [n for n, p in model.named_parameters() if "experts" in n and "lora_" in n]
    assert len(expert_lora) == 4  # A and B for gate_up_proj and down_proj of the one MoE layer
    out = model(input_ids, labels=input_ids, output_router_logits=True)
    out.loss.backward()
    grads = dict(model.named_parameters())
    assert all(grads[n].grad is not None and grads[n].grad.abs().sum() > 0 for n in expert_lora)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)

    model.eval()
    with torch.no_grad():
        adapted = model(input_ids).logits
    assert (adapted - base_logits).abs().max() > 1e-3

    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    fresh = AutoModelForCausalLM.from_pretrained(checkpoint_dir)
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids).logits, adapted, rtol=0, atol=1e-6)

    merged = reloaded.merge_and_unload()
    assert not any("lora" in k for k in merged.state_dict())
    assert merged.state_dict().keys() == AutoModelForCausalLM.from_pretrained(checkpoint_dir).state_dict().keys()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids).logits, adapted, rtol=1e-5, atol=1e-5)


def test_lora_dropout_refused_on_experts(checkpoint_dir):
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir)
    with pytest.raises(ValueError, match="no dropout"):
        lora_config(model, lora_dropout=0.1)
    assert lora_config(model, lora_dropout=0.1, experts=False).target_parameters is None


def test_train_with_lora(tmp_path, corpus, checkpoint_dir):
    """mhmoe-train --lora --merge_lora: base frozen, adapter saved; adapter + base == merged model; resume works."""
    from safetensors.torch import load_file

    out = tmp_path / "lora"
    args = TrainArguments(
        model_name_or_path=checkpoint_dir,
        train_file=[corpus["train"]],
        output_dir=str(out),
        block_size=16,
        per_device_train_batch_size=2,
        max_steps=3,
        save_steps=2,
        learning_rate=1e-2,
        lora=True,
        lora_r=4,
        merge_lora=True,
        disable_tqdm=True,
        plot=False,
    )
    fresh_accelerate_state()
    result = _train(args)
    assert (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
    adapter = load_file(out / "adapter_model.safetensors")
    assert any("experts" in k for k in adapter) and any("q_proj" in k for k in adapter)
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at 0: it trained

    base_weights = load_file(os.path.join(checkpoint_dir, "model.safetensors"))
    model_weights = result.model.get_base_model().state_dict()
    torch.testing.assert_close(model_weights["model.embed_tokens.weight"], base_weights["model.embed_tokens.weight"])

    input_ids = torch.randint(0, 300, (2, 12))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint_dir), out).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    merged_card = (out / "merged" / "README.md").read_text()  # from the run's train_summary.json
    assert "Trained with `mhmoe-train` for 3 steps" in merged_card and "LoRA (rank 4), merged." in merged_card
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids).logits, peft_model(input_ids).logits, rtol=1e-5, atol=1e-5)

    # resume a LoRA run from its step-2 checkpoint: step 3 is the same
    fresh_accelerate_state()
    resumed = _train(
        TrainArguments(
            **{
                **vars(args),
                "output_dir": str(tmp_path / "resumed"),
                "resume_from_checkpoint": str(out / "checkpoint-2"),
            }
        )
    )
    assert resumed.history[0]["step"] == 3
    assert resumed.history[0]["loss"] == pytest.approx(result.history[2]["loss"], rel=1e-6)


def _moh_checkpoint(path, router):
    from mhmoe.models.moh_llama import MoHLlamaConfig, MoHLlamaForCausalLM
    from tests.fixtures.training import MOH_CONFIG

    fields = {k: v for k, v in MOH_CONFIG.items() if k != "model_type"}
    config = MoHLlamaConfig(**fields, moh_shared_heads=1, moh_active_heads=2, moh_router=router)
    torch.manual_seed(0)
    model = MoHLlamaForCausalLM(config)
    if router == "learned":  # a fitted-like start: not the zero init, so that routing differs per token
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.head_router.routed_weight, std=0.5)
    model.save_pretrained(path)
    return str(path)


def test_lora_trains_moh_routers(tmp_path, corpus, tokenizer_dir, monkeypatch):
    """mhmoe-train --lora on MoH with a learned router: the router's parameters train in full beside the adapters
    (PEFT modules_to_save), are saved in the adapter, and the merged model (router included) equals base + adapter;
    --lora_routers False freezes them; a parameter-free router (l2) adds nothing."""
    from safetensors.torch import load_file

    from mhmoe.training.peft import router_modules

    source = _moh_checkpoint(tmp_path / "moh", "learned")
    base = load_file(os.path.join(source, "model.safetensors"))
    runs = {}
    for routers in (True, False):
        out = tmp_path / f"lora-{routers}"
        fresh_accelerate_state()
        _train(
            TrainArguments(
                model_name_or_path=source, tokenizer_name_or_path=tokenizer_dir, train_file=[corpus["train"]],
                output_dir=str(out), block_size=16,
                per_device_train_batch_size=2, max_steps=3, save_steps=2, learning_rate=1e-2, lora=True, lora_r=4,
                lora_routers=routers, merge_lora=True, disable_tqdm=True, plot=False,
            )
        )  # fmt: skip
        runs[routers] = out, load_file(out / "adapter_model.safetensors")
    out, adapter = runs[True]
    saved = {k.split("base_model.model.", 1)[1]: v for k, v in adapter.items() if "head_router" in k}
    assert sorted(saved) == sorted(k for k in base if "head_router" in k)  # every router parameter, in full
    name = "model.layers.0.self_attn.head_router.routed_weight"
    assert not torch.equal(saved[name], base[name])  # trained
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    torch.testing.assert_close(merged.model.layers[0].self_attn.head_router.routed_weight, saved[name])
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), out).eval()
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, peft_model(ids).logits, rtol=1e-5, atol=1e-5)
    assert not any("head_router" in k for k in runs[False][1])  # --lora_routers False: frozen, not saved

    # a LoRA checkpoint saved before --lora_routers existed froze the routers: resuming it with them trained is refused
    from mhmoe.training import TrainingError, checkpoints

    state = checkpoints.read_state(str(out / "checkpoint-2"))
    assert state["args"]["lora_routers"] is True
    older = {**state, "args": {k: v for k, v in state["args"].items() if k != "lora_routers"}}
    monkeypatch.setattr(checkpoints, "read_state", lambda path: older)
    resume = TrainArguments(
        model_name_or_path=source, train_file=[corpus["train"]], output_dir=str(out), lora=True, lora_r=4,
        resume_from_checkpoint=str(out / "checkpoint-2"),
    )  # fmt: skip
    with pytest.raises(TrainingError, match=r"other trained parameters \(--lora_routers False -> True\)"):
        checkpoints.check_resume(resume)
    resume.lora_routers = False
    checkpoints.check_resume(resume)  # the older run's setting: accepted
    full = {**older, "args": {**older["args"], "lora": False}}  # a run without LoRA: the LoRA settings do not matter
    monkeypatch.setattr(checkpoints, "read_state", lambda path: full)
    checkpoints.check_resume(TrainArguments(**{**vars(resume), "lora": False, "lora_r": 16, "lora_routers": True}))

    l2 = AutoModelForCausalLM.from_pretrained(_moh_checkpoint(tmp_path / "l2", "l2"))
    assert router_modules(l2) == [] and lora_config(l2).modules_to_save is None
    learned = AutoModelForCausalLM.from_pretrained(source)
    assert lora_config(learned, modules_to_save=["lm_head"]).modules_to_save == ["head_router", "lm_head"]
