"""Decoding precisions (inference.DecodingModel): fp32 as the model, bf16 and int8 close to it,
the layers each changes, the int8 export, the GPU path's code, bad input in every mode, and
what the translate command imports."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from seq2seq_fast.seq2seq import inference
from seq2seq_fast.seq2seq.checkpoint import load_checkpoint
from seq2seq_fast.seq2seq.decoding import DecodeOptions, beam_search, greedy_search
from seq2seq_fast.seq2seq.inference import DecodingModel, PreparedLinear, quantize_int8
from seq2seq_fast.seq2seq.translate import Translator
from tests.seq2seq.test_translate import _checkpoint_of, _model, _run, _sources

MODELS = [
    pytest.param(dict(decoder="gnmt", cell="gru"), id="gnmt-gru"),
    pytest.param(
        dict(decoder="gnmt", cell="lstm", decoder_layers=3, output_layer="attentional"),
        id="gnmt-lstm-3-attentional",
    ),
    pytest.param(dict(decoder="bahdanau", cell="gru", output_layer="attentional"), id="bahdanau"),
]
# Largest |log p| difference from the float32 model seen on these small random models, with
# room: bf16 rounds weights and activations to 8 bits of mantissa, int8 to 7 bits per row.
BOUND = {"fp32": 1e-5, "bf16": 0.05, "int8": 0.05}


def _step_inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 14, (5, 9), generator=g)
    lengths = torch.tensor([9, 7, 6, 3, 1])
    y = torch.randint(4, 14, (5,), generator=g)
    return src, lengths, y


def _reference_step(model, src, lengths, y):
    with torch.no_grad():
        memory, state = model.encode(src, lengths)
        logits, weights, _ = model.decoder.step(y, state, memory)
    return logits.log_softmax(-1), weights


@pytest.mark.parametrize("overrides", MODELS)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_prepared_step_is_the_models_step(overrides, precision):
    model, _ = _model("auto", **overrides)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    src, lengths, y = _step_inputs(model)
    logp_ref, weights_ref = _reference_step(model, src, lengths, y)
    prepared = DecodingModel(model, precision)
    with torch.no_grad():
        memory, state = prepared.encode(src, lengths)
        logp, weights, _ = prepared.step_log_probs(y, state, memory)
    assert logp.dtype == torch.float32 and weights.dtype == torch.float32
    assert logp.shape == logp_ref.shape and weights.shape == weights_ref.shape
    bound = BOUND[prepared.precision]
    assert (logp - logp_ref).abs().max() <= bound, precision
    torch.testing.assert_close(weights, weights_ref.float(), atol=bound, rtol=0)
    if prepared.precision != "fp32":  # the precision did change the arithmetic
        assert (logp - logp_ref).abs().max() > 1e-6
    for name, tensor in model.state_dict().items():  # the model itself is left as it was
        assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_the_layers_each_precision_changes(precision):
    model, _ = _model("auto", decoder="gnmt", output_layer="attentional")
    prepared = DecodingModel(model, precision)
    if prepared.precision != precision:
        pytest.skip(f"bf16 not available here: {prepared.notices}")
    linears = {
        "output": prepared.base.decoder.output,
        "attentional": prepared.base.decoder.attentional,
        "query": prepared.query,
        "recurrent": prepared.cells[0].hh,
    }
    # the first layer's input gates: a float32 table of every target word's, in every precision
    table = prepared.cells[0].table
    assert table.dtype == torch.float32 and table.shape == (model.config.tgt_vocab_size, 3 * 24)
    assert prepared.cells[0].ih is None
    for name, layer in linears.items():
        assert isinstance(layer, PreparedLinear) and layer.precision == precision, name
        if precision == "int8":
            assert layer.quantized is not None, name  # PyTorch's dynamic int8 Linear
        else:
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            assert layer.weight.dtype == dtype or layer.packed, name
    encoder_dtype = next(prepared.base.encoder.parameters()).dtype
    assert encoder_dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    # int8 of some layers only: the others stay float32
    partial = DecodingModel(model, "int8", int8_layers=("output",))
    assert partial.base.decoder.output.quantized is not None
    assert partial.query.quantized is None and partial.query.precision == "fp32"
    with pytest.raises(ValueError, match="int8_layers"):
        DecodingModel(model, "int8", int8_layers=("embedding",))


def test_bf16_without_bf16_products_decodes_fp32_with_a_notice(monkeypatch):
    monkeypatch.setattr(inference, "_cpu_flags", lambda: frozenset({"avx2"}))
    model, _ = _model("auto")
    prepared = DecodingModel(model, "bf16")
    assert prepared.precision == "fp32"
    assert len(prepared.notices) == 1 and "neither AVX512-BF16 nor AMX" in prepared.notices[0]
    assert next(prepared.base.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="precision must be one of"):
        DecodingModel(model, "fp16")


@pytest.mark.parametrize("overrides", MODELS)
def test_fp32_searches_find_what_the_model_finds(overrides):
    model, _ = _model("auto", eos_bias=0.3, **overrides)
    prepared = DecodingModel(model, "fp32")
    for ids in _sources(6):
        src, lengths = torch.tensor([ids]), torch.tensor([len(ids)])
        (a,) = greedy_search(model, src, lengths)
        (b,) = greedy_search(prepared, src, lengths)
        assert a.tokens == b.tokens and abs(a.score - b.score) <= 1e-4
        options = DecodeOptions(beam=3, n_best=3)
        (x,) = beam_search(model, src, lengths, options)
        (y,) = beam_search(prepared, src, lengths, options)
        assert [h.tokens for h in x] == [h.tokens for h in y]
        for h, k in zip(x, y, strict=True):
            assert abs(h.score - k.score) <= 1e-4
            torch.testing.assert_close(h.attention, k.attention, atol=1e-5, rtol=0)


def test_quantize_int8_rows():
    weight = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -3.0]])
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q.abs().amax(1).tolist() == [127, 0, 127]  # each row's largest magnitude at 127
    assert scale[1] == 1.0
    torch.testing.assert_close(q.float() * scale[:, None], weight, atol=3.0 / 254, rtol=0)


def _tiny_checkpoint(tmp_path, name="model.pt", seed=0, **overrides):
    model, vocab = _model("auto", seed=seed, eos_bias=0.3, output_layer="attentional", **overrides)
    return _checkpoint_of(model, vocab, tmp_path / name)


def test_export_int8_is_smaller_and_translates_as_precision_int8(tmp_path, capsys):
    checkpoint = _tiny_checkpoint(tmp_path)
    source = tmp_path / "in.txt"
    source.write_text("a b c\nd e f g\nb\nc d e f g h\n")
    for precision in ("fp32", "int8"):
        code, _, err = _run(
            capsys, "export", "--checkpoint", checkpoint, "-o", tmp_path / f"{precision}.pt",
            "--precision", precision,
        )  # fmt: skip
        assert code == 0, err
    payload = load_checkpoint(tmp_path / "int8.pt")
    assert payload["precision"] == "int8"
    raw = torch.load(tmp_path / "int8.pt", weights_only=True)
    assert raw["model"]["decoder.output.weight_int8"].dtype == torch.int8
    assert "decoder.output.weight" not in raw["model"]
    assert (tmp_path / "int8.pt").stat().st_size < (tmp_path / "fp32.pt").stat().st_size
    outputs = {}
    for name, extra in (
        ("original", ["--checkpoint", checkpoint, "--precision", "int8"]),
        ("export", ["--checkpoint", tmp_path / "int8.pt"]),  # int8 by default
        ("fp32", ["--checkpoint", checkpoint]),
    ):
        target = tmp_path / f"{name}.txt"
        code, _, err = _run(capsys, "translate", *extra, "-i", source, "-o", target, "--beam", 3)
        assert code == 0, err
        outputs[name] = target.read_text()
    assert outputs["original"] == outputs["export"]
    assert outputs["fp32"].count("\n") == outputs["export"].count("\n") == 4
    # exported with the old flag only: float32 decoding as before
    code, _, err = _run(
        capsys, "export", "--checkpoint", checkpoint, "-o", tmp_path / "bf.pt", "--dtype",
        "bfloat16",
    )  # fmt: skip
    assert code == 0 and load_checkpoint(tmp_path / "bf.pt")["precision"] == "fp32"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("beam", [1, 3])
def test_bad_input_keeps_lines_aligned_in_every_mode(tmp_path, capsys, precision, beam):
    """Empty and over-long lines give an empty output line and a warning naming the line; the
    other lines get the translation they get without the bad lines around them."""
    checkpoint = _tiny_checkpoint(tmp_path)
    good = ["a b c", "d e f g", "b", "c d e"]
    lines = ["", good[0], "   ", "a " * 30, good[1], good[2], "", "b " * 25, good[3]]
    source, clean = tmp_path / "in.txt", tmp_path / "clean.txt"
    source.write_text("\n".join(lines) + "\n")
    clean.write_text("\n".join(good) + "\n")
    common = ["--precision", precision, "--beam", beam, "--max-source-tokens", 20]
    code, _, err = _run(
        capsys, "translate", "--checkpoint", checkpoint, "-i", source, "-o", tmp_path / "out.txt",
        *common,
    )  # fmt: skip
    assert code == 0, err
    out = (tmp_path / "out.txt").read_text().split("\n")
    assert len(out) == len(lines) + 1 and out[-1] == ""
    for number in (1, 3, 7):
        assert out[number - 1] == "" and f"line {number}: empty input" in err
    for number in (4, 8):
        assert out[number - 1] == "" and f"line {number}: " in err and "over the limit" in err
    code, _, err = _run(
        capsys, "translate", "--checkpoint", checkpoint, "-i", clean, "-o", tmp_path / "c.txt",
        *common,
    )  # fmt: skip
    assert code == 0, err
    expected = (tmp_path / "c.txt").read_text().split("\n")[:-1]
    assert [out[i] for i in (1, 4, 5, 8)] == expected


def test_translate_precision_option_errors(tmp_path, capsys):
    checkpoint = _tiny_checkpoint(tmp_path)
    for argv in (
        ["translate", "--checkpoint", checkpoint, "--precision", "fp16", "a"],
        ["export", "--checkpoint", checkpoint, "-o", tmp_path / "x.pt", "--precision", "fp16"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            _run(capsys, *argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "--precision" in err and "'fp16'" in err


def _triton_attend(**_):
    """``additive_attention`` as the GPU path runs it: the Triton forward kernel (here
    interpreted)."""
    tk = pytest.importorskip("seq2seq_fast._triton.additive_attention")
    if not (torch.cuda.is_available() or tk.is_interpreted()):
        pytest.skip("no CUDA and Triton not interpreted")

    def attend(query, keys, values, v, bias=None, *, lengths=None, **kwargs):
        squeeze = query.dim() == 2
        q = query.unsqueeze(1) if squeeze else query
        context, weights, _ = tk.additive_attention_fwd(
            q, keys, values, v, bias, lengths, None, True
        )
        if squeeze:
            return context.squeeze(1), weights.squeeze(1)
        return context, weights

    return attend


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_gpu_path_code_decodes_like_the_cpu_path(monkeypatch, precision):
    """The GPU path's products (plain F.linear; int8 weights expanded at each use) and the
    attention through the Triton kernel (interpreted without a GPU), beam rows grouped as the
    queries of one memory: the same step as the CPU path, and the same beam search."""
    attend = _triton_attend()
    model, _ = _model("auto", decoder="gnmt", output_layer="attentional", eos_bias=0.3)
    cpu = DecodingModel(model, precision, portable=False)
    if cpu.precision != precision:
        pytest.skip(f"bf16 not available here: {cpu.notices}")
    gpu = DecodingModel(model, precision, portable=True)
    assert gpu.base.decoder.output.quantized is None and not gpu.base.decoder.output.packed
    src, lengths, y = _step_inputs(model)
    with torch.no_grad():
        memory, state = cpu.encode(src, lengths)
        expected = cpu.step_log_probs(y, state, memory)
        monkeypatch.setattr(inference, "additive_attention", attend)
        memory, state = gpu.encode(src, lengths)
        got = gpu.step_log_probs(y, state, memory)
    bound = 1e-4 if precision == "fp32" else BOUND[precision]
    torch.testing.assert_close(got[0], expected[0], atol=bound, rtol=0)
    torch.testing.assert_close(got[1], expected[1], atol=bound, rtol=0)
    ids = _sources(6)[0]
    (hyps,) = beam_search(
        gpu, torch.tensor([ids]), torch.tensor([len(ids)]), DecodeOptions(beam=3, n_best=3)
    )
    assert len(hyps) == 3 and all(torch.isfinite(torch.tensor(h.score)) for h in hyps)


# Never imported by ``translate`` (start-up time): the GPU kernels, plotting, logging, metrics,
# configuration files, the converter (torch.fx, every model family's stand-ins), training; and
# sentencepiece for a checkpoint without subwords.
NOT_FOR_TRANSLATE = (
    "triton",
    "matplotlib",
    "tensorboard",
    "torch.utils.tensorboard",
    "sympy",
    "sacrebleu",
    "yaml",
    "sentencepiece",
    "seq2seq_fast._triton",
    "seq2seq_fast.nn.convert",
    "seq2seq_fast.seq2seq.train",
    "seq2seq_fast.seq2seq.evaluation",
    "seq2seq_fast.seq2seq.plot",
    "seq2seq_fast.seq2seq.finetune",
)


def test_translate_imports_no_triton_matplotlib_or_tensorboard(tmp_path):
    """Start-up: the translate command imports only what translating needs, in every precision."""
    checkpoint = _tiny_checkpoint(tmp_path)
    code = (
        "import sys\n"
        "from seq2seq_fast.seq2seq.cli import main\n"
        "for precision in ('fp32', 'bf16', 'int8'):\n"
        f"    assert main(['translate', '--checkpoint', {str(checkpoint)!r}, '--beam', '2', "
        "'--precision', precision, 'a b c']) == 0\n"
        f"print('IMPORTED', [m for m in {NOT_FOR_TRANSLATE!r} if m in sys.modules])\n"
        "print('LOADED', 'seq2seq_fast.seq2seq.translate' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user runs it
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED []" in proc.stdout, proc.stdout
    assert "LOADED True" in proc.stdout, proc.stdout  # the check itself sees imports


def test_translator_load_precision_and_notices(tmp_path):
    checkpoint = _tiny_checkpoint(tmp_path)
    translator = Translator.load(checkpoint, precision="int8", beam=2)
    assert isinstance(translator.model, DecodingModel) and translator.model.precision == "int8"
    (result,) = translator.translate(["a b c"])
    assert result.warning is None and len(result.hypotheses) == 1
    with pytest.raises(ValueError, match="precision must be one of"):
        Translator.load(checkpoint, precision="half")


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_gate_table_and_product_agree(monkeypatch, precision):
    """The first layer's input gates from the table and (vocabularies too large for it) from
    the prepared product give the same step."""
    model, _ = _model("auto", decoder="gnmt", output_layer="attentional")
    src, lengths, y = _step_inputs(model)
    with_table = DecodingModel(model, precision)
    monkeypatch.setattr(inference, "GATE_TABLE_BYTES", 0)
    without = DecodingModel(model, precision)
    assert with_table.cells[0].table is not None and without.cells[0].table is None
    with torch.no_grad():
        outputs = []
        for prepared in (with_table, without):
            memory, state = prepared.encode(src, lengths)
            outputs.append(prepared.step_log_probs(y, state, memory))
    bound = 1e-5 if precision == "fp32" else BOUND[precision]
    torch.testing.assert_close(outputs[0][0], outputs[1][0], atol=bound, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(cell="gru"),
        dict(cell="lstm", encoder_layers=2),
        dict(cell="gru", encoder_layers=2, bidirectional=False, decoder="bahdanau"),
    ],
)
def test_prepared_encoder_is_the_models(overrides):
    """The encoder's layers step by step through prepared products (and per-word tables) give
    the model's memory and initial state (packed nn.GRU/LSTM), padding included."""
    model, _ = _model("auto", **overrides)
    src, lengths, _ = _step_inputs(model)
    src[3, 3:] = 0  # padding past each row's length
    src[4, 1:] = 0
    with torch.no_grad():
        memory, state = model.encode(src, lengths)
        got_memory, got_state = DecodingModel(model).encode(src, lengths)
    for name, a, b in zip(("values", "keys", "lengths"), got_memory, memory, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
    flat = lambda s: torch.cat([t.reshape(-1) for t in torch.utils._pytree.tree_leaves(s)])  # noqa: E731
    torch.testing.assert_close(flat(got_state), flat(state), atol=1e-5, rtol=0)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_workers_share_a_prepared_model(tmp_path, precision):
    """Batches decoded at once on worker threads (translate --threads N) through one prepared
    model give what one thread gives."""
    checkpoint = _tiny_checkpoint(tmp_path)
    texts = [" ".join("abcdefghij"[(i * 7 + j) % 10] for j in range(1 + i % 9)) for i in range(40)]
    one = Translator.load(checkpoint, precision=precision, beam=3, batch_size=4)
    many = Translator.load(checkpoint, precision=precision, beam=3, batch_size=4, workers=3)
    assert [r.texts for r in one.translate(texts)] == [r.texts for r in many.translate(texts)]
