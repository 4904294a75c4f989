"""--config values take their flag's type; keys may be spelled as the flags or as the fields."""

import pytest

from seq2seq_fast.seq2seq.cli import apply_config_file, build_parser, main


def _resolved(tmp_path, text, command="train"):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    parser = build_parser()
    argv = [command, "--config", str(path)]
    args = parser.parse_args(argv)
    apply_config_file(parser, args, argv)
    return args


def test_yaml_values_are_converted_to_the_flag_types(tmp_path):
    args = _resolved(tmp_path, "lr: 3e-3\nhidden-size: 64.0\nshare-vocab: 'yes'\nepochs: '2'\n")
    assert args.lr == 0.003 and isinstance(args.lr, float)
    assert args.hidden_size == 64 and isinstance(args.hidden_size, int)
    assert args.share_vocab is True and args.epochs == 2


def test_keys_spelled_as_flags_or_fields(tmp_path):
    assert _resolved(tmp_path, "src-vocab: v.txt\n").src_vocab_file == "v.txt"
    assert _resolved(tmp_path, "src_vocab_file: w.txt\n").src_vocab_file == "w.txt"
    assert _resolved(tmp_path, "max-held-out: 50\n").max_held_out == 50


@pytest.mark.parametrize(
    "text, needle",
    [
        ("lr: fast\n", "key 'lr': expected a number, got 'fast'"),
        ("decoder: lstm\n", "key 'decoder': expected one of 'gnmt', 'bahdanau', got 'lstm'"),
        ("hidden-size: 2.5\n", "key 'hidden-size': expected an integer, got 2.5"),
        ("epochs: true\n", "key 'epochs': expected an integer, got True"),
        ("share-vocab: maybe\n", "key 'share-vocab': expected true or false, got 'maybe'"),
    ],
)
def test_a_wrong_value_is_one_line_naming_key_value_and_type(tmp_path, capsys, text, needle):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_translate_config_values_are_converted(tmp_path):
    args = _resolved(tmp_path, "beam: '5'\nalpha: 6e-1\n", command="translate")
    assert args.beam == 5 and args.alpha == 0.6


def test_a_corpus_without_task_means_translate(tmp_path):
    from seq2seq_fast.seq2seq.cli import train_config

    parser = build_parser()
    config = train_config(parser.parse_args(["train", "--data", str(tmp_path / "c.tsv")]))
    assert config.task == "translate"
    config = train_config(parser.parse_args(["train", "--src", "a.txt", "--tgt", "b.txt"]))
    assert config.task == "translate"
    assert train_config(parser.parse_args(["train"])).task == "reverse"


def test_a_corpus_with_the_reverse_task_is_refused(tmp_path, capsys):
    corpus = tmp_path / "c.tsv"
    corpus.write_text("a b\tb a\n")
    assert main(["train", "--task", "reverse", "--data", str(corpus)]) == 2
    assert "--data given with --task reverse" in capsys.readouterr().err
