"""Tensor, expert and pipeline parallelism through Transformers' plans (`DistributedConfig`), 2 CPU processes (gloo).

One pair of processes loads each saved tiny model with `tp_size=2` (the config's `base_model_tp_plan`, i.e.
`tp_plan="auto"`) and, for the MoE models, with `tp_size=2, ep_size=2` (`base_model_ep_plan`: whole experts per
rank, sub-tokens dispatched to them), runs a forward + backward with the router losses on, gathers the gradients and
writes them; then two models with `pp_size=2` (`base_model_pp_plan`, forward only). The tests compare with the same
model in this (single) process.
"""

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.distributed import DistributedConfig
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard

from mhmoe import MHMoEConfig, MHMoEForCausalLM, MoHLlamaConfig, MoHLlamaForCausalLM, apply_moh
from tests.causal_lm_tester import MOE, MOH, TINY, randomise_moh_routers
from tests.fixtures.warm import cli_env

ROOT = Path(__file__).resolve().parents[2]

CASES = {  # every rule of the plans is used by at least one case
    "mh-moe": lambda: MHMoEForCausalLM(
        MHMoEConfig(**TINY, **MOE, moe_heads=2, decoder_sparse_step=2, shared_expert_intermediate_size=16)
    ),  # dense + MoE layer
    "smoe": lambda: MHMoEForCausalLM(MHMoEConfig(**TINY, **MOE, moe_heads=1)),
    "moh-mh-moe": lambda: MHMoEForCausalLM(MHMoEConfig(**TINY, **MOE, **MOH, moe_heads=2)),  # learned head router
    "moh_llama": lambda: MoHLlamaForCausalLM(MoHLlamaConfig(**TINY, **MOH)),  # l2 head router: gathered norms
}
EXPERT_CASES = ["mh-moe", "smoe", "moh-mh-moe"]
# "fsdp-ep": FSDP2 data parallel with experts sharded over the same 2 ranks (both ranks get the same batch here, so the
# averaged gradients equal the single-process ones)
MODES = {"tp": dict(tp_size=2), "ep": dict(tp_size=2, ep_size=2), "fsdp-ep": dict(fsdp_size=2, ep_size=2)}
PIPELINE_CASES = ["mh-moe", "moh_llama"]


def batch():
    ids = torch.randint(2, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = TINY["pad_token_id"], 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def masked_heads(model):
    """Every MoH layer computes all heads and masks (moh_head_skipping=False): tensor-parallel ranks hold some heads
    and always take that path, so the single-process reference and every mode take it too, and the comparison is about
    the sharding alone (the head-sparse path is checked against the masked one in test_moh.py)."""
    model.config.moh_head_skipping = False
    return model


def run(model) -> dict[str, torch.Tensor]:
    """Logits, loss (LM + router losses) and every parameter's gradient (gathered when sharded); logits without
    gradients too, which take other paths (local-tensor linear layers under TP; all-reduce instead of all-to-all
    dispatch under EP)."""
    ids, mask, labels = batch()
    with torch.no_grad():
        inference_logits = model(ids, attention_mask=mask).logits
    out = model(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    out.loss.backward()
    results = {"logits": out.logits.detach(), "inference_logits": inference_logits, "loss": out.loss.detach()}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad  # a collective
        results[f"grad.{name}"] = grad
        local = param.to_local() if hasattr(param, "to_local") else param
        results[f"shape.{name}"] = torch.tensor(local.shape)
    return {key: value.contiguous() for key, value in results.items()}


def _worker(rank: int, folder: str, port: int):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    for mode, sizes in MODES.items():
        for name in CASES if mode == "tp" else EXPERT_CASES:
            model = AutoModelForCausalLM.from_pretrained(
                os.path.join(folder, name), distributed_config=DistributedConfig(**sizes), attn_implementation="eager"
            )
            results = run(masked_heads(model))
            if rank == 0:
                save_file(results, os.path.join(folder, f"{mode}-{name}.safetensors"))
    for name in PIPELINE_CASES:  # inference only: Transformers' naive pipeline forward returns no loss
        model = AutoModelForCausalLM.from_pretrained(
            os.path.join(folder, name), distributed_config=DistributedConfig(pp_size=2), attn_implementation="eager"
        )
        ids, mask, _ = batch()
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
        stage = [type(layer).__name__ != "PipelineIdentityLayer" for layer in model.model.layers]
        if rank == 0:
            save_file(
                {"logits": logits.contiguous(), "layers_here": torch.tensor(stage)},
                os.path.join(folder, f"pp-{name}.safetensors"),
            )
    llama = AutoModelForCausalLM.from_pretrained(
        os.path.join(folder, "llama"), distributed_config=DistributedConfig(tp_size=2)
    )
    try:
        apply_moh(llama, **MOH)
    except ValueError as error:
        if rank == 0:
            with open(os.path.join(folder, "apply_moh_refusal.txt"), "w") as file:
                file.write(str(error))
    torch.distributed.destroy_process_group()


WORKER = "import sys\nfrom tests.models.test_parallel import _worker\n_worker(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))"


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory, warm):
    """Saves each case, runs it here, then in 2 processes (warm children: tests/fixtures/warm.py, as torchrun's
    workers, each its own process) under each mode; returns (reference, parallel) results."""
    folder = tmp_path_factory.mktemp("parallel")
    reference = {}
    for name, make in CASES.items():
        torch.manual_seed(0)
        model = make()
        randomise_moh_routers(model)
        model.save_pretrained(folder / name)
        model = AutoModelForCausalLM.from_pretrained(folder / name, attn_implementation="eager")
        reference[name] = run(masked_heads(model))
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(folder / "llama")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workers = [
        warm.popen([sys.executable, "-c", WORKER, str(rank), str(folder), str(port)], env=cli_env(), cwd=ROOT)
        for rank in range(2)
    ]
    assert [worker.wait(600) for worker in workers] == [0, 0]
    parallel = {
        (mode, name): load_file(folder / f"{mode}-{name}.safetensors")
        for mode in MODES
        for name in (CASES if mode == "tp" else EXPERT_CASES)
    }
    parallel.update({("pp", name): load_file(folder / f"pp-{name}.safetensors") for name in PIPELINE_CASES})
    parallel["apply_moh_refusal"] = (folder / "apply_moh_refusal.txt").read_text()
    return reference, parallel


@pytest.mark.parametrize("name", PIPELINE_CASES)
def test_pipeline_parallel_forward_matches_single_process(parallel_runs, name):
    reference, parallel = parallel_runs
    got = parallel["pp", name]
    assert got["layers_here"].tolist() == [True, False]  # rank 0 runs the first of the 2 layers
    torch.testing.assert_close(got["logits"], reference[name]["logits"], rtol=1e-4, atol=1e-5)


def test_apply_moh_refuses_a_tensor_parallel_model(parallel_runs):
    assert "cannot patch a tensor-parallel (sharded) model" in parallel_runs[1]["apply_moh_refusal"]


def _assert_matches(expected, got, where):
    torch.testing.assert_close(got["logits"], expected["logits"], rtol=1e-4, atol=1e-5, msg=f"{where} logits")
    torch.testing.assert_close(got["inference_logits"], expected["logits"], rtol=1e-4, atol=1e-5, msg=where)
    torch.testing.assert_close(got["loss"], expected["loss"], rtol=1e-5, atol=1e-6, msg=f"{where} loss")
    grads = [key for key in expected if key.startswith("grad.")]
    assert grads and set(grads) == {key for key in got if key.startswith("grad.")}
    for key in grads:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-6, msg=f"{where} {key}")


@pytest.mark.parametrize("name", list(CASES))
def test_tensor_parallel_matches_single_process(parallel_runs, name):
    reference, parallel = parallel_runs
    got = parallel["tp", name]
    _assert_matches(reference[name], got, f"tp {name}")
    shape = got["shape.model.layers.0.self_attn.q_proj.weight"].tolist()  # sharded: 2 of 4 heads per rank
    assert shape == [TINY["hidden_size"] // 2, TINY["hidden_size"]]
    if name != "moh_llama":
        layer = 0 if name != "mh-moe" else 1
        width = 32 if name == "smoe" else 16  # sub-token width d / h
        assert got[f"shape.model.layers.{layer}.mlp.experts.down_proj"].tolist() == [4, width, 8]  # inner width / 2


@pytest.mark.parametrize("mode", ["ep", "fsdp-ep"])
@pytest.mark.parametrize("name", EXPERT_CASES)
def test_expert_parallel_matches_single_process(parallel_runs, name, mode):
    reference, parallel = parallel_runs
    got = parallel[mode, name]
    _assert_matches(reference[name], got, f"{mode} {name}")
    layer = 0 if name != "mh-moe" else 1
    assert got[f"shape.model.layers.{layer}.mlp.experts.gate_up_proj"][0].item() == MOE["num_experts"] // 2


@pytest.mark.parametrize("config_cls", [MHMoEConfig, MoHLlamaConfig])
def test_plans_name_existing_modules_with_known_styles(config_cls):
    """Every rule of the TP and EP plans names a module or parameter of some case, with a style Transformers knows."""
    names = set()
    for make in CASES.values():
        model = make()
        if isinstance(model.config, config_cls):
            names |= {replace_layer_number_by_wildcard(n) for n, _ in model.named_modules()}
            names |= {replace_layer_number_by_wildcard(n) for n, _ in model.model.named_parameters()}
    names = {name.removeprefix("model.") for name in names}
    assert config_cls.base_model_tp_plan["layers.*.self_attn.head_router"] == "moh_head_router"
    for plan in (config_cls.base_model_tp_plan, config_cls.base_model_ep_plan or {}):  # moh_llama: no experts
        for rule, style in plan.items():
            assert style in ALL_PARALLEL_STYLES, style
            assert rule in names, rule
    assert set(config_cls.base_model_pp_plan) <= names
