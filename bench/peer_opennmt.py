"""Training side by side with OpenNMT-py 3.5.1 on the same corpus: tokens/s, then equal-time BLEU.

    python -m bench.peer_opennmt --data PATH/fra-eng.zip                 # setup + both phases
    python -m bench.peer_opennmt --data ... --phase speed --steps 60      # tokens/s only
    python -m bench.peer_opennmt --data ... --phase bleu --minutes 8      # equal wall-clock BLEU

Not run in CI; OpenNMT-py is never a dependency of seq2seq-fast. The script sets it up in its own
virtual environment (``--venv``, default under ``--work``): ``--system-site-packages`` so that it
uses the torch already installed (a plain ``pip install OpenNMT-py`` pins torch<2.3 and would pull
a CUDA build of several GB), ``pip install --no-deps OpenNMT-py==3.5.1`` and only the packages its
modules import at start-up (configargparse, pyonmttok, spacy, pyahocorasick, rapidfuzz, six,
fasttext-wheel). Nothing of the corpus is written into the repository: data and models go to
``--work`` (default /tmp/peer_opennmt).

Same data for both: the corpus is read, split and cut into subwords once, by seq2seq-fast's own
loader (same seed, fractions and sentencepiece vocabularies as ``seq2seq-fast train``), and the
subword pieces are written out for OpenNMT-py, so both train on identical target tokens and are
scored on the same test pairs (greedy decoding, sacreBLEU on detokenised text).

Phase ``speed``: target tokens/s over ``--steps`` steps of batches of ``--batch-size`` sentences,
OpenNMT-py (its own report lines, first report dropped as warm-up) and seq2seq-fast (its training
step, fused loss, timed after ``--warmup`` steps) at the sizes in ``PAIRS``, alternating the two
tools ``--rounds`` times so that both see the same machine load; ratios per round.
Phase ``bleu``: each tool trains for ``--minutes`` of wall-clock time with its defaults (OpenNMT-py:
the issue's GRU 256 input-feeding mlp-attention model; seq2seq-fast: ``seq2seq-fast train --task
translate`` defaults), then greedy test BLEU.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

ONMT_VERSION = "3.5.1"
# Imported by onmt's modules at start-up (transforms are registered by importing them all).
ONMT_IMPORT_DEPS = [
    "configargparse",
    "pyonmttok<2,>=1.37",
    "spacy",
    "pyahocorasick",
    "rapidfuzz",
    "six",
    "fasttext-wheel",
]

# (name, OpenNMT-py hidden_size (brnn: split over the two directions), seq2seq-fast hidden_size
# (per encoder direction and decoder), embeddings). OpenNMT-py's decoder has its full hidden size.
PAIRS = [
    ("onmt 256 (bi 128+128, dec 256) / ours 128 (bi 128+128, dec 128)", 256, 128, 256),
    (
        "onmt 256 (bi 128+128, dec 256) / ours 256 (bi 256+256, dec 256): both defaults",
        256,
        256,
        256,
    ),
    ("onmt 512 (bi 256+256, dec 512) / ours 256 (bi 256+256, dec 256)", 512, 256, 256),
]


def setup_venv(venv: Path) -> Path:
    """-> the venv's python, with OpenNMT-py importable (created on first use)."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import onmt.bin.train, onmt.bin.translate, onmt.bin.build_vocab"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["--no-deps", f"OpenNMT-py=={ONMT_VERSION}"], check=True)
    subprocess.run(pip + ONMT_IMPORT_DEPS, check=True)
    proc = subprocess.run(check, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"OpenNMT-py does not import in {venv}:\n{proc.stderr[-2000:]}")
    torch_here = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
    ).stdout
    torch_there = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
    ).stdout
    if torch_here != torch_there:
        raise SystemExit(f"the venv's torch {torch_there.strip()} differs from {torch_here}")
    return python


def prepare_data(args) -> dict:
    """Split and subword-encode the corpus with seq2seq-fast's loader; write piece files."""
    from seq2seq_fast.seq2seq.data.corpus import TranslationData

    corpus = TranslationData.load(
        args.data,
        swap=args.direction == "2-1",
        max_words=None,
        max_pairs=args.max_pairs,
        vocab_size=args.spm_vocab_size,
        seed=0,
    )
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    def write(name: str, lines) -> str:
        path = work / name
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return str(path)

    sv, tv = corpus.src_vocab, corpus.tgt_vocab
    files = {
        "train_src": write("train.src", (" ".join(sv.pieces(s)) for s, _ in corpus.train)),
        "train_tgt": write("train.tgt", (" ".join(tv.pieces(t)) for _, t in corpus.train)),
        "valid_src": write(
            "valid.src", (" ".join(sv.pieces(sv.encode(s))) for s, _ in corpus.valid[:200])
        ),
        "valid_tgt": write(
            "valid.tgt", (" ".join(tv.pieces(tv.encode(t))) for _, t in corpus.valid[:200])
        ),
        "test_src": write(
            "test.src", (" ".join(sv.pieces(sv.encode(s))) or "." for s, _ in corpus.test)
        ),
    }
    files["test_refs"] = [t for _, t in corpus.test]
    files["corpus"] = corpus
    return files


def onmt_config(args, files: dict, hidden: int, embed: int, steps: int, out: Path) -> Path:
    """The issue's OpenNMT-py model: brnn GRU encoder, GRU input-feeding decoder, mlp attention."""
    text = textwrap.dedent(f"""\
        save_data: {out}/onmt
        src_vocab: {args.work}/vocab.src
        tgt_vocab: {args.work}/vocab.tgt
        src_vocab_size: {args.spm_vocab_size + 10}
        tgt_vocab_size: {args.spm_vocab_size + 10}
        overwrite: true
        data:
          corpus_1:
            path_src: {files["train_src"]}
            path_tgt: {files["train_tgt"]}
          valid:
            path_src: {files["valid_src"]}
            path_tgt: {files["valid_tgt"]}
        save_model: {out}/model
        save_checkpoint_steps: {args.save_every}
        keep_checkpoint: 2
        seed: 0
        train_steps: {steps}
        valid_steps: 1000000
        report_every: {args.report_every}
        encoder_type: brnn
        decoder_type: rnn
        rnn_type: GRU
        layers: 1
        hidden_size: {hidden}
        word_vec_size: {embed}
        global_attention: mlp
        input_feed: 1
        batch_size: {args.batch_size}
        batch_type: sents
        optim: adam
        learning_rate: 0.001
        label_smoothing: 0.1
        dropout: [0.2]
        max_grad_norm: 5
        """)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "onmt.yaml"
    path.write_text(text)
    return path


def _env(threads: int) -> dict:
    # OpenNMT-py 3.5.1 pickles argparse.Namespace into its checkpoints, which torch >= 2.6 refuses
    # to load by default (weights_only): its own checkpoints, so trusted.
    return dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1",
    )


def build_onmt_vocab(python: Path, config: Path, threads: int) -> None:
    cmd = [str(python), "-m", "onmt.bin.build_vocab", "-config", str(config), "-n_sample", "-1"]
    subprocess.run(cmd, check=True, capture_output=True, env=_env(threads))


_REPORT = re.compile(r"Step\s+(\d+).*?(\d+)/\s*(\d+) tok/s")


def onmt_speed(
    python: Path, config: Path, threads: int, alongside=None
) -> tuple[float, str, object]:
    """-> (median target tokens/s over the report lines after the first, the log, what
    ``alongside()`` returned). ``alongside`` (concurrent mode) runs in this process once
    OpenNMT-py has printed its first report, so that both tools train at the same time, under
    the same load from the rest of the machine."""
    cmd = [str(python), "-m", "onmt.bin.train", "-config", str(config)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(threads)
    )
    lines: list[str] = []
    first_report = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if _REPORT.search(line):
                first_report.set()
        first_report.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    result = None
    if alongside is not None:
        first_report.wait()
        result = alongside()
    proc.wait()
    reader.join()
    log = "".join(lines)
    rates = [int(m.group(3)) for m in _REPORT.finditer(log)]
    if proc.returncode != 0 or len(rates) < 2:
        raise SystemExit(f"OpenNMT-py training failed (rc {proc.returncode}):\n{log[-3000:]}")
    return statistics.median(rates[1:]), log, result


def onmt_cpu_speed(python: Path, args, files: dict, hidden: int, embed: int) -> tuple[float, str]:
    """-> (target tokens per CPU-second of OpenNMT-py, a log). CPU time of the training process
    and its data-loading workers (RUSAGE_CHILDREN), start-up cancelled by differencing a run of
    ``steps`` and one of ``2 * steps`` steps; tokens = steps x the mean target tokens of a batch
    (every sentence's pieces and </s>, as both tools count them)."""
    import resource

    cpu = []
    for n in (args.steps, 2 * args.steps):
        out = Path(args.work) / f"cpu_{hidden}_{n}"
        config = onmt_config(args, files, hidden, embed, n, out)
        if not Path(f"{args.work}/vocab.src").exists():
            build_onmt_vocab(python, config, args.threads)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        _, log, _ = onmt_speed(python, config, args.threads)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    train = files["corpus"].train
    per_batch = args.batch_size * statistics.mean(len(t) + 1 for _, t in train)
    return args.steps * per_batch / (cpu[1] - cpu[0]), log


def ours_speed(files: dict, hidden: int, embed: int, args, precision: str) -> tuple[float, int]:
    """-> (target tokens/s of seq2seq-fast's training step over ``args.steps`` steps, params)."""
    import torch

    from seq2seq_fast.seq2seq.data.batching import epoch_batches, make_batch
    from seq2seq_fast.seq2seq.models import Seq2Seq, Seq2SeqConfig

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    corpus = files["corpus"]
    config = Seq2SeqConfig(
        len(corpus.src_vocab),
        len(corpus.tgt_vocab),
        embed_size=embed,
        hidden_size=hidden,
        decoder=args.decoder,
        dropout=0.2,
        output_layer=args.output_layer,
    )
    model = Seq2Seq(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    plan = epoch_batches(corpus.train, args.batch_size, seed=0, epoch=0)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    tokens, start = 0, None
    for i, idx in enumerate(plan[: args.warmup + args.steps]):
        if i == args.warmup:
            tokens, start = 0, clock()
        batch = make_batch([corpus.train[j] for j in idx])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss, _ = model(
                batch.src, batch.src_lengths, batch.tgt_in, batch.tgt_out, label_smoothing=0.1
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        optimizer.step()
        tokens += batch.num_target_tokens
    params = sum(p.numel() for p in model.parameters())
    return tokens / (clock() - start), params


def phase_speed(args, python: Path, files: dict) -> None:
    print(
        f"\n## target tokens/s, {args.steps} steps of {args.batch_size} sentences, "
        f"{'both tools at once, ' if args.concurrent else 'one tool after the other, '}"
        f"{'per CPU-second, ' if args.clock == 'cpu' else ''}"
        f"{args.threads} threads, ours: {args.decoder} decoder, {args.output_layer} output "
        f"layer, {args.precision}\n"
    )
    print("| sizes | round | OpenNMT-py tok/s | seq2seq-fast tok/s | ratio | params onmt / ours |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, onmt_hidden, our_hidden, embed in PAIRS:
        if args.sizes and not any(s in name for s in args.sizes.split(",")):
            continue
        out = Path(args.work) / f"speed_{onmt_hidden}"
        # concurrent: OpenNMT-py runs longer than ours (its reports after ours ends run alone)
        onmt_steps = args.steps * (2 if args.concurrent else 1)
        config = onmt_config(args, files, onmt_hidden, embed, onmt_steps, out)
        if not Path(f"{args.work}/vocab.src").exists():
            build_onmt_vocab(python, config, args.threads)
        for r in range(args.rounds):

            def ours(hidden: int = our_hidden, embed: int = embed) -> tuple[float, int]:
                return ours_speed(files, hidden, embed, args, args.precision)

            if args.clock == "cpu":
                onmt_rate, log = onmt_cpu_speed(python, args, files, onmt_hidden, embed)
                ours_rate, ours_params = ours()
            elif args.concurrent:
                onmt_rate, log, (ours_rate, ours_params) = onmt_speed(
                    python, config, args.threads, ours
                )
            else:
                onmt_rate, log, _ = onmt_speed(python, config, args.threads)
                ours_rate, ours_params = ours()
            onmt_params = re.search(r"\* number of parameters: (\d+)", log)
            print(
                f"| {name} | {r + 1} | {onmt_rate:,.0f} | {ours_rate:,.0f} | "
                f"{ours_rate / onmt_rate:.2f}x | "
                f"{onmt_params.group(1) if onmt_params else '?'} / {ours_params} |",
                flush=True,
            )


def translate_command(
    python: Path, model: Path, source: str | Path, output: Path, beam: int, batch_size: int = 64
) -> list[str]:
    """``onmt_translate`` on CPU: ``source`` holds subword pieces (as ``prepare_data`` writes
    them), the output too (``detokenize`` each line); ``-report_time`` logs the translating time
    past start-up and loading (``translating_seconds``)."""
    return [
        str(python), "-m", "onmt.bin.translate", "-model", str(model), "-src", str(source),
        "-output", str(output), "-beam_size", str(beam), "-batch_size", str(batch_size),
        "-gpu", "-1", "-report_time",
    ]  # fmt: skip


_AVERAGE_MS = re.compile(r"Average translation time \(ms\): ([0-9.]+)")


def translating_seconds(log: str, sentences: int) -> float:
    """OpenNMT-py's translating time (-report_time: its mean per sentence, more digits than its
    total) from its log."""
    found = _AVERAGE_MS.search(log)
    if found is None:
        raise SystemExit(f"no 'Average translation time' in OpenNMT-py's log:\n{log[-2000:]}")
    return float(found.group(1)) * sentences / 1000


def detokenize(line: str) -> str:
    """sentencepiece pieces, space-separated -> text."""
    return line.replace(" ", "").replace("\u2581", " ").strip()


def _bleu(hyps: list[str], refs: list[str]) -> float:
    import sacrebleu

    return float(sacrebleu.corpus_bleu(hyps, [refs]).score)


def phase_bleu(args, python: Path, files: dict) -> None:
    minutes = args.minutes
    out = Path(args.work) / "bleu_onmt"
    config = onmt_config(args, files, 256, 256, 10**7, out)
    if not Path(f"{args.work}/vocab.src").exists():
        build_onmt_vocab(python, config, args.threads)
    for stale in out.glob("model_step_*.pt"):  # an earlier run's: never score those
        stale.unlink()
    cmd = [str(python), "-m", "onmt.bin.train", "-config", str(config)]
    started = time.perf_counter()
    # Its own process group: at the deadline the data-loading workers must go too, or they keep
    # the output pipe open and communicate() waits for ever.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(args.threads),
        start_new_session=True,
    )
    try:
        proc.wait(timeout=60 * minutes)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
    log = proc.communicate()[0]
    steps = [int(m.group(1)) for m in _REPORT.finditer(log)]
    checkpoints = sorted(out.glob("model_step_*.pt"), key=lambda p: int(p.stem.split("_")[-1]))
    if not checkpoints:
        raise SystemExit(f"OpenNMT-py saved no checkpoint in {minutes} min:\n{log[-3000:]}")
    hyp_path = out / "test.hyp"
    subprocess.run(
        translate_command(python, checkpoints[-1], files["test_src"], hyp_path, beam=1),
        check=True,
        capture_output=True,
        env=_env(args.threads),
    )
    hyps = [detokenize(line) for line in hyp_path.read_text(encoding="utf-8").splitlines()]
    onmt_bleu = _bleu(hyps, files["test_refs"])
    onmt_seconds = time.perf_counter() - started

    ours_out = Path(args.work) / "bleu_ours"
    cmd = [
        sys.executable,
        "-m",
        "seq2seq_fast",
        "train",
        "--task",
        "translate",
        "--data",
        args.data,
        "--direction",
        args.direction,
        "--spm-vocab-size",
        str(args.spm_vocab_size),
        "--time-budget-min",
        str(minutes),
        "--threads",
        str(args.threads),
        "--out",
        str(ours_out),
        "--no-progress",
        "--no-heatmap",
        "--epochs",
        "1000",
        "--precision",
        args.precision,
    ]
    if args.max_pairs:
        cmd += ["--max-pairs", str(args.max_pairs)]
    ours = subprocess.run(cmd, capture_output=True, text=True, env=_env(args.threads))
    found = re.search(r"test_bleu ([\d.]+)", ours.stdout)
    ours_steps = re.search(r"trained (\d+) steps", ours.stdout)
    if ours.returncode != 0 or not found:
        raise SystemExit(f"seq2seq-fast training failed:\n{(ours.stdout + ours.stderr)[-3000:]}")
    print(
        f"\n## {minutes} minutes of training each, {args.threads} threads, greedy test BLEU "
        f"on {len(files['test_refs'])} pairs\n"
    )
    print("| tool | steps | test BLEU |")
    print("| --- | ---: | ---: |")
    print(
        f"| OpenNMT-py {ONMT_VERSION}, GRU 256 input feeding, mlp attention (checkpoint "
        f"{checkpoints[-1].stem}) | {max(steps, default=0)} | {onmt_bleu:.1f} |"
    )
    print(
        f"| seq2seq-fast train --task translate defaults ({args.precision}) | "
        f"{ours_steps.group(1) if ours_steps else '?'} | {float(found.group(1)):.1f} |"
    )
    print(f"\n(OpenNMT-py wall time incl. test translation: {onmt_seconds:.0f}s)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--data", required=True, help="parallel corpus (.txt/.tsv or .zip), e.g. fra-eng.zip")
    add("--work", default="/tmp/peer_opennmt", help="folder for data, models, logs")
    add("--venv", help="OpenNMT-py's virtual environment (default WORK/venv)")
    add("--phase", choices=["setup", "speed", "bleu", "all"], default="all")
    add("--direction", default="2-1", help="2-1: French to English on fra-eng")
    add("--max-pairs", type=int, default=29000)
    add("--spm-vocab-size", type=int, default=8000)
    add("--batch-size", type=int, default=64)
    add("--threads", type=int, default=2)
    add("--steps", type=int, default=60)
    add("--warmup", type=int, default=10)
    add("--rounds", type=int, default=2)
    add("--report-every", type=int, default=10)
    add("--save-every", type=int, default=200)
    add("--sizes", default="", help="comma list of substrings of PAIRS names to run")
    add("--decoder", default="gnmt", choices=["gnmt", "bahdanau"])
    add("--output-layer", default="attentional", choices=["concat", "attentional"])
    add("--precision", default="fp32", choices=["fp32", "bf16"])
    add("--minutes", type=float, default=8.0)
    add(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="speed: cpu = target tokens per CPU-second of each tool (use with --threads 1)",
    )
    add(
        "--concurrent",
        action="store_true",
        help="speed: train both tools at the same time (same load from a shared machine)",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    python = setup_venv(Path(args.venv or Path(args.work) / "venv"))
    print(
        f"OpenNMT-py {ONMT_VERSION} in {python.parent.parent}; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    if args.phase == "setup":
        return 0
    files = prepare_data(args)
    print(f"{len(files['corpus'].train)} training pairs, {len(files['test_refs'])} test pairs")
    if args.phase in ("speed", "all"):
        phase_speed(args, python, files)
    if args.phase in ("bleu", "all"):
        phase_bleu(args, python, files)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
