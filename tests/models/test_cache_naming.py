"""The key/value cache under both of its names: `cache` (Transformers 5.24 on) and `past_key_values` (before).

Whichever Transformers is installed, every model type takes the cache under either name, decodes the same from it,
and returns it in the output field that the installed version's `generate` reads."""

import dataclasses

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from mhmoe.models.cache_naming import CACHE, either_cache
from tests.causal_lm_tester import CASES, prompts


def test_cache_is_the_installed_transformers_name():
    assert CACHE in {field.name for field in dataclasses.fields(CausalLMOutputWithPast)}


def test_either_cache():
    first, second = object(), object()
    assert either_cache(first, None) is first
    assert either_cache(None, second) is second
    assert either_cache(first, first) is first
    with pytest.raises(ValueError, match="as `cache` and as `past_key_values`"):
        either_cache(first, second)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_both_names_decode_like_the_full_forward(case):
    model = case.make()
    ids, mask = prompts()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits[:, -1]
        for name in ("cache", "past_key_values"):
            prefix = model(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
            cache = prefix[CACHE]
            assert cache is not None and cache.get_seq_length() == ids.shape[1] - 1
            step = model(ids[:, -1:], attention_mask=mask, use_cache=True, **{name: cache})
            assert step[CACHE] is cache and cache.get_seq_length() == ids.shape[1]
            torch.testing.assert_close(step.logits[:, -1], full, rtol=1e-4, atol=1e-5)
