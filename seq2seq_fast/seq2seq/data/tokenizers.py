"""Each side's tokenizer for the token store: the user's sentencepiece model or vocabulary file,
or a sentencepiece model trained on a seeded sample of the training split and cached beside the
stores (keyed like them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from seq2seq_fast.seq2seq.atomic import atomic_write
from seq2seq_fast.seq2seq.data.corpus import CorpusReport
from seq2seq_fast.seq2seq.data.errors import CorpusError
from seq2seq_fast.seq2seq.data.files import CorpusFiles, key_digest
from seq2seq_fast.seq2seq.data.split import SplitRule
from seq2seq_fast.seq2seq.data.staging import Log, exclusive
from seq2seq_fast.seq2seq.data.stream import Options, clean_pairs, plan_split
from seq2seq_fast.seq2seq.data.vocab import (
    SentencePieceVocab,
    read_spm_model,
    read_vocab_file,
    vocab_digest,
)

SPM_SAMPLE_SIZE = 100_000  # default pairs the sentencepiece models are trained on


def sample_sentences(
    files: CorpusFiles,
    lines: int,
    options: Options,
    rule: SplitRule,
    size: int,
    progress: bool = False,
) -> tuple[list[str], list[str]]:
    """A seeded random sample of about ``size`` training pairs (held-out ones left out), as
    (sources, targets): what the sentencepiece models are trained on."""
    rng = np.random.default_rng(options.seed + 17)
    chosen = None
    if lines > size:
        chosen = np.zeros(lines + 1, dtype=bool)
        chosen[1 + rng.choice(lines, size=size, replace=False)] = True
    sources, targets = [], []
    report = CorpusReport(files.name)
    for side, src, tgt in clean_pairs(
        files, lines, options, rule, report, progress, "sampling", only=chosen
    ):
        if side == 0:
            sources.append(src)
            targets.append(tgt)
    return sources, targets


@dataclass
class TokenizerSpec:
    """Where each side's tokenizer comes from: a sentencepiece model file, a vocabulary file, or
    (neither) a sentencepiece model trained on a sample of the training split."""

    src_spm: str | None = None
    tgt_spm: str | None = None
    src_vocab: str | None = None
    tgt_vocab: str | None = None
    share: bool = False
    vocab_size: int = 4000
    sample_size: int = SPM_SAMPLE_SIZE


def given_tokenizers(spec: TokenizerSpec):
    cache: dict[tuple[str, str], object] = {}

    def load(kind: str, path: str | None):
        if path is None:
            return None
        key = (kind, str(Path(path).resolve()))
        if key not in cache:
            cache[key] = read_spm_model(path) if kind == "spm" else read_vocab_file(path)
        return cache[key]

    for side in ("src", "tgt"):
        if getattr(spec, f"{side}_spm") and getattr(spec, f"{side}_vocab"):
            raise CorpusError(f"--{side}-spm and --{side}-vocab both given: one tokenizer a side")
    return (
        load("spm", spec.src_spm) or load("vocab", spec.src_vocab),
        load("spm", spec.tgt_spm) or load("vocab", spec.tgt_vocab),
    )


def resolve_tokenizers(
    spec: TokenizerSpec,
    files: CorpusFiles,
    count: Callable[[], int],
    options: Options,
    cache_dir: Path,
    identity: dict,
    *,
    plan: Callable[[], SplitRule] | None = None,
    progress: bool = False,
    log: Log = print,
):
    """-> (source vocabulary, target vocabulary); the same object twice when shared. Trained
    sentencepiece models are cached beside the stores (keyed like them: the corpus's identity and
    the options), so a second run neither re-reads the corpus nor trains again. ``count()``: the
    corpus's line count; ``plan()``: the held-out sets (the sample is of the training split)."""
    src, tgt = given_tokenizers(spec)
    if spec.share:
        if src is not None and tgt is not None and vocab_digest(src) != vocab_digest(tgt):
            raise CorpusError(
                "--share-vocab needs one vocabulary for both sides: give --spm, or the same file "
                f"to both sides (got {spec.src_spm or spec.src_vocab} and "
                f"{spec.tgt_spm or spec.tgt_vocab})"
            )
        src = tgt = src or tgt
    if src is not None and tgt is not None:
        return src, tgt
    wanted = ["shared"] if spec.share else [s for s, v in (("src", src), ("tgt", tgt)) if v is None]
    key = key_digest(
        {
            "identity": identity,
            "options": asdict(options),
            "size": spec.vocab_size,
            "sample": spec.sample_size,
            "wanted": wanted,
            "split": 2,  # the held-out sets chosen by source groups
        }
    )
    paths = {w: cache_dir / f"spm-{key}.{w}.model" for w in wanted}
    trained = {}
    if not all(p.exists() for p in paths.values()):
        with exclusive(cache_dir / f".lock-spm-{key}", "the sentencepiece models", log):
            if not all(p.exists() for p in paths.values()):  # else trained meanwhile
                trained = _train_spm(spec, files, count, options, paths, plan, progress, log)
    if not trained:
        for w, p in paths.items():
            trained[w] = SentencePieceVocab(p.read_bytes())
        log(f"sentencepiece model(s) from the cache: {', '.join(str(p) for p in paths.values())}")
    if spec.share:
        return trained["shared"], trained["shared"]
    return src or trained["src"], tgt or trained["tgt"]


def _train_spm(spec, files, count, options, paths, plan, progress, log) -> dict:
    lines = count()
    rule = plan() if plan is not None else plan_split(files, lines, options, progress)
    sources, targets = sample_sentences(files, lines, options, rule, spec.sample_size, progress)
    if not sources:
        raise CorpusError(f"no usable training pair in {files.name} to train a tokenizer on")
    texts = {"shared": sources + targets, "src": sources, "tgt": targets}
    trained = {}
    for w, path in paths.items():
        log(
            f"training a {spec.vocab_size}-piece sentencepiece model ({w}) on "
            f"{len(texts[w])} sampled sentences"
        )
        vocab = SentencePieceVocab.train(texts[w], spec.vocab_size)
        atomic_write(path, vocab.model_proto)
        trained[w] = vocab
    return trained
