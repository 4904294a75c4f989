"""Triton kernels, installed as ``seq2seq_fast._triton`` (never as a top-level ``triton_kernels``)."""
