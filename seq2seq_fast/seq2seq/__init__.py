"""The attention Seq2Seq application: vocabularies and data, models, decoding, checkpoints, training,
the command line and plots. Imports :mod:`seq2seq_fast.nn` and :mod:`seq2seq_fast.ops`."""
