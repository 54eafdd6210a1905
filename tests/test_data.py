"""kvax_plugin.data (corpus, tokenizer, packing, iterator) and the demo's main()."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest

from kvax_plugin.data import (BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, ByteTokenizer, PackedBatch,
                              batch_iterator, corpus_files, first_fit_decreasing, group_documents,
                              load_documents, maxtext_features, pack_documents, read_text,
                              split_entries, split_into_pieces, to_kvax, to_kvax_segment_ids)

TOK = ByteTokenizer()


# ----------------------------------------------------------------------------- helpers


def check_packed(batch: PackedBatch, seq_len: int) -> None:
  """Row-level invariants: shapes, padding only at the end, contiguous segments 1..n, positions
  restarting at 0 per segment, pieces metadata consistent with the arrays (no overflow)."""
  n = batch.num_seqs
  for name in ("tokens", "segment_ids", "positions"):
    arr = getattr(batch, name)
    assert arr.shape == (n, seq_len) and arr.dtype == np.int32, (name, arr.shape, arr.dtype)
  assert len(batch.pieces) == n
  for r in range(n):
    seg, pos, tok = batch.segment_ids[r], batch.positions[r], batch.tokens[r]
    used = sum(p.length for p in batch.pieces[r])
    assert used <= seq_len, f"row {r} overflows"
    # Padding is exactly the suffix after the pieces.
    assert np.all(seg[:used] > 0) and np.all(seg[used:] == 0), f"row {r}: padding not at the end"
    assert np.all(tok[used:] == PAD_ID) and np.all(pos[used:] == 0)
    offset = 0
    for j, piece in enumerate(batch.pieces[r], start=1):
      span = slice(offset, offset + piece.length)
      assert piece.length >= 1
      assert np.all(seg[span] == j), f"row {r}: segment {j} not contiguous"
      np.testing.assert_array_equal(pos[span], np.arange(piece.length))
      offset += piece.length


def check_covers(batches: list[PackedBatch], docs: list[np.ndarray]) -> None:
  """Every token of every document appears exactly once across the batches, in order."""
  seen: dict[int, list[tuple[int, np.ndarray]]] = {}
  for batch in batches:
    for r, row in enumerate(batch.pieces):
      offset = 0
      for piece in row:
        seen.setdefault(piece.document, []).append(
            (piece.start, batch.tokens[r, offset:offset + piece.length]))
        offset += piece.length
  for d, doc in enumerate(docs):
    parts = sorted(seen.pop(d, []), key=lambda x: x[0])
    starts = [s for s, _ in parts]
    lengths = [len(t) for _, t in parts]
    # The pieces tile [0, len(doc)) without gap or overlap ...
    assert starts == list(np.cumsum([0] + lengths[:-1])) if parts else len(doc) == 0, d
    assert sum(lengths) == len(doc), f"document {d}: {sum(lengths)} of {len(doc)} tokens"
    # ... and hold the document's tokens in order.
    if parts:
      np.testing.assert_array_equal(np.concatenate([t for _, t in parts]), doc)
  assert not seen, f"pieces of unknown documents {sorted(seen)}"


def random_docs(seed: int, n: int, seq_len: int) -> list[np.ndarray]:
  """Token documents of awkward lengths: empty, 1 token, exactly seq_len, several seq_len."""
  rng = np.random.default_rng(seed)
  lengths = list(rng.integers(1, 3 * seq_len, n)) + [0, 1, seq_len, seq_len + 1, 2 * seq_len]
  rng.shuffle(lengths)
  return [rng.integers(BOS_ID, VOCAB_SIZE, int(L)).astype(np.int32) for L in lengths]


# ----------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ["", "a", "Hello, world!\n", "naïve café – Ω ≈ 中文 🙂",
                                  "\x00 nul and \t tabs"])
def test_tokenizer_round_trip(text):
  ids = TOK.encode(text)
  assert ids.dtype == np.int32
  assert ids[0] == BOS_ID and ids[-1] == EOS_ID
  assert len(ids) == len(text.encode("utf-8")) + 2
  assert np.all((ids >= 0) & (ids < VOCAB_SIZE))
  assert np.all(ids[1:-1] >= 3), "bytes must not collide with pad/bos/eos"
  assert TOK.decode(ids) == text
  assert TOK.decode(TOK.encode(text, add_bos=False, add_eos=False)) == text
  assert len(TOK.encode(text, add_bos=False, add_eos=False)) == len(text.encode("utf-8"))


def test_tokenizer_all_bytes_and_specials():
  data = bytes(range(256))
  ids = TOK.encode_bytes(data, add_bos=False, add_eos=False)
  np.testing.assert_array_equal(ids, np.arange(3, 259))
  assert TOK.decode_bytes(ids) == data
  assert TOK.decode_bytes([PAD_ID, BOS_ID, *ids, EOS_ID, PAD_ID]) == data
  assert TOK.vocab_size == VOCAB_SIZE == 259


def test_tokenizer_errors():
  with pytest.raises(TypeError, match="text must be a str"):
    TOK.encode(b"bytes")
  with pytest.raises(TypeError, match="data must be bytes"):
    TOK.encode_bytes("str")
  with pytest.raises(ValueError, match=r"ids must lie in \[0, 259\)"):
    TOK.decode([5, 259])
  with pytest.raises(ValueError, match="ids must lie"):
    TOK.decode([-1])
  with pytest.raises(TypeError, match="ids must be integers"):
    TOK.decode(np.array([3.0]))


# ----------------------------------------------------------------------------- corpus


def test_corpus_shipped_with_sources():
  files = corpus_files()
  assert "devils_dictionary.txt" in files
  # SOURCES.md is read from the source tree: package_data ships only data/*.txt.
  sources = (pathlib.Path(__file__).parents[1] / "kvax_plugin" / "data" / "SOURCES.md").read_text()
  total = 0
  for name in files:
    assert name in sources, f"{name} has no entry in SOURCES.md"
    text = read_text(name)
    total += len(text.encode("utf-8"))
  assert 100_000 < total < 2_000_000
  with pytest.raises(ValueError, match="name must be one of"):
    read_text("missing.txt")


def test_split_entries_devils_dictionary():
  units = split_entries(read_text("devils_dictionary.txt"))
  # Preface + the 999 entries dictd's index lists.
  assert len(units) == 1000
  assert "PREFACE" in units[0]
  assert units[1].startswith("ABASEMENT, n.")
  assert units[-1].startswith("ZOOLOGY, n.")
  assert all(u.strip() for u in units)


def test_split_entries_falls_back_to_paragraphs():
  assert split_entries("first para\nstill first\n\n\nsecond\n\n  \nthird") == [
      "first para\nstill first", "second", "third"]


def test_documents_deterministic_and_complete():
  units = split_entries(read_text("devils_dictionary.txt"))
  a = group_documents(units, seed=3)
  assert a == group_documents(units, seed=3)
  assert a != group_documents(units, seed=4)
  # Every unit used once, in order.
  assert "\n\n".join(a) == "\n\n".join(units)
  lengths = np.array([len(d) for d in a])
  assert lengths.min() < 512 and lengths.max() > 2048, "documents should vary in length"
  docs = load_documents(seed=3)
  assert docs == load_documents(seed=3) and docs != load_documents(seed=4)
  assert "\n\n".join(docs) == "\n\n".join(units)  # one shipped file today
  with pytest.raises(ValueError, match="max_chars"):
    group_documents(units, min_chars=100, max_chars=10)
  with pytest.raises(ValueError, match="min_chars"):
    group_documents(units, min_chars=0)


# ----------------------------------------------------------------------------- packing


def test_split_into_pieces():
  pieces = split_into_pieces([0, 5, 8, 17], 8)
  assert [(p.document, p.start, p.length) for p in pieces] == [
      (1, 0, 5), (2, 0, 8), (3, 0, 8), (3, 8, 8), (3, 16, 1)]
  with pytest.raises(ValueError, match="seq_len must be a positive int"):
    split_into_pieces([3], 0)


@pytest.mark.parametrize("seed", range(5))
def test_first_fit_decreasing(seed):
  rng = np.random.default_rng(seed)
  sizes = [int(s) for s in rng.integers(1, 101, 200)]
  bins = first_fit_decreasing(sizes, 100)
  flat = sorted(i for b in bins for i in b)
  assert flat == list(range(len(sizes))), "every item exactly once"
  assert all(sum(sizes[i] for i in b) <= 100 for b in bins), "no bin over capacity"
  assert all(b == sorted(b) for b in bins), "items in arrival order within a bin"
  # FFD's guarantee (11/9 OPT + 6/9), with OPT >= ceil(total / capacity).
  assert len(bins) <= 11 / 9 * -(-sum(sizes) // 100) + 1
  with pytest.raises(ValueError, match=r"sizes\[1\] = 101"):
    first_fit_decreasing([5, 101], 100)


@pytest.mark.parametrize("seq_len", [16, 64, 257])
@pytest.mark.parametrize("seed", range(3))
def test_pack_documents_invariants(seq_len, seed):
  docs = random_docs(seed, 30, seq_len)
  batch = pack_documents(docs, seq_len)
  check_packed(batch, seq_len)
  check_covers([batch], docs)
  # Tight enough to be worth it: at most one row more than 11/9 of the lower bound.
  total = sum(len(d) for d in docs)
  assert batch.num_seqs <= 11 / 9 * -(-total // seq_len) + 1
  assert batch.num_real_tokens == total
  # Deterministic.
  again = pack_documents(docs, seq_len)
  for name in ("tokens", "segment_ids", "positions"):
    np.testing.assert_array_equal(getattr(batch, name), getattr(again, name))
  assert batch.pieces == again.pieces


def test_pack_documents_errors():
  with pytest.raises(ValueError, match=r"documents\[0\] must be a 1-D token array"):
    pack_documents([np.zeros((2, 2), np.int32)], 8)
  with pytest.raises(TypeError, match=r"documents\[1\] must hold integer"):
    pack_documents([np.ones(3, np.int32), np.ones(3)], 8)
  with pytest.raises(ValueError, match="seq_len must be a positive int"):
    pack_documents([np.ones(3, np.int32)], 0)


def test_pack_real_corpus_is_dense():
  docs = [TOK.encode(d) for d in load_documents(seed=0)]
  batch = pack_documents(docs, 2048)
  check_packed(batch, 2048)
  check_covers([batch], docs)
  assert batch.fill > 0.98


def test_to_kvax_and_maxtext_features():
  docs = [np.array([1, 10, 11, 2], np.int32), np.array([1, 20, 2], np.int32)]
  batch = pack_documents(docs, 10)
  pos, seg = to_kvax(batch)
  np.testing.assert_array_equal(seg, [[1, 1, 1, 1, 2, 2, 2, -1, -1, -1]])
  np.testing.assert_array_equal(pos, [[0, 1, 2, 3, 0, 1, 2, 0, 0, 0]])
  assert seg.dtype == np.int32 and pos.dtype == np.int32
  with pytest.raises(ValueError, match="already in kvax convention"):
    to_kvax_segment_ids(seg)
  f = maxtext_features(batch)
  np.testing.assert_array_equal(f["inputs"], [[1, 10, 11, 2, 1, 20, 2, 0, 0, 0]])
  np.testing.assert_array_equal(f["targets"], [[10, 11, 2, 0, 20, 2, 0, 0, 0, 0]])
  np.testing.assert_array_equal(f["targets_segmentation"], [[1, 1, 1, 0, 2, 2, 0, 0, 0, 0]])
  np.testing.assert_array_equal(f["inputs_segmentation"], batch.segment_ids)


# ----------------------------------------------------------------------------- iterator


def test_batch_iterator_one_epoch_covers_everything():
  texts = ["x" * n for n in (1, 5, 30, 63, 64, 65, 200, 7, 7, 0)]
  docs = [TOK.encode(t) for t in texts]
  batches = list(batch_iterator(64, 3, seed=1, num_epochs=1, documents=texts,
                                window_batches=2, drop_remainder=False))
  for b in batches:
    assert b.num_seqs == 3
    check_packed(b, 64)
  check_covers(batches, docs)


def test_batch_iterator_deterministic_and_seeded():
  take = lambda seed: [next(it) for it in [batch_iterator(512, 2, seed=seed)] for _ in range(4)]
  a, b, c = take(0), take(0), take(1)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x.tokens, y.tokens)
    np.testing.assert_array_equal(x.segment_ids, y.segment_ids)
  assert any(not np.array_equal(x.tokens, z.tokens) for x, z in zip(a, c))
  for x in a:
    check_packed(x, 512)
    assert x.fill > 0.9


def test_batch_iterator_real_corpus_epoch():
  docs_text = load_documents(seed=2)
  batches = list(batch_iterator(1024, 4, seed=2, num_epochs=1, drop_remainder=False))
  check_covers(batches, [TOK.encode(d) for d in docs_text])
  # An endless stream keeps going past one epoch.
  it = batch_iterator(1024, 4, seed=2)
  assert sum(1 for _, _ in zip(range(len(batches) + 5), it)) == len(batches) + 5


def test_batch_iterator_errors():
  with pytest.raises(ValueError, match="batch_size must be a positive int"):
    next(batch_iterator(64, 0, documents=["a"]))
  with pytest.raises(ValueError, match="seq_len must be a positive int"):
    next(batch_iterator(0, 2, documents=["a"]))
  with pytest.raises(ValueError, match="num_epochs"):
    next(batch_iterator(64, 2, num_epochs=0, documents=["a"]))


# ----------------------------------------------------------------------------- demo


def test_demo_main_tiny(tmp_path, capsys):
  from kvax_plugin import demo
  out = tmp_path / "demo"
  summary = demo.main(["--seq_len", "256", "--batch", "2", "--heads", "4", "--kv_heads", "2",
                       "--head_dim", "32", "--repeats", "1", "--max_doc_chars", "200",
                       "--out", str(out)])
  printed = capsys.readouterr().out
  assert "agreement with the float32 dense reference" in printed
  assert summary["config"]["backend_resolved"] in ("jax", "triton")
  assert summary["agreement"]["ok"], summary["agreement"]
  tol = summary["agreement"]["tolerance_rel_l2"]
  for name in ("out", "dq", "dk", "dv"):
    t = summary["agreement"]["tensors"][name]
    assert t["finite"] and t["rel_l2"] <= tol, (name, t)
  assert len(summary["data"]["rows"]) == 2
  assert 0.0 < summary["mask"]["sparsity"]["visited"] <= 1.0
  assert summary["timing"]["forward_s"] > 0 and summary["timing"]["forward_backward_s"] > 0
  for png in summary["pngs"]:
    assert os.path.getsize(png) > 1000
    with open(png, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert (out / "mask_fwd_row0.png").exists() and (out / "mask_fwd_row1.png").exists()
  with open(out / "summary.json") as f:
    assert json.load(f)["agreement"]["ok"]


def test_demo_bad_flags(tmp_path):
  from kvax_plugin import demo
  with pytest.raises(SystemExit) as e:
    demo.main(["--heads", "3", "--kv_heads", "2", "--out", str(tmp_path)])
  assert e.value.code == 2
  with pytest.raises(SystemExit):
    demo.main(["--head_dim", "40", "--out", str(tmp_path)])


def test_demo_triton_without_gpu_is_an_error(tmp_path):
  import jax
  import kvax_plugin
  from kvax_plugin import demo
  if any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip("a GPU is visible")
  with pytest.raises(kvax_plugin.BackendUnavailableError, match="triton"):
    demo.main(["--backend", "triton", "--out", str(tmp_path)])
