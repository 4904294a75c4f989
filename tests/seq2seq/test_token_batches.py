"""Batching by tokens (``train --batch-tokens N``): every pair once per epoch, the limit kept,
seeded, sharded for DDP, and training on it resumes exactly with a correct schedule."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from seq2seq_fast.seq2seq import train as train_module
from seq2seq_fast.seq2seq.builders import build_task
from seq2seq_fast.seq2seq.checkpoint import load_checkpoint
from seq2seq_fast.seq2seq.cli import build_parser
from seq2seq_fast.seq2seq.config import TrainConfig, TrainError
from seq2seq_fast.seq2seq.data.batching import (
    epoch_batches,
    padded_width,
    padding_fractions,
    token_batches,
)
from seq2seq_fast.seq2seq.distributed import Dist
from seq2seq_fast.seq2seq.train import train
from tests.seq2seq.test_train import SAME, _toy_corpus, tiny_config


def _pairs(count: int = 500, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 30, (count, 2), generator=g).tolist()
    return [([5] * s, [6] * t) for s, t in lengths]


def _cost(pairs, batch) -> int:
    return len(batch) * max(padded_width(pairs[i]) for i in batch)


@pytest.mark.parametrize("max_tokens", [1, 31, 200, 1000])
def test_every_pair_once_per_epoch_and_no_batch_over_the_limit(max_tokens):
    pairs = _pairs()
    for epoch in range(3):
        batches = token_batches(pairs, max_tokens, seed=0, epoch=epoch)
        assert sorted(i for b in batches for i in b) == list(range(len(pairs)))
        for batch in batches:
            # over the limit only as a single pair too wide by itself
            assert _cost(pairs, batch) <= max_tokens or (
                len(batch) == 1 and padded_width(pairs[batch[0]]) > max_tokens
            )


def test_a_too_long_pair_gets_its_own_batch():
    pairs = _pairs(100) + [([5] * 80, [6] * 3)]
    batches = token_batches(pairs, 64, seed=0, epoch=0)
    assert [100] in batches
    assert all(_cost(pairs, b) <= 64 for b in batches if b != [100])


def test_seeded_same_count_every_epoch_contents_change():
    pairs = _pairs()
    first = token_batches(pairs, 200, seed=3, epoch=0)
    assert first == token_batches(pairs, 200, seed=3, epoch=0)
    assert first != token_batches(pairs, 200, seed=4, epoch=0)
    second = token_batches(pairs, 200, seed=3, epoch=1)
    assert len(second) == len(first)  # what the schedule and the progress bar count
    assert {tuple(sorted(b)) for b in second} != {tuple(sorted(b)) for b in first}


def test_ranks_get_disjoint_shards_of_equal_size():
    pairs = _pairs(301)
    full = token_batches(pairs, 150, seed=0, epoch=2)
    shards = [token_batches(pairs, 150, seed=0, epoch=2, rank=r, world_size=3) for r in range(3)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == len(full) // 3
    seen = [i for shard in shards for b in shard for i in b]
    assert len(seen) == len(set(seen))


def test_length_similar_batches_pad_less_than_sentence_batches():
    pairs = _pairs(2000)
    by_tokens = token_batches(pairs, 600, seed=0, epoch=0)
    mean = round(len(pairs) / len(by_tokens))
    by_count = epoch_batches(pairs, mean, seed=0, epoch=0)
    assert padding_fractions(pairs, by_tokens)[1] < padding_fractions(pairs, by_count)[1]


def test_padding_fractions_count_positions():
    pairs = [([1, 1], [2]), ([1], [2, 2, 2])]  # widths: source 2, target 3 + </s> = 4
    assert padding_fractions(pairs, [[0, 1]]) == pytest.approx((1 / 4, 2 / 8))


def test_bad_values_are_named():
    with pytest.raises(TrainError, match="batch-tokens is for --task translate"):
        TrainConfig(batch_tokens=100)
    with pytest.raises(TrainError, match="batch_tokens must be >= 1, got 0"):
        TrainConfig(task="translate", data="x.tsv", batch_tokens=0)
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        token_batches(_pairs(5), 0, seed=0, epoch=0)


def test_cli_option_reaches_the_config():
    args = build_parser().parse_args(["train", "--task", "translate", "--batch-tokens", "700"])
    assert args.batch_tokens == 700 and args.batch_size is None


def test_training_by_tokens_resumes_exactly_with_the_full_schedule(tmp_path, monkeypatch):
    """Killed mid-epoch and resumed: the same batches and losses; the learning rate ends at its
    floor after epochs x (batches of one epoch) steps."""
    sizes = []
    make_batch = train_module.make_batch
    monkeypatch.setattr(
        train_module,
        "make_batch",
        lambda pairs, **kw: sizes.append(len(pairs)) or make_batch(pairs, **kw),
    )
    corpus = _toy_corpus(tmp_path / "toy.tsv")
    config = tiny_config(
        tmp_path / "full",
        task="translate",
        data=str(corpus),
        epochs=2,
        spm_vocab_size=40,
        valid_fraction=0.1,
        test_fraction=0.1,
        eval_size=20,
        dropout=0.1,
        batch_tokens=90,
        warmup_steps=2,
    )
    full = train(config)
    full_sizes, sizes[:] = list(sizes), []
    task = build_task(config, Dist(), None)
    plans = [token_batches(task.corpus.train, 90, seed=0, epoch=e) for e in range(2)]
    assert len(plans[0]) == len(plans[1]) == task.steps_per_epoch and full.step == 2 * len(plans[0])
    assert full_sizes == [len(b) for plan in plans for b in plan]
    assert max(full_sizes) > min(full_sizes)
    lr = load_checkpoint(full.checkpoint)["scheduler"]["_last_lr"][0]
    assert lr == pytest.approx(config.lr * config.min_lr_ratio)  # the cosine ran its full length
    part = train(replace(config, out=str(tmp_path / "part"), stop_after_steps=full.step // 2 + 1))
    resumed = train(TrainConfig(progress=False), resume=tmp_path / "part/model.pt")
    assert sizes == full_sizes
    assert part.losses + resumed.losses == pytest.approx(full.losses, rel=SAME, abs=0)
