"""MaxText's own training entry point with attention=kvax available.

    python -m kvax_plugin.integrations.maxtext.train model_name=llama3-8b attention=kvax \
        remat_policy=minimal_with_context kvax_backend=auto ...
    python -m kvax_plugin.integrations.maxtext.train <your config>.yml attention=kvax ...

Arguments are MaxText's (maxtext.trainers.pre_train.train); without a config file first,
MaxText's own configs/base.yml is used. install() runs first, so attention=kvax and the kvax_*
keys are accepted.
"""

from __future__ import annotations

import os
from typing import Sequence


def with_config_file(argv: Sequence[str]) -> list[str]:
  """argv with MaxText's configs/base.yml inserted when no config file comes first."""
  argv = list(argv)
  if len(argv) > 1 and argv[1].endswith((".yml", ".yaml")):
    return argv
  from kvax_plugin.integrations.maxtext.launch_keys import maxtext_dir
  return argv[:1] + [os.path.join(maxtext_dir(), "configs", "base.yml")] + argv[1:]


def main(argv: Sequence[str]) -> None:
  from kvax_plugin.integrations.maxtext import install
  install()
  from maxtext.trainers.pre_train import train
  train.main(with_config_file(argv))


def run() -> None:
  from absl import app
  app.run(main)


if __name__ == "__main__":
  run()
