"""The ``seq2seq-fast`` command: ``train``, ``translate``, ``plot-attention``, ``export``.

    seq2seq-fast train                                   # the reversal main job
    seq2seq-fast train --task translate --data fra-eng.zip
    seq2seq-fast translate --checkpoint runs/reverse/model.pt "a b c d"     [--beam 5]
    seq2seq-fast translate --checkpoint model.pt --input test.en --output test.fr --beam 5
    seq2seq-fast plot-attention --checkpoint runs/reverse/model.pt "a b c d" -o attention.png
    seq2seq-fast export --checkpoint model.pt -o model.infer.pt --dtype float16
    seq2seq-fast export --checkpoint runs/translate/model.epoch*.pt -o averaged.pt

Errors the user can fix (missing or corrupt checkpoint, bad corpus, bad options) print one
``error: ...`` line and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, fields

from seq2seq_fast.nn.attention import BACKENDS
from seq2seq_fast.seq2seq.config import TASK_DEFAULTS, TrainConfig
from seq2seq_fast.seq2seq.decoding import DecodeOptions

# translate on CPU: batches decoded at once (Translator workers), at most this many.
MAX_DECODE_WORKERS = 4


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


def _add_config_options(p) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of options (names as the flags'); flags given override it",
    )
    p.add_argument(
        "--dump-config",
        action="store_true",
        help="print the resolved configuration as YAML and exit",
    )


def _add_train(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="train a model (default: the built-in reversal task)",
        description="Train an attention seq2seq model. Without options: the reversal main job.",
    )
    _add_config_options(p)
    add = p.add_argument
    add("--task", choices=list(TASK_DEFAULTS))
    add("--data", help="translate: parallel corpus, source<TAB>target lines (.txt/.tsv or .zip)")
    add("--out", help="output folder for model.pt and attention.png (default runs/<task>)")
    add("--resume", metavar="CHECKPOINT", help="continue this checkpoint exactly")
    add(
        "--init-from",
        metavar="CHECKPOINT",
        help="fine-tune: start from this checkpoint's weights and vocabularies, with a fresh "
        "optimiser and schedule (its model shape must match)",
    )
    add("--seed", type=int)
    add(
        "--backend",
        choices=[*BACKENDS, "compile"],
        help="attention backend (compile: the same as --compile, kept as an alias)",
    )
    add(
        "--compile",
        action="store_true",
        default=None,
        help="torch.compile the whole model, RNN layers and attention in one graph",
    )
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
    g.add_argument(
        "--output-layer",
        choices=["concat", "attentional"],
        help="softmax input: [s; c] itself, or tanh(W [s; c]) of hidden width",
    )
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int)
    g.add_argument("--steps-per-epoch", type=int, help="reverse task: batches per epoch")
    g.add_argument("--batch-size", type=int, help="pairs per batch")
    g.add_argument(
        "--batch-tokens",
        type=int,
        metavar="N",
        help="translate: instead, batches of length-similar pairs of at most N padded "
        "tokens (pairs x max(source, target+1) widths)",
    )
    g.add_argument(
        "--accum-steps",
        type=int,
        metavar="N",
        help="sum the gradients of N batches per optimiser step (a batch N times "
        "larger, in one batch's memory)",
    )
    g.add_argument("--lr", type=float)
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--min-lr-ratio", type=float)
    g.add_argument("--clip-norm", type=float)
    g.add_argument("--label-smoothing", type=float)
    g.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        help="bf16: autocast with fp32 master weights (fp32 where the CPU lacks AVX512-BF16/AMX)",
    )
    g.add_argument("--time-budget-min", type=float, help="stop training after this many minutes")
    g = p.add_argument_group("reverse task")
    g.add_argument("--vocab-size", type=int, help="number of symbols (default 32)")
    g.add_argument("--min-len", type=int, help="shortest sequence (default 8)")
    g.add_argument("--max-len", type=int, help="longest sequence (default 24)")
    g.add_argument("--heldout-size", type=int, help="held-out sequences (default 1000)")
    g = p.add_argument_group("translate task")
    g.add_argument(
        "--direction",
        choices=["1-2", "2-1"],
        help="1-2: column 1 -> column 2 (default); 2-1: the other way",
    )
    g.add_argument("--max-words", type=int, help="drop pairs with a longer side (default: all)")
    g.add_argument("--max-pairs", type=int, help="use a fixed-seed random subset of the pairs")
    g.add_argument("--spm-vocab-size", type=int, help="sentencepiece vocabulary per side")
    g.add_argument("--normalization", choices=["NFKC", "NFC"])
    g.add_argument("--valid-fraction", type=float)
    g.add_argument("--test-fraction", type=float)
    g.add_argument(
        "--valid-data",
        metavar="PATH",
        help="official validation split: used as given, and --data is then the "
        "training split (not split again)",
    )
    g.add_argument(
        "--test-data",
        metavar="PATH",
        help="official test split (with --valid-data): the final test BLEU",
    )
    g = p.add_argument_group(
        "own data and tokenizers",
        "A two-file corpus (one sentence a line, line i of one translating line i of the other) "
        "and any tokenizer option are read through an on-disk token store: encoded once, "
        "memory-mapped, reused by the next run with the same files and tokenizers.",
    )
    g.add_argument("--src", metavar="FILE", help="training source sentences, one a line")
    g.add_argument("--tgt", metavar="FILE", help="training target sentences, line by line")
    g.add_argument("--valid-src", metavar="FILE", help="official validation split, source side")
    g.add_argument("--valid-tgt", metavar="FILE", help="official validation split, target side")
    g.add_argument("--test-src", metavar="FILE", help="official test split, source side")
    g.add_argument("--test-tgt", metavar="FILE", help="official test split, target side")
    g.add_argument(
        "--spm",
        metavar="MODEL",
        help="an existing sentencepiece model for both sides (a shared vocabulary)",
    )
    g.add_argument("--src-spm", metavar="MODEL", help="an existing sentencepiece model, source")
    g.add_argument("--tgt-spm", metavar="MODEL", help="an existing sentencepiece model, target")
    g.add_argument(
        "--src-vocab",
        dest="src_vocab_file",
        metavar="FILE",
        help="pre-tokenised source text: its vocabulary, one token a line (or token<TAB>count)",
    )
    g.add_argument(
        "--tgt-vocab",
        dest="tgt_vocab_file",
        metavar="FILE",
        help="pre-tokenised target text: its vocabulary file",
    )
    g.add_argument(
        "--share-vocab",
        action="store_true",
        default=None,
        help="one vocabulary for both sides (trained on both when not given)",
    )
    g.add_argument(
        "--tie-embeddings",
        action="store_true",
        default=None,
        help="the decoder's output projection is its input embedding; with a shared "
        "vocabulary the encoder's embedding too",
    )
    g.add_argument(
        "--token-store",
        type=_bool,
        metavar="BOOL",
        help="the on-disk token store on or off (default: on for --src/--tgt, with a "
        "tokenizer option, and for a --data file over 100 MB)",
    )
    g.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where token stores and trained tokenizers are kept (default $SEQ2SEQ_FAST_CACHE_DIR, "
        "else $XDG_CACHE_HOME/seq2seq-fast, else ~/.cache/seq2seq-fast: shared by runs)",
    )
    g.add_argument(
        "--spm-sample-size",
        type=int,
        metavar="N",
        help="train sentencepiece on a random sample of N pairs "
        f"(default {TrainConfig.spm_sample_size}; 0: all)",
    )
    g.add_argument(
        "--max-held-out",
        type=int,
        metavar="N",
        help="valid and test sets carved from one file: at most N pairs each "
        f"(default {TrainConfig.max_held_out})",
    )
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-size", type=int, help="valid pairs scored after each epoch")
    g.add_argument("--eval-beam", type=int, help="beam size for the final test BLEU")
    g.add_argument(
        "--eval-every",
        type=int,
        help="also evaluate every N steps; a new best score writes best.pt",
    )
    g.add_argument(
        "--patience", type=int, help="stop after N evaluations without a new best (default: never)"
    )
    g = p.add_argument_group("bookkeeping")
    g.add_argument("--save-every", type=int, help="also checkpoint every N steps")
    g.add_argument(
        "--keep-checkpoints",
        type=int,
        metavar="N",
        help="keep the weights of the last N epochs as model.epochE.pt, to average with export",
    )
    g.add_argument("--stop-after-steps", type=int, help=argparse.SUPPRESS)
    g.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    g.add_argument("--no-heatmap", dest="heatmap", action="store_false", default=None)
    g.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    g.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="also write the metrics as TensorBoard events to DIR (needs the "
        "tensorboard package; metrics.jsonl is always written)",
    )
    return p


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _add_decode_options(p) -> None:
    p.add_argument(
        "--checkpoint",
        help="model.pt written by seq2seq-fast train, or an exported model (required)",
    )
    p.add_argument("sentence", nargs="?", help="input sentence (default: read lines from stdin)")
    # No defaults here: DecodeOptions holds them (and builds the options from those given).
    p.add_argument("--beam", type=_beam, help=f"beam size (default {DecodeOptions.beam}: greedy)")
    p.add_argument(
        "--alpha", type=float, help=f"length normalisation exponent (default {DecodeOptions.alpha})"
    )
    p.add_argument(
        "--beta", type=float, help=f"coverage penalty weight (default {DecodeOptions.beta})"
    )
    p.add_argument(
        "--max-len-factor",
        type=_positive_factor,
        help="at most ceil(factor * source length) + 1 output tokens (default "
        f"{DecodeOptions.max_len_factor})",
    )
    p.add_argument("--backend", choices=["auto", "fused", "reference"], default="auto")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--threads",
        type=_positive_int,
        help="CPU threads (default: torch's count); translate decodes up to 4 "
        "batches at once, sharing the threads",
    )


def _add_translate(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "translate",
        help="translate sentences with a trained checkpoint",
        description="Translate one sentence, or a file (--input, or stdin) line by line: exactly "
        "one output line per input line (an empty or over-long line gives an empty line and a "
        "warning on stderr), sentences decoded in length-sorted batches.",
    )
    _add_decode_options(p)
    _add_config_options(p)
    add = p.add_argument
    add("-i", "--input", help="file of sentences, one a line, UTF-8 (default: stdin)")
    add("-o", "--output", help="write translations here (default: stdout)")
    add(
        "--n-best",
        type=_positive_int,
        help="write the N best hypotheses per line as text<TAB>score (N lines per input)",
    )
    add(
        "--batch-size",
        type=_positive_int,
        help="sentences per batch (default: 320 // beam, i.e. ~320 decoder rows)",
    )
    add(
        "--max-tokens",
        type=_positive_int,
        help="also at most this many source tokens (padding included) per batch",
    )
    add(
        "--max-source-tokens",
        type=_positive_int,
        default=256,
        help="longer lines are skipped with a warning (default 256 subword tokens)",
    )
    add("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def _add_export(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write an inference-only model file (weights and vocabularies)",
        description="Write the weights and vocabularies of a checkpoint, without optimiser state, "
        "for translate and plot-attention (it cannot be resumed).",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        nargs="+",
        metavar="PATH",
        help="model.pt written by seq2seq-fast train; several (e.g. the model.epoch*.pt "
        "of train --keep-checkpoints): their weights averaged",
    )
    p.add_argument("-o", "--output", required=True, help="file to write, e.g. model.infer.pt")
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float32",
        help="storage type of the floating-point weights (computation stays float32)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="seq2seq-fast", description="Attention seq2seq models on fused Bahdanau attention."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.set_defaults(commands={"train": _add_train(sub), "translate": _add_translate(sub)})
    p = sub.add_parser("plot-attention", help="draw the attention heatmap of one sentence")
    _add_decode_options(p)
    p.add_argument(
        "-o", "--output", default="attention.png", help="image file (default %(default)s)"
    )
    _add_export(sub)
    return parser


CONFIG_OPTIONS = ("config", "dump_config")


def _given(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The options given on the command line (not left at their defaults): ``argv`` parsed
    again with every default of the command's options suppressed."""
    args = parser.parse_args(argv)
    sub = args.commands[args.command]
    saved = [(action, action.default) for action in sub._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        given = parser.parse_args(argv)
    finally:
        for action, default in saved:
            action.default = default
    return set(vars(given)) - {"command", "commands"}


def apply_config_file(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None
) -> None:
    """Fill ``args`` from ``--config FILE``: every key of the file whose option was not given
    on the command line (flags override the file). Unknown keys: ConfigFileError naming it."""
    from seq2seq_fast.seq2seq.configfile import read_config_file

    if getattr(args, "config", None) is None:
        return
    if args.command == "train":
        if args.resume:
            raise ValueError("--config is for new runs; --resume takes the checkpoint's options")
        allowed = {f.name for f in fields(TrainConfig)}
    else:
        sub = args.commands[args.command]
        allowed = {a.dest for a in sub._actions if a.dest not in ("help", *CONFIG_OPTIONS)}
    given = _given(parser, argv)
    actions = args.commands[args.command]._actions
    for name, value in read_config_file(args.config, allowed, actions).items():
        if name not in given:
            setattr(args, name, value)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The job ``seq2seq-fast train`` runs: the options given, every other field its task's
    default (:class:`TrainConfig` resolves those, as it does in Python)."""
    values = {
        f.name: getattr(args, f.name)
        for f in fields(TrainConfig)
        if getattr(args, f.name, None) is not None
    }
    if values.get("backend") == "compile":  # the old spelling of --compile
        values["backend"], values["compile"] = "auto", True
    corpus = [f"--{name}" for name in ("data", "src", "tgt") if values.get(name) is not None]
    if corpus and values.get("task") is None:
        values["task"] = "translate"  # a corpus means translation, never the reversal job
    elif corpus and values.get("task") == "reverse":
        raise ValueError(
            f"{' and '.join(corpus)} given with --task reverse, whose data is built in: "
            "use --task translate (or leave --task out) to train on a corpus"
        )
    return TrainConfig(**values)


def _train(args) -> int:
    from seq2seq_fast.seq2seq.train import train

    if args.dump_config:
        from seq2seq_fast.seq2seq.configfile import dump_config

        if args.resume:  # what the run continues with: the checkpoint's options
            from seq2seq_fast.seq2seq.checkpoint import load_checkpoint

            values = dict(load_checkpoint(args.resume).get("train_config") or {})
        else:
            values = asdict(train_config(args))
        sys.stdout.write(dump_config(values))
        return 0
    if args.resume:
        # Only output and run-length options apply on resume; the rest comes from the checkpoint.
        config = TrainConfig(task="reverse")
        config.out = args.out
        config.stop_after_steps = args.stop_after_steps
        config.threads = args.threads
        for name in ("spm", "src_spm", "tgt_spm", "src_vocab_file", "tgt_vocab_file"):
            setattr(config, name, getattr(args, name))  # checked against the checkpoint's
        if args.progress is not None:
            config.progress = args.progress
        train(config, resume=args.resume)
    else:
        train(train_config(args))
    return 0


def _translator(args, **kwargs):
    """Load the checkpoint once, on the device and thread count asked for."""
    import torch

    if args.checkpoint is None:
        raise ValueError(f"{args.command} needs --checkpoint PATH (or checkpoint: in --config)")
    from seq2seq_fast.seq2seq.translate import Translator

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available here")
    threads = args.threads or torch.get_num_threads()
    workers = 1
    if args.device == "cpu" and threads > 1 and args.command == "translate":
        # Batches at once, each on threads // workers intra-op threads: decoding's per-step
        # products are too small for intra-op threads (workers of 1 thread beat intra-op threads,
        # outputs identical; bench/RESULTS.md). At most MAX_DECODE_WORKERS, so that the
        # searches' Python work (the GIL) does not serialise many of them: measured on 2 cores.
        workers = min(threads, MAX_DECODE_WORKERS)
        torch.set_num_threads(threads // workers)
    elif args.threads is not None:
        torch.set_num_threads(args.threads)
    return Translator.load(
        args.checkpoint,
        backend=args.backend,
        device=args.device,
        options=decode_options(args),
        workers=workers,
        **kwargs,
    )


def decode_options(args: argparse.Namespace) -> DecodeOptions:
    """The search the options ask for; a bad combination raises ValueError naming the flags."""
    given = {name: getattr(args, name, None) for name in DecodeOptions.__dataclass_fields__}
    given.pop("max_len", None)  # no flag
    try:
        return DecodeOptions(**{name: value for name, value in given.items() if value is not None})
    except ValueError as exc:
        flags = re.sub(
            r"\b(n_best|beam|max_len_factor|alpha|beta)\b",
            lambda m: "--" + m.group(1).replace("_", "-"),
            str(exc),
        )
        raise ValueError(flags) from None


def _warn(args, message: str) -> None:
    print(f"seq2seq-fast {args.command}: warning: {message}", file=sys.stderr)


def _output_lines(result, n_best: int | None) -> list[str]:
    """The lines written for one input: the best text, or n_best lines of text<TAB>score."""
    if n_best is None:
        return [result.text]
    lines = [
        f"{text}\t{hyp.score:.6f}"
        for text, hyp in zip(result.texts, result.hypotheses, strict=True)
    ]
    return lines + [""] * (n_best - len(lines))


def translate_settings(args: argparse.Namespace) -> dict:
    """The resolved options of ``translate`` (what --dump-config prints), decoding options
    with their defaults filled in."""
    sub = args.commands["translate"]
    values = {
        a.dest: getattr(args, a.dest, None)
        for a in sub._actions
        if a.dest not in ("help", *CONFIG_OPTIONS)
    }
    options = decode_options(args)
    values.update({k: getattr(options, k) for k in values if hasattr(options, k)})
    return values


def _translate(args) -> int:
    import os

    from seq2seq_fast.seq2seq.translate import CHUNK_LINES, iter_chunks

    if args.dump_config:
        from seq2seq_fast.seq2seq.configfile import dump_config

        sys.stdout.write(dump_config(translate_settings(args)))
        return 0
    if args.sentence is not None and args.input is not None:
        raise ValueError("give either a sentence or --input FILE, not both")
    translator = _translator(
        args,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        max_source_tokens=args.max_source_tokens,
    )
    if args.sentence is not None:
        result = translator.translate([args.sentence])[0]
        if not result.source_ids:
            raise ValueError("the input sentence is empty")
        if result.warning:
            _warn(args, result.warning.replace("line 1: ", ""))
        print("\n".join(_output_lines(result, args.n_best)), flush=True)
        return 0
    if args.input is None and sys.stdin.isatty():  # typed: translate each line as it comes
        for line in sys.stdin:
            result = translator.translate([line.rstrip("\n")])[0]
            print("\n".join(_output_lines(result, args.n_best)), flush=True)
        return 0
    chunk = os.environ.get("SEQ2SEQ_FAST_TRANSLATE_CHUNK", "")  # lines at a time (tests)
    if chunk and not (chunk.isdigit() and int(chunk) > 0):
        raise ValueError(f"SEQ2SEQ_FAST_TRANSLATE_CHUNK={chunk}: not a number of lines >= 1")
    return _translate_lines(
        args, translator, iter_chunks(args.input, int(chunk) if chunk else CHUNK_LINES)
    )


def _translate_lines(args, translator, chunks) -> int:
    """Translate the input's lines a chunk at a time (``chunks``: :class:`Chunk` s, in order,
    each decoded in length-sorted batches) and write exactly one result per line (n_best with
    --n-best), in input order, each chunk's lines flushed before the next chunk is read: memory
    stays bounded and output comes as the input does (a pipeline). -o FILE is written to a
    temporary file beside it, renamed over FILE at the end, so that an interrupted run leaves no
    complete-looking file."""
    import os
    import tempfile
    import time

    from tqdm import tqdm

    from seq2seq_fast.seq2seq.translate import count_lines

    started = time.perf_counter()
    show = bool(args.progress and args.input is not None)
    handle = temporary = None
    if args.output is not None:
        target = os.path.abspath(args.output)
        fd, temporary = tempfile.mkstemp(
            dir=os.path.dirname(target), prefix=f".{os.path.basename(target)}.", suffix=".tmp"
        )
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(fd, 0o666 & ~umask)  # as open() would make it, not mkstemp's 0600
        handle = os.fdopen(fd, "w", encoding="utf-8", newline="\n")
    out = sys.stdout if handle is None else handle
    sentences = tokens = 0
    try:
        with tqdm(
            total=count_lines(args.input) if show else None,
            unit="sent",
            file=sys.stderr,
            dynamic_ncols=True,
            leave=False,
            disable=not show,
        ) as bar:
            for chunk in chunks:
                results = translator.translate(chunk.texts, progress=bar.update)
                out.write(
                    "".join(
                        line + "\n"
                        for result in results
                        for line in _output_lines(result, args.n_best)
                    )
                )
                out.flush()
                for i, result in enumerate(results):
                    number = chunk.first + i
                    for message in (chunk.warnings.get(i), result.warning):
                        if message:  # the Translator numbers a chunk's lines from 1
                            _warn(args, re.sub(r"^line \d+:", f"line {number}:", message))
                sentences += len(results)
                tokens += sum(result.tokens for result in results)
        if handle is not None:
            handle.close()
            os.replace(temporary, args.output)
            temporary = None
    finally:
        if temporary is not None:  # failed or interrupted: no output file, complete-looking or not
            handle.close()
            os.unlink(temporary)
    seconds = time.perf_counter() - started
    print(
        f"{sentences} sentences, {tokens} tokens in {seconds:.2f} s "
        f"({tokens / max(seconds, 1e-9):,.0f} tokens/s)",
        file=sys.stderr,
    )
    return 0


def _plot(args) -> int:
    from seq2seq_fast.seq2seq.plot import plot_result

    translator = _translator(args)
    if args.sentence is not None:
        text = args.sentence
    else:
        texts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
        if not texts:
            raise ValueError("no input sentence given (as an argument or on stdin)")
        text = texts[0]
    result = translator.translate([text])[0]
    if not result.source_ids:
        raise ValueError("the input sentence is empty")
    if result.warning:
        raise ValueError(result.warning.replace("line 1: ", "the input sentence: "))
    path = plot_result(result, translator.src_vocab, translator.tgt_vocab, text, args.output)
    print(f"attention heatmap: {path}")
    return 0


def _export(args) -> int:
    from seq2seq_fast.seq2seq.checkpoint import export_inference

    size, source_size = export_inference(args.checkpoint, args.output, dtype=args.dtype)
    count = len(args.checkpoint)
    what = f"the average of {count} checkpoints; the last is" if count > 1 else "the checkpoint is"
    print(
        f"wrote {args.output}: {size / 1e6:.1f} MB ({args.dtype} weights and vocabularies; "
        f"{what} {source_size / 1e6:.1f} MB)"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from seq2seq_fast.seq2seq.checkpoint import CheckpointError
    from seq2seq_fast.seq2seq.config import TrainError
    from seq2seq_fast.seq2seq.data.errors import CorpusError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command in args.commands:
        try:
            apply_config_file(parser, args, argv)
        except ValueError as exc:
            print(f"seq2seq-fast {args.command}: error: {exc}", file=sys.stderr)
            return 2
    handlers = {
        "train": _train,
        "translate": _translate,
        "plot-attention": _plot,
        "export": _export,
    }
    threads = torch.get_num_threads()
    try:
        return handlers[args.command](args)
    except (CheckpointError, CorpusError, TrainError, ValueError, OSError) as exc:
        print(f"seq2seq-fast {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:  # main() called in-process (tests, notebooks) leaves torch's threads as they were
        torch.set_num_threads(threads)


def console_main() -> int:
    """The installed ``seq2seq-fast`` command: :func:`main`, after freezing the garbage collector.

    Everything alive once the modules are imported (torch alone is ~10^6 objects) lives until the
    process ends anyway; frozen, it is skipped by the collections during the run and by the
    interpreter's final passes at exit: 0.5 s less for every command on a 2-core CPU. Objects
    made later (Triton's, whose nanobind bindings report any still alive at exit as leaks) are
    collected as usual. Not done in :func:`main`, which tests and notebooks call in a process
    that goes on.
    """
    import gc

    gc.freeze()
    return main()


if __name__ == "__main__":
    sys.exit(console_main())
