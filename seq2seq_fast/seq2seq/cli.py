"""The ``seq2seq-fast`` command: ``train``, ``translate``, ``plot-attention``.

    seq2seq-fast train                                   # the reversal main job
    seq2seq-fast train --task translate --data fra-eng.zip
    seq2seq-fast translate --checkpoint runs/reverse/model.pt "a b c d"     [--beam 5]
    seq2seq-fast plot-attention --checkpoint runs/reverse/model.pt "a b c d" -o attention.png

Errors the user can fix (missing or corrupt checkpoint, bad corpus, bad options) print one
``error: ...`` line and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import fields

# Defaults that differ per task; anything not listed uses TrainConfig's default.
# One thread for the small reversal model: as fast as two on a 2-core CPU, and immune to the
# oversubscription slowdowns of a machine shared with other jobs.
TASK_DEFAULTS = {
    "reverse": {"threads": 1},
    "translate": {
        "embed_size": 256,
        "hidden_size": 256,
        "dropout": 0.2,
        "epochs": 10,
        "batch_size": 64,
        "lr": 2e-3,
        "warmup_steps": 200,
        "label_smoothing": 0.1,
        "decoder": "gnmt",
    },
}


def _beam(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"beam size must be an integer >= 1, got {text!r}")
    return value


def _positive_factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (default: the built-in reversal task)",
        description="Train an attention seq2seq model. Without options: the reversal main job.",
    )
    add = p.add_argument
    add("--task", choices=["reverse", "translate"], default="reverse")
    add("--data", help="translate: parallel corpus, source<TAB>target lines (.txt/.tsv or .zip)")
    add("--out", help="output folder for model.pt and attention.png (default runs/<task>)")
    add("--resume", metavar="CHECKPOINT", help="continue this checkpoint exactly")
    add("--seed", type=int)
    add("--backend", choices=["auto", "fused", "reference", "compile"],
        help="attention backend; compile = torch.compile of the whole model, fused op inside")  # fmt: skip
    g = p.add_argument_group("model")
    g.add_argument("--decoder", choices=["gnmt", "bahdanau"])
    g.add_argument("--cell", choices=["gru", "lstm"])
    g.add_argument("--embed-size", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--attention-size", type=int)
    g.add_argument("--encoder-layers", type=int)
    g.add_argument("--decoder-layers", type=int)
    g.add_argument("--bidirectional", type=_bool, metavar="BOOL")
    g.add_argument("--dropout", type=float)
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int)
    g.add_argument("--steps-per-epoch", type=int, help="reverse task: batches per epoch")
    g.add_argument("--batch-size", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--min-lr-ratio", type=float)
    g.add_argument("--clip-norm", type=float)
    g.add_argument("--label-smoothing", type=float)
    g.add_argument("--time-budget-min", type=float, help="stop training after this many minutes")
    g = p.add_argument_group("reverse task")
    g.add_argument("--vocab-size", type=int, help="number of symbols (default 32)")
    g.add_argument("--min-len", type=int, help="shortest sequence (default 8)")
    g.add_argument("--max-len", type=int, help="longest sequence (default 24)")
    g.add_argument("--heldout-size", type=int, help="held-out sequences (default 1000)")
    g = p.add_argument_group("translate task")
    g.add_argument("--direction", choices=["1-2", "2-1"],
                   help="1-2: column 1 -> column 2 (default); 2-1: the other way")  # fmt: skip
    g.add_argument("--max-words", type=int, help="drop pairs with a longer side (default 12)")
    g.add_argument("--max-pairs", type=int, help="use a fixed-seed random subset of the pairs")
    g.add_argument("--spm-vocab-size", type=int, help="sentencepiece vocabulary per side")
    g.add_argument("--normalization", choices=["NFKC", "NFC"])
    g.add_argument("--valid-fraction", type=float)
    g.add_argument("--test-fraction", type=float)
    g.add_argument("--eval-size", type=int, help="valid pairs scored after each epoch")
    g.add_argument("--eval-beam", type=int, help="beam size for the final test BLEU")
    g = p.add_argument_group("bookkeeping")
    g.add_argument("--save-every", type=int, help="also checkpoint every N steps")
    g.add_argument("--stop-after-steps", type=int, help=argparse.SUPPRESS)
    g.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    g.add_argument("--no-heatmap", dest="heatmap", action="store_false", default=None)
    g.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")


def _add_decode_options(p) -> None:
    p.add_argument("--checkpoint", required=True, help="model.pt written by seq2seq-fast train")
    p.add_argument("sentence", nargs="?", help="input sentence (default: read lines from stdin)")
    p.add_argument("--beam", type=_beam, default=1, help="beam size (1 = greedy)")
    p.add_argument("--alpha", type=float, default=0.6, help="length normalisation exponent")
    p.add_argument("--beta", type=float, default=0.0, help="coverage penalty weight")
    p.add_argument("--max-len-factor", type=_positive_factor, default=2.0,
                   help="at most ceil(factor * source length) + 1 output tokens")  # fmt: skip
    p.add_argument("--backend", choices=["auto", "fused", "reference"], default="auto")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="seq2seq-fast", description="Attention seq2seq models on fused Bahdanau attention."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_train(sub)
    p = sub.add_parser("translate", help="translate sentences with a trained checkpoint")
    _add_decode_options(p)
    p = sub.add_parser("plot-attention", help="draw the attention heatmap of one sentence")
    _add_decode_options(p)
    p.add_argument(
        "-o", "--output", default="attention.png", help="image file (default %(default)s)"
    )
    return parser


def _train(args) -> int:
    from seq2seq_fast.seq2seq.train import TrainConfig, train

    values = dict(TASK_DEFAULTS[args.task])
    for f in fields(TrainConfig):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    if args.resume:
        # Only output and run-length options apply on resume; the rest comes from the checkpoint.
        config = TrainConfig(task="reverse")
        config.out = args.out
        config.stop_after_steps = args.stop_after_steps
        config.threads = args.threads
        if args.progress is not None:
            config.progress = args.progress
        train(config, resume=args.resume)
    else:
        train(TrainConfig(**values))
    return 0


def _inputs(sentence: str | None) -> list[str]:
    if sentence is not None:
        return [sentence]
    return [line.rstrip("\n") for line in sys.stdin if line.strip()]


def _translate(args) -> int:
    from seq2seq_fast.seq2seq.checkpoint import load_model
    from seq2seq_fast.seq2seq.decoding import translate_text

    model, src_vocab, tgt_vocab, _ = load_model(args.checkpoint, backend=args.backend)
    for text in _inputs(args.sentence):
        hyp, _ = translate_text(
            model, src_vocab, tgt_vocab, text, beam=args.beam, alpha=args.alpha,
            beta=args.beta, max_len_factor=args.max_len_factor,
        )  # fmt: skip
        print(tgt_vocab.decode(hyp.tokens), flush=True)
    return 0


def _plot(args) -> int:
    from seq2seq_fast.seq2seq.checkpoint import load_model
    from seq2seq_fast.seq2seq.plot import plot_translation

    model, src_vocab, tgt_vocab, _ = load_model(args.checkpoint, backend=args.backend)
    texts = _inputs(args.sentence)
    if not texts:
        raise ValueError("no input sentence given (as an argument or on stdin)")
    path = plot_translation(model, src_vocab, tgt_vocab, texts[0], args.output, beam=args.beam)
    print(f"attention heatmap: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from seq2seq_fast.seq2seq.checkpoint import CheckpointError
    from seq2seq_fast.seq2seq.data import CorpusError
    from seq2seq_fast.seq2seq.train import TrainError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    handlers = {"train": _train, "translate": _translate, "plot-attention": _plot}
    try:
        return handlers[args.command](args)
    except (CheckpointError, CorpusError, TrainError, ValueError, OSError) as exc:
        print(f"seq2seq-fast {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
