"""kvax settings as MaxText config keys (through `kvax_config_class()`, a MaxTextConfig subclass
install() makes the default; the patched MaxText declares the same keys), and their translation
into the kvax provider's options.
"""

from __future__ import annotations

import functools
from typing import Any

import kvax_plugin
from kvax_plugin.attention.kv_exchange import KV_GRAD_REDUCE_CHOICES
from kvax_plugin.attention.kernels import AUTO_DESCRIPTION, BACKENDS
from kvax_plugin.providers.kvax_provider import KvaxOptions

# name -> (type, default, description). Block sizes: powers of two >= 16.
KVAX_CONFIG_FIELDS: dict[str, tuple[type, Any, str]] = {
    "kvax_backend": (str, "auto", f"kvax kernel backend, one of {', '.join(BACKENDS)}: "
                     f"{AUTO_DESCRIPTION}; an explicit choice never falls back"),
    "kvax_fwd_query_block_size": (int, 128, "kvax forward query block size"),
    "kvax_fwd_kv_block_size": (int, 128, "kvax forward key/value block size"),
    "kvax_bwd_query_block_size": (int, 128, "kvax backward query block size"),
    "kvax_bwd_kv_block_size": (int, 128, "kvax backward key/value block size"),
    "kvax_memory_optimized_gqa_backward": (bool, False,
                                           "kvax (Triton): always accumulate dk/dv over a GQA group "
                                           "in place (False: in place when the grid is large)"),
    "kvax_skip_pad_tokens": (bool, True, "kvax: skip blocks made only of kvax padding (negative "
                             "segment ids); MaxText's padding segment 0 attends earlier padding "
                             "in MaxText's own attention, so kvax computes its blocks too"),
    "kvax_context_parallel_order": (str, "auto",
                                    'kvax: token order under load-balanced context parallelism: '
                                    '"auto" (balanced when MaxText reorders batches), "natural", '
                                    '"llama3" (MaxText\'s dual chunk swap) or "balanced" '
                                    '(per batch, document-aware)'),
    "kvax_kv_grad_reduce_dtype": (str, "auto",
                                  'kvax: dtype of the context shards\' key/value gradient sum: '
                                  '"auto" (input dtype at 2 shards, float32 beyond), "float32" '
                                  'or "input"'),
    "kvax_overlap_kv_gather": (bool, False,
                               "kvax: overlap the context-parallel key/value exchange with the "
                               "attention over each shard's own keys (hopper, mosaic, triton, "
                               "jax)"),
}


def config_value(config, name: str):
  """A kvax key from a MaxText config, or its default when the config does not declare it."""
  _, default, _ = KVAX_CONFIG_FIELDS[name]
  try:
    value = getattr(config, name)
  except (AttributeError, KeyError):
    return default
  return default if value is None else value


def options_from_config(config, **mesh_fields) -> KvaxOptions:
  """The kvax provider's options from a MaxText config; errors name the config key at fault."""
  params = {}
  for pass_ in ("fwd", "bwd"):
    q_key, kv_key = f"kvax_{pass_}_query_block_size", f"kvax_{pass_}_kv_block_size"
    q, kv = config_value(config, q_key), config_value(config, kv_key)
    for key, value in ((q_key, q), (kv_key, kv)):
      if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"MaxText config {key}={value!r}: must be a power of two >= 16")
    defaults = kvax_plugin.FlashAttentionParamsConfig()
    params[pass_] = kvax_plugin.FlashAttentionParamsConfig(
        query_block_size=q, kv_block_size=kv, num_warps=defaults.num_warps,
        num_stages=defaults.num_stages if pass_ == "fwd" else 2)
  backend = config_value(config, "kvax_backend")
  if backend not in BACKENDS:
    raise ValueError(f"MaxText config kvax_backend={backend!r}: must be one of {BACKENDS}")
  reduce = config_value(config, "kvax_kv_grad_reduce_dtype")
  if reduce not in KV_GRAD_REDUCE_CHOICES:
    raise ValueError(f"MaxText config kvax_kv_grad_reduce_dtype={reduce!r}: must be one of "
                     f"{KV_GRAD_REDUCE_CHOICES}")
  return KvaxOptions(
      backend=backend, fwd_params=params["fwd"], bwd_params=params["bwd"],
      kv_grad_reduce_dtype=reduce,
      overlap_kv_gather=bool(config_value(config, "kvax_overlap_kv_gather")),
      memory_optimized_gqa_backward=bool(config_value(config, "kvax_memory_optimized_gqa_backward")),
      skip_pad_tokens=bool(config_value(config, "kvax_skip_pad_tokens")),
      **mesh_fields)


@functools.cache
def kvax_config_class():
  """MaxText's MaxTextConfig plus the kvax keys (a pydantic subclass, built on first use)."""
  import pydantic
  from maxtext.configs import types

  fields = {name: (typ, pydantic.Field(default, description=desc))
            for name, (typ, default, desc) in KVAX_CONFIG_FIELDS.items()}
  cls = pydantic.create_model("KvaxMaxTextConfig", __base__=types.MaxTextConfig,
                              __module__=__name__, **fields)
  cls.__doc__ = "MaxText's config with kvax_* keys (see kvax_plugin.integrations.maxtext.settings)."
  return cls
