"""The jax range kvax-plugin declares is the one it checks at import."""

from __future__ import annotations

import configparser
import os
import re
import warnings

import pytest

from kvax_plugin import _version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_older_jax_is_refused_with_the_install_line():
  for old in ("0.10.2", "0.11.0", "0.11.1"):
    with pytest.raises(ImportError, match=rf"needs jax 0.11.2 to 0.12.x, found jax {old}: pip "
                       r"install 'jax>=0.11.2,<0.13'"):
      _version.check_jax(old)


def test_newer_jax_warns_and_tested_ones_are_quiet():
  with pytest.warns(UserWarning, match=r"tested with jax 0.11.2 to 0.12.x, found jax 0.13.0"):
    _version.check_jax("0.13.0")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for v in ("0.11.2", "0.11.3", "0.12.0", "0.12.0.1", "0.12.3.dev20261201"):
      _version.check_jax(v)
  with pytest.raises(ValueError, match="unparsable"):
    _version.check_jax("nightly")


def test_setup_cfg_declares_the_tested_range():
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(ROOT, "setup.cfg"))
  requires = cfg["options"]["install_requires"].split()
  (jax_req,) = [r for r in requires if re.match(r"jax[><=]", r)]
  assert jax_req == _version.requirement() == "jax>=0.11.2,<0.13"


def test_constraint_files_pin_the_ends_of_the_range():
  def pinned(name):
    with open(os.path.join(ROOT, name)) as f:
      return re.search(r"^jax==(\S+)$", f.read(), re.M).group(1)
  assert _version._release(pinned("constraints.txt")) == _version.OLDEST_JAX
  assert _version._release(pinned("constraints-jax-next.txt"))[:2] == _version.NEWEST_JAX_MINOR
