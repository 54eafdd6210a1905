"""MaxText's own training entry point with attention=kvax available.

    python -m kvax_plugin.integrations.maxtext.train <path>/maxtext/configs/base.yml \
        model_name=llama3-8b attention=kvax kvax_backend=auto ...

Arguments are exactly MaxText's (maxtext.trainers.pre_train.train); install() runs first, so
attention=kvax and the kvax_* keys are accepted.
"""

from __future__ import annotations

from typing import Sequence


def main(argv: Sequence[str]) -> None:
  from kvax_plugin.integrations.maxtext import install
  install()
  from maxtext.trainers.pre_train import train
  train.main(argv)


def run() -> None:
  from absl import app
  app.run(main)


if __name__ == "__main__":
  run()
