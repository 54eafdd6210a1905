"""Levanter's own training entry point (levanter.main.train_lm) with attn_backend=kvax available.

    python -m kvax_plugin.integrations.levanter.train_lm --config_path my_run.yaml \
        --model.attn_backend kvax

Arguments are exactly train_lm's (draccus: a YAML config and --dotted.overrides); install() runs
first, so `attn_backend: kvax` parses. kvax's kernel and block size come from the environment
(KVAX_LEVANTER_BACKEND=auto|jax|triton|reference, KVAX_LEVANTER_BLOCK_SIZE), see settings.py.
"""

from __future__ import annotations


def main() -> None:
  from kvax_plugin.integrations.levanter import install
  install()
  import levanter.config
  from levanter.main import train_lm
  levanter.config.main(train_lm.main)()


if __name__ == "__main__":
  main()
