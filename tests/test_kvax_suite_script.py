"""scripts/kvax_suite.py's bookkeeping: a test that a timeout cut counts as not run, never as
passed, in one run's summary and when runs over disjoint selections are merged."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "kvax_suite.py"
_SPEC = importlib.util.spec_from_file_location("kvax_suite_script", _PATH)
suite = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(suite)

IDS = [f"tests/test_attention.py::test_op[{i}]" for i in range(4)]


def _log(ids_passed, id_cut=None, ids_collected=IDS):
  lines = [{"collected": list(ids_collected)}]
  for n in ids_passed:
    lines += [{"id": n, "when": "start", "outcome": "started", "duration_s": 0.0},
              {"id": n, "when": "setup", "outcome": "passed", "duration_s": 0.5},
              {"id": n, "when": "call", "outcome": "passed", "duration_s": 2.0},
              {"id": n, "when": "teardown", "outcome": "passed", "duration_s": 0.1}]
  if id_cut is not None:  # the timeout stopped pytest during this test's call
    lines += [{"id": id_cut, "when": "start", "outcome": "started", "duration_s": 0.0},
              {"id": id_cut, "when": "setup", "outcome": "passed", "duration_s": 0.5}]
  return lines


def test_a_test_cut_by_the_timeout_is_not_run():
  out = suite.summarise(_log(IDS[:2], id_cut=IDS[2]), exit_code=None)
  assert out["passed"] == IDS[:2]
  assert out["counts"] == {"cases": 4, "deselected": 0, "passed": 2, "failed": 0, "skipped": 0,
                           "not_run": 2}
  assert IDS[2] in out["durations_s"]  # its setup was timed, yet it did not pass


def _result(tmp_path, name, summary, timed_out):
  result = {"counts": summary["counts"], "failed": summary["failed"],
            "skipped": summary["skipped"], "durations_s": summary["durations_s"],
            "by_function": summary["by_function"], "timed_out": timed_out, "wall_s": 10.0}
  if "passed" in summary:
    result["passed"] = summary["passed"]
  path = tmp_path / name
  path.write_text(json.dumps(result))
  return str(path)


@pytest.mark.parametrize("with_passed_list", [True, False])
def test_merge_counts_only_what_passed(tmp_path, with_passed_list):
  # Two runs over disjoint selections, each cut by its timeout during its last test; results
  # written before the `passed` list existed are read from durations less the cut test.
  first = suite.summarise(_log(IDS[:1], id_cut=IDS[1]), exit_code=None)
  second = suite.summarise(_log(IDS[2:3], id_cut=IDS[3]), exit_code=None)
  if not with_passed_list:
    first.pop("passed"), second.pop("passed")
  paths = [_result(tmp_path, "a.json", first, True), _result(tmp_path, "b.json", second, True)]
  out = tmp_path / "merged.json"
  assert suite.merge(paths, str(out)) == 0
  merged = json.loads(out.read_text())
  assert merged["counts"] == {"cases": 4, "passed": 2, "failed": 0, "skipped": 0, "not_run": 2}
  assert merged["by_function"] == {"test_op": {"passed": 2}}


def test_merge_refuses_a_result_whose_passes_it_cannot_tell(tmp_path):
  summary = suite.summarise(_log(IDS[:2], id_cut=IDS[2]), exit_code=None)
  summary.pop("passed")
  path = _result(tmp_path, "a.json", summary, timed_out=False)  # says finished, was cut
  with pytest.raises(SystemExit, match="a.json: 3 tests look passed but the run counted 2"):
    suite.merge([path], str(tmp_path / "merged.json"))


def test_a_merge_merges_again_with_a_later_run(tmp_path):
  # The cases a merge left not run, run later: the new merge lists every run once and counts
  # each case by its last outcome.
  first = suite.summarise(_log(IDS[:1], id_cut=IDS[1]), exit_code=None)
  second = suite.summarise(_log(IDS[2:3]), exit_code=0)
  paths = [_result(tmp_path, "a.json", first, True), _result(tmp_path, "b.json", second, False)]
  assert suite.merge(paths, str(tmp_path / "ab.json")) == 0
  third = suite.summarise(_log(IDS[1:2] + IDS[3:], ids_collected=IDS), exit_code=0)
  later = _result(tmp_path, "c.json", third, False)
  assert suite.merge([str(tmp_path / "ab.json"), later], str(tmp_path / "abc.json")) == 0
  merged = json.loads((tmp_path / "abc.json").read_text())
  assert merged["counts"] == {"cases": 4, "passed": 4, "failed": 0, "skipped": 0, "not_run": 0}
  assert merged["passed"] == sorted(IDS)
  assert [r["file"] for r in merged["runs"]] == ["a.json", "b.json", "c.json"]
  assert merged["timed_out"] is True and merged["wall_s"] == 30.0
