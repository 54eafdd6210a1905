"""Real text for packed-document attention: a shipped public-domain corpus, a byte tokenizer,
first-fit-decreasing packing with segment ids and positions, and a batch iterator.

These modules use numpy only (importing them still imports the kvax_plugin package, and so
JAX); the attention code is not needed to build batches.
"""

from kvax_plugin.data.corpus import (corpus_files, group_documents, load_documents, read_text,
                                     split_entries)
from kvax_plugin.data.packing import (PackedBatch, Piece, batch_iterator, first_fit_decreasing,
                                      maxtext_features, pack_documents, split_into_pieces,
                                      to_kvax, to_kvax_segment_ids)
from kvax_plugin.data.tokenizer import (BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, ByteTokenizer)

__all__ = [
    "corpus_files", "read_text", "split_entries", "group_documents", "load_documents",
    "ByteTokenizer", "PAD_ID", "BOS_ID", "EOS_ID", "VOCAB_SIZE",
    "Piece", "PackedBatch", "split_into_pieces", "first_fit_decreasing", "pack_documents",
    "to_kvax", "to_kvax_segment_ids", "maxtext_features", "batch_iterator",
]
