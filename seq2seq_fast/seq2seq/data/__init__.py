"""The data side of the Seq2Seq: vocabularies, corpus reading, the on-disk token store, batching
and the tasks a training job draws its batches from (one module per concern; import from the
module, this package re-exports nothing)."""
