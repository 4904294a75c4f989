"""The training configuration's side of the data (TrainConfig, duck-typed: no import of
config.py): whether the token store is used, which data options go together, the tokenizers
asked for, the cache folder, and the corpus opened for a training job."""

from __future__ import annotations

import os
from pathlib import Path

from seq2seq_fast.seq2seq.data.corpus import TranslationData
from seq2seq_fast.seq2seq.data.files import CorpusFiles
from seq2seq_fast.seq2seq.data.staging import Log
from seq2seq_fast.seq2seq.data.store import load_store_corpus
from seq2seq_fast.seq2seq.data.stream import Options
from seq2seq_fast.seq2seq.data.tokenizers import TokenizerSpec, given_tokenizers
from seq2seq_fast.seq2seq.data.vocab import check_vocab_fits

_TOKENIZER_OPTIONS = ("spm", "src_spm", "tgt_spm", "src_vocab_file", "tgt_vocab_file")


_FLAG = {"src_vocab_file": "--src-vocab", "tgt_vocab_file": "--tgt-vocab"}


def _flag(name: str) -> str:
    return _FLAG.get(name, "--" + name.replace("_", "-"))


# A --data file bigger than this (not a .zip) goes through the token store by itself: read in
# memory it would take many times its size (bench/RESULTS.md, "Figures formerly in code comments").
BIG_CORPUS_BYTES = 100 * 2**20


def uses_token_store(config) -> bool:
    """The token store is used for a two-file corpus, with any tokenizer option, and for a
    --data file over BIG_CORPUS_BYTES; a smaller --data alone is read in memory as before;
    ``token_store`` True/False forces either."""
    if config.token_store is not None:
        return bool(config.token_store)
    if (
        config.src
        or config.share_vocab
        or config.cache_dir
        or any(getattr(config, n) for n in _TOKENIZER_OPTIONS)
    ):
        return True
    data = Path(config.data) if config.data else None
    try:
        return bool(
            data and data.suffix.lower() != ".zip" and data.stat().st_size > BIG_CORPUS_BYTES
        )
    except OSError:
        return False  # the in-memory reader names the problem


def check_data_options(config) -> None:
    """ValueError naming the options when the data options do not go together."""
    given = [
        n
        for n in (
            "src",
            "tgt",
            "valid_src",
            "valid_tgt",
            "test_src",
            "test_tgt",
            *_TOKENIZER_OPTIONS,
            "share_vocab",
            "cache_dir",
            "token_store",
        )
        if getattr(config, n) not in (None, False)
    ]
    if config.task != "translate" and given:
        raise ValueError(f"{', '.join(_flag(n) for n in given)}: for --task translate")
    for a, b in (("src", "tgt"), ("valid_src", "valid_tgt"), ("test_src", "test_tgt")):
        if bool(getattr(config, a)) != bool(getattr(config, b)):
            have, lack = (a, b) if getattr(config, a) else (b, a)
            raise ValueError(
                f"{_flag(have)} needs {_flag(lack)} (a two-file corpus: one file a side)"
            )
    if config.src and config.data:
        raise ValueError("--data and --src/--tgt both given: one training corpus")
    if config.valid_src and config.valid_data:
        raise ValueError("--valid-data and --valid-src/--valid-tgt both given: one validation set")
    if config.test_src and config.test_data:
        raise ValueError("--test-data and --test-src/--test-tgt both given: one test set")
    if config.test_src and not (config.valid_src or config.valid_data):
        raise ValueError(
            "--test-src/--test-tgt need a validation split too (--valid-src/"
            "--valid-tgt or --valid-data)"
        )
    if config.spm and (config.src_spm or config.tgt_spm):
        raise ValueError("--spm (one model for both sides) and --src-spm/--tgt-spm both given")
    for side in ("src", "tgt"):
        if (config.spm or getattr(config, f"{side}_spm")) and getattr(config, f"{side}_vocab_file"):
            raise ValueError(
                f"{_flag(side + '_vocab_file')} and a sentencepiece model both "
                f"given for the {side} side: one tokenizer a side"
            )
    if config.token_store is False and (
        config.src or any(getattr(config, n) for n in _TOKENIZER_OPTIONS)
    ):
        raise ValueError(
            "--token-store off: two-file corpora and tokenizer files are read "
            "through the token store"
        )
    if config.spm_sample_size < 0:
        raise ValueError(f"spm_sample_size must be >= 0, got {config.spm_sample_size}")
    if config.max_held_out < 1:
        raise ValueError(f"max_held_out must be >= 1, got {config.max_held_out}")


def tokenizer_spec(config) -> TokenizerSpec:
    return TokenizerSpec(
        src_spm=config.spm or config.src_spm,
        tgt_spm=config.spm or config.tgt_spm,
        src_vocab=config.src_vocab_file,
        tgt_vocab=config.tgt_vocab_file,
        share=bool(config.share_vocab or config.spm),
        vocab_size=config.spm_vocab_size,
        sample_size=config.spm_sample_size or 1 << 62,
    )


def default_cache_dir() -> Path:
    """Where token stores and trained tokenizers are kept without --cache-dir: shared by every
    run of this user, so a new --out on the same corpus reuses them. ``$SEQ2SEQ_FAST_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/seq2seq-fast``, else ``~/.cache/seq2seq-fast``."""
    env = os.environ.get("SEQ2SEQ_FAST_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():  # a relative one is to be ignored (the XDG spec)
        return Path(xdg) / "seq2seq-fast"
    return Path.home() / ".cache" / "seq2seq-fast"


def open_store_corpus(
    config, *, vocabs=None, rank: int = 0, world_size: int = 1, log: Log = print
) -> TranslationData:
    """The training job's corpus through the token store (see :func:`load_store_corpus`)."""
    swap = config.direction == "2-1"
    if config.src:
        files = CorpusFiles(config.tgt, config.src) if swap else CorpusFiles(config.src, config.tgt)
    else:
        files = CorpusFiles(config.data, swap=swap)

    def pair(a: str | None, b: str | None) -> tuple[str | None, str | None]:
        return (b, a) if swap and b is not None else (a, b)

    valid = (
        pair(config.valid_src, config.valid_tgt) if config.valid_src else (config.valid_data, None)
    )
    test = pair(config.test_src, config.test_tgt) if config.test_src else (config.test_data, None)
    options = Options(
        normalization=config.normalization,
        max_words=config.max_words or None,  # (0: every pair)
        max_pairs=config.max_pairs,
        seed=config.seed,
        valid_fraction=config.valid_fraction,
        test_fraction=config.test_fraction,
        max_held_out=config.max_held_out,
    )
    barrier = None
    if world_size > 1:
        import torch.distributed as dist

        barrier = dist.barrier
    if config.cache_dir:
        cache_dir = Path(config.cache_dir).expanduser()
        log(f"corpus cache: {cache_dir} (--cache-dir)")
    else:
        cache_dir = default_cache_dir()
        log(f"corpus cache: {cache_dir} (the per-user default; --cache-dir to change)")
    return load_store_corpus(
        files,
        tokenizer_spec(config),
        options,
        cache_dir,
        vocabs=vocabs,
        valid=valid,
        test=test,
        rank=rank,
        barrier=barrier,
        progress=config.progress,
        log=log,
    )


def check_tokenizers_fit(config, payload: dict, checkpoint: str) -> None:
    """Tokenizer files given together with a checkpoint (``--resume``; fine-tuning) must be the
    vocabularies its model was trained with: CorpusError naming the file and what differs."""
    if not any(getattr(config, n, None) for n in _TOKENIZER_OPTIONS):
        return
    spec = tokenizer_spec(config)
    given = given_tokenizers(spec)
    sources = (spec.src_spm or spec.src_vocab, spec.tgt_spm or spec.tgt_vocab)
    for side, vocab, source, key in zip(
        ("source", "target"), given, sources, ("src_vocab", "tgt_vocab"), strict=True
    ):
        if vocab is not None:
            check_vocab_fits(vocab, payload[key], side=side, source=source, checkpoint=checkpoint)
