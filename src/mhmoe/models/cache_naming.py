"""The key/value cache's name, for Transformers before and after 5.24.

Transformers 5.24 renamed the cache argument of model forwards and the cache field of model outputs from
`past_key_values` to `cache`; `generate` passes and reads only the new name there, and the old one is accepted, with a
warning, until 5.40. The model layer takes the cache under either name and returns it, and passes it to Transformers'
own functions, under the installed version's name (`CACHE`).
"""

import dataclasses

from transformers.modeling_outputs import CausalLMOutputWithPast

# "cache" from Transformers 5.24 on, "past_key_values" before
CACHE = (
    "cache" if "cache" in {field.name for field in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
)
CACHE_NAMES = ("cache", "past_key_values")


def either_cache(cache, past_key_values):
    """The cache passed as `cache` or as `past_key_values` (the name before Transformers 5.24); not both."""
    if past_key_values is None:
        return cache
    if cache is not None and cache is not past_key_values:
        raise ValueError("two key/value caches were passed, as `cache` and as `past_key_values`: pass one, as `cache`")
    return past_key_values


__all__ = ["CACHE", "CACHE_NAMES", "either_cache"]
