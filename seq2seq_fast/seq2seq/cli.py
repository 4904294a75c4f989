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

from seq2seq_fast.seq2seq.config import TrainConfig, add_train_arguments, given_options
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


def _finite_number(text: str, zero_allowed: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 or (zero_allowed and value == 0))):
        bound = ">= 0" if zero_allowed else "> 0"
        raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
    return value


def _positive_factor(text: str) -> float:
    return _finite_number(text, zero_allowed=False)


def _penalty_weight(text: str) -> float:
    return _finite_number(text, zero_allowed=True)


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
    p.add_argument(
        "--resume",
        metavar="CHECKPOINT",
        help="continue this checkpoint exactly; options that may change mid-run (epochs, time "
        "budget, threads, backend, evaluation, patience, logging) apply, others must match",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in an --out folder that holds another run, replacing its files",
    )
    add_train_arguments(p)  # one flag per TrainConfig field (config.py)
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
        action="append",
        help="model.pt written by seq2seq-fast train, or an exported model (required); given "
        "several times: an ensemble (log-probabilities averaged at each step; same vocabularies)",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "int8"],
        help="decode in float32, bfloat16 (where the CPU has AVX512-BF16 or AMX) or with int8 "
        "linear layers (default: the checkpoint's, fp32 unless exported with --precision)",
    )
    p.add_argument("sentence", nargs="?", help="input sentence (default: read lines from stdin)")
    # No defaults here: DecodeOptions holds them (and builds the options from those given).
    p.add_argument("--beam", type=_beam, help=f"beam size (default {DecodeOptions.beam}: greedy)")
    p.add_argument(
        "--alpha",
        type=_penalty_weight,
        help=f"length normalisation exponent (default {DecodeOptions.alpha})",
    )
    p.add_argument(
        "--beta",
        type=_penalty_weight,
        help=f"coverage penalty weight (default {DecodeOptions.beta})",
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
    add("-i", "--input", help="file of sentences, one a line, UTF-8 (default or -: stdin)")
    add("-o", "--output", help="write translations here (default or -: stdout)")
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
        action="extend",  # (--checkpoint A B and --checkpoint A --checkpoint B alike)
        metavar="PATH",
        help="model.pt written by seq2seq-fast train; several (e.g. the model.epoch*.pt "
        "of train --keep-checkpoints, after one --checkpoint or each after its own): their "
        "weights averaged",
    )
    p.add_argument("-o", "--output", required=True, help="file to write, e.g. model.infer.pt")
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="storage type of the floating-point weights (default float32, bfloat16 with "
        "--precision bf16); translate computes as --precision says",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "int8"],
        default="fp32",
        help="the precision translate decodes the file in by default; int8: the layers int8 "
        "decoding quantises stored as int8 with their scales (a smaller file)",
    )


def _add_cache(sub) -> None:
    p = sub.add_parser(
        "cache",
        help="list (and reclaim) the cached token stores and sentencepiece models",
        description="List the token stores and trained sentencepiece models that translate runs "
        "keep in the cache folder, with size and last use; --clear or --older-than removes them "
        "(a later run builds what it needs again).",
    )
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="the cache folder (default $SEQ2SEQ_FAST_CACHE_DIR, else "
        "$XDG_CACHE_HOME/seq2seq-fast, else ~/.cache/seq2seq-fast)",
    )
    p.add_argument("--clear", action="store_true", help="remove every entry not being built")
    p.add_argument(
        "--older-than",
        type=float,
        metavar="DAYS",
        help="remove the entries last used more than DAYS days ago",
    )


def _cache(args) -> int:
    from pathlib import Path

    from seq2seq_fast.seq2seq.cache import run_cache_command
    from seq2seq_fast.seq2seq.data.options import default_cache_dir

    if args.older_than is not None and not (
        math.isfinite(args.older_than) and args.older_than >= 0
    ):
        raise ValueError(f"--older-than must be a number of days >= 0, got {args.older_than}")
    root = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    sys.stdout.write(run_cache_command(root, clear=args.clear, older_than_days=args.older_than))
    return 0


def _version_line() -> str:
    """What --version prints: this package's version and the torch it runs on (for bug reports)."""
    import torch

    import seq2seq_fast

    return f"seq2seq-fast {seq2seq_fast.__version__} (torch {torch.__version__})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="seq2seq-fast", description="Attention seq2seq models on fused Bahdanau attention."
    )
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.set_defaults(commands={"train": _add_train(sub), "translate": _add_translate(sub)})
    p = sub.add_parser("plot-attention", help="draw the attention heatmap of one sentence")
    _add_decode_options(p)
    p.add_argument(
        "-o", "--output", default="attention.png", help="image file (default %(default)s)"
    )
    _add_export(sub)
    _add_cache(sub)
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
    if args.command == "train":  # with --resume its options are given again: resumed() rules
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
    default (:class:`TrainConfig` resolves those, as it does in Python); with ``--init-from``,
    the model shape is the checkpoint's."""
    values = given_options(args)
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
    if values.get("init_from"):
        from seq2seq_fast.seq2seq.config import init_shape
        from seq2seq_fast.seq2seq.finetune import load_init

        payload = load_init(values["init_from"])
        values.update(init_shape(payload, values, values["init_from"]))
    return TrainConfig(**values)


def _train(args) -> int:
    from seq2seq_fast.seq2seq.train import train

    if args.resume and args.overwrite:
        raise ValueError("--resume continues a run and --overwrite replaces one: give one")
    if args.dump_config:
        from seq2seq_fast.seq2seq.configfile import dump_config

        if args.resume:  # what the run continues with: the checkpoint's options, changes applied
            from seq2seq_fast.seq2seq.checkpoint import load_checkpoint

            saved = dict(load_checkpoint(args.resume).get("train_config") or {})
            values = asdict(TrainConfig.resumed(saved, given_options(args), args.resume))
        else:
            values = asdict(train_config(args))
        sys.stdout.write(dump_config(values))
        return 0
    if args.resume:
        train(resume=args.resume, changes=given_options(args))
    else:
        train(train_config(args), overwrite=args.overwrite)
    return 0


def _translator(args, **kwargs):
    """Load the checkpoint once, on the device and thread count asked for."""
    import torch

    checkpoints = [args.checkpoint] if isinstance(args.checkpoint, str) else args.checkpoint
    if not checkpoints:
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
    translator = Translator.load(
        checkpoints,
        backend=args.backend,
        device=args.device,
        precision=args.precision,
        options=decode_options(args),
        workers=workers,
        **kwargs,
    )
    for notice in translator.notices:
        print(f"seq2seq-fast {args.command}: note: {notice}", file=sys.stderr)
    return translator


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
    checkpoints = values.get("checkpoint")
    if isinstance(checkpoints, list) and len(checkpoints) == 1:  # one: a path, as before
        values["checkpoint"] = checkpoints[0]
    return values


def _translate(args) -> int:
    import os

    from seq2seq_fast.seq2seq.translate import CHUNK_LINES, iter_chunks

    if args.dump_config:
        from seq2seq_fast.seq2seq.configfile import dump_config

        sys.stdout.write(dump_config(translate_settings(args)))
        return 0
    # "-": the standard streams, as most command-line tools read it
    args.input = None if args.input == "-" else args.input
    args.output = None if args.output == "-" else args.output
    if args.sentence is not None and args.input is not None:
        raise ValueError("give either a sentence or --input FILE, not both")
    _check_output(args)  # before the model loads and the lines decode
    sentence = args.sentence
    if sentence is not None and sentence.endswith((".pt", ".pth")) and os.path.isfile(sentence):
        raise ValueError(
            f"the sentence to translate, {sentence!r}, is a checkpoint file: for an ensemble "
            "give --checkpoint before each checkpoint"
        )
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
        text = "\n".join(_output_lines(result, args.n_best))
        if args.output is None:
            print(text, flush=True)
        else:
            from seq2seq_fast.seq2seq.atomic import atomic_write

            atomic_write(args.output, (text + "\n").encode("utf-8"))
        return 0
    if args.input is None and args.output is None and sys.stdin.isatty():
        # typed, answered on the terminal: each line as it comes (with -o: the lines below)
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


def _check_output(args) -> None:
    """-o FILE: a file that can be written, and not the input file (ValueError naming both)."""
    import os

    if args.output is None:
        return
    target = os.path.abspath(args.output)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        raise ValueError(f"-o {args.output}: is a folder; give the path of a file to write")
    if not os.path.isdir(folder):
        raise ValueError(f"-o {args.output}: its folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"-o {args.output}: cannot write in its folder {folder}")
    given = getattr(args, "input", None)
    same = given is not None and os.path.exists(given) and os.path.exists(target)
    if same and os.path.samefile(given, target):
        raise ValueError(
            f"-o {args.output} is the input file (-i {given}): its lines would be replaced by "
            "their translations; write to another file"
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
    from seq2seq_fast.seq2seq.plot import image_path, plot_result

    try:  # before the model loads
        image_path(args.output)
    except ValueError as exc:
        raise ValueError(f"-o {exc}") from None
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

    dtype = args.dtype or ("bfloat16" if args.precision == "bf16" else "float32")
    size, source_size = export_inference(
        args.checkpoint, args.output, dtype=dtype, precision=args.precision
    )
    count = len(args.checkpoint)
    what = f"the average of {count} checkpoints; the last is" if count > 1 else "the checkpoint is"
    stored = f"int8 decoder layers, {dtype} others" if args.precision == "int8" else dtype
    print(
        f"wrote {args.output}: {size / 1e6:.1f} MB ({stored} weights and vocabularies, "
        f"decoded in {args.precision} by default; {what} {source_size / 1e6:.1f} MB)"
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
        "cache": _cache,
    }
    threads = torch.get_num_threads()
    try:
        return handlers[args.command](args)
    except (CheckpointError, CorpusError, TrainError, ValueError, OSError) as exc:
        print(f"seq2seq-fast {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # (training's says where its checkpoint is)
        print(str(exc) or "interrupted", file=sys.stderr)
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
