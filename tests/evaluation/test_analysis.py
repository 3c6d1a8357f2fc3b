"""Head and expert load statistics against hook-based counts, and the PNG heat-maps."""

import pytest
import torch

import mhmoe
from mhmoe import MHMoEConfig, MHMoEForCausalLM, MoHLlamaConfig, MoHLlamaForCausalLM
from mhmoe.evaluation.analysis import expert_load, head_load, plot_load
from mhmoe.models.mhmoe.sparse_moe import MHMoETopKRouter

VOCAB, HIDDEN, HEADS, HEAD_DIM = 100, 32, 8, 4


def batches():
    generator = torch.Generator().manual_seed(0)
    first = torch.randint(1, VOCAB, (2, 7), generator=generator)
    mask = torch.ones_like(first)
    first[1, :3], mask[1, :3] = 0, 0
    second = torch.randint(1, VOCAB, (3, 5), generator=generator)
    return [{"input_ids": first, "attention_mask": mask}, second]


def moh_llama(shared=3, active=2):
    torch.manual_seed(0)
    config = MoHLlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=HEADS,
        num_key_value_heads=4,
        pad_token_id=0,
        moh_shared_heads=shared,
        moh_active_heads=active,
    )
    return MoHLlamaForCausalLM(config)


def test_head_load_matches_counts_from_the_queries():
    shared, active = 3, 2
    model = moh_llama(shared, active)
    counts = torch.zeros(3, HEADS - shared)
    tokens = 0
    for batch in batches():
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        mask = batch["attention_mask"] if isinstance(batch, dict) else torch.ones_like(ids)
        captured = {}
        handles = [
            layer.self_attn.q_proj.register_forward_hook(
                lambda module, args, out, i=i: captured.__setitem__(i, out.detach())
            )
            for i, layer in enumerate(model.model.layers)
        ]
        with torch.no_grad():
            model(ids, attention_mask=mask)
        for handle in handles:
            handle.remove()
        for layer, query in captured.items():
            for b in range(ids.shape[0]):
                for t in range(ids.shape[1]):
                    if not mask[b, t]:
                        continue
                    norms = query[b, t].view(HEADS, HEAD_DIM)[shared:].norm(dim=-1)
                    for head in torch.softmax(norms / norms.std(), dim=-1).topk(active).indices.tolist():
                        counts[layer, head] += 1
        tokens += int(mask.sum())
    model.train()
    load = head_load(model, batches())
    assert model.training  # mode restored
    assert load.shape == (3, HEADS)
    assert torch.equal(load[:, :shared], torch.ones(3, shared))
    torch.testing.assert_close(load[:, shared:], counts / tokens)
    torch.testing.assert_close(load[:, shared:].sum(-1), torch.full((3,), float(active)))
    assert mhmoe.head_load is head_load


def test_expert_load_matches_router_choices():
    torch.manual_seed(0)
    config = MHMoEConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_heads=2,
        pad_token_id=0,
    )
    model = MHMoEForCausalLM(config).eval()
    counts = torch.zeros(2, 6)
    rows = 0
    for batch in batches():
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        mask = batch["attention_mask"] if isinstance(batch, dict) else torch.ones_like(ids)
        chosen = []
        routers = [m for m in model.modules() if isinstance(m, MHMoETopKRouter)]
        handles = [r.register_forward_hook(lambda module, args, out: chosen.append(out[2])) for r in routers]
        with torch.no_grad():
            model(ids, attention_mask=mask)
        for handle in handles:
            handle.remove()
        keep = mask.reshape(-1).repeat_interleave(2).bool()  # two sub-tokens per token
        for layer, experts in enumerate(chosen):
            for expert in experts[keep].flatten().tolist():
                counts[layer, expert] += 1
        rows += int(keep.sum())
    load = expert_load(model, batches())
    torch.testing.assert_close(load, counts / rows)
    torch.testing.assert_close(load.sum(-1), torch.full((2,), 2.0))


def test_plot_load_writes_png_heat_maps(tmp_path):
    import matplotlib.image

    model = moh_llama()
    load = head_load(model, batches())
    path = plot_load(load, str(tmp_path / "heads.png"))
    with open(path, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.05  # not a blank canvas
    per_task = {"task a": load, "task b": head_load(model, batches()[1:])}
    path = plot_load(per_task, str(tmp_path / "tasks.png"), unit="head")
    assert matplotlib.image.imread(path).shape[0] > 100


def test_load_needs_a_routed_model():
    torch.manual_seed(0)
    dense = MHMoEForCausalLM(
        MHMoEConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=HEADS,
            decoder_sparse_step=0,
            moh_shared_heads=None,
        )
    )
    with pytest.raises(ValueError, match="returned no router_logits"):
        expert_load(dense, batches())
    with pytest.raises(ValueError, match="at least one batch"):
        head_load(moh_llama(), [])


def test_expert_load_refuses_lory_with_the_reason():
    lory = MHMoEForCausalLM(
        MHMoEConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=HEADS,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            router_type="lory",
            lory_segment_length=4,
        )
    )
    with pytest.raises(ValueError, match="Lory model .* selects no experts"):
        expert_load(lory, batches())
