"""TurboRAG fine-tuning: the training mask is turbo's, a step learns, adapters round-trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.engine.modeling.model import load_model
from kvrag_integrations.train.checkpoint import trainable_state
from kvrag_integrations.train.data import RagExample, is_heldout, split
from kvrag_integrations.train.distill import build_sample, sample_loss, student_logits
from kvrag_integrations.train.trainer import TrainConfig, Trainer

CHUNKS = [
    "Polonium was named by Marie Curie after Poland, her native country.",
    "The Amazon is the largest river in the world by discharge.",
]
QUESTION = "Which element did Marie Curie name after Poland?"
EXAMPLES = [RagExample(QUESTION, tuple(CHUNKS), ("polonium",))]


def prompt_sample(engine: KVRAGEngine, answer: list[int], positions: str = "reordered"):
    prompt = engine.tokenize(engine.build_segments(question=QUESTION, chunks=CHUNKS))
    return build_sample(prompt, answer, positions)


@pytest.mark.parametrize("positions", ["reordered", "composite"])
def test_training_mask_gives_turbo_logits(engine: KVRAGEngine, positions: str) -> None:
    sample = prompt_sample(engine, [], positions)
    last = torch.tensor([sample.num_tokens - 1])
    with torch.no_grad():
        student = student_logits(engine.model, sample, last)[0]
    turbo = engine.prefill(
        question=QUESTION, chunks=CHUNKS, strategy="turbo", positions=positions
    ).logits
    full = engine.prefill(question=QUESTION, chunks=CHUNKS, strategy="full").logits
    torch.testing.assert_close(student, turbo, atol=1e-4, rtol=0)
    assert (student - full).abs().max() > 1e-2  # the mask matters: not the full prefill


def test_answer_tokens_see_the_whole_prompt(engine: KVRAGEngine) -> None:
    """The scored rows cover the question and answer; answer rows continue turbo's decode."""
    answer = engine.tokenizer("Polonium", add_special_tokens=False)["input_ids"]
    sample = prompt_sample(engine, answer)
    assert int(sample.scored[-1]) == sample.num_tokens - 2
    assert sample.layout.position_ids[-1] == sample.num_tokens - 1
    mask = sample.layout.mask()[0, 0]
    assert mask[-1].all() and not mask[sample.answer_start - 1, sample.answer_start]


def test_heldout_split_is_fixed_by_item_id() -> None:
    items = [RagExample(f"question {i}?", ("passage",)) for i in range(200)]
    train, held = split(items, 0.2)
    _, again_held = split(list(reversed(items)), 0.2)
    assert {e.item_id for e in held} == {e.item_id for e in again_held}
    assert not {e.item_id for e in train} & {e.item_id for e in held}
    assert 20 <= len(held) <= 60 and all(is_heldout(e.item_id, 0.2) for e in held)


def make_trainer(out: Path, **overrides) -> Trainer:
    options = dict(out=str(out), max_steps=1, lr=1e-3, max_answer_tokens=3, progress=False)
    options.update(overrides)
    return Trainer(TrainConfig(**options), examples=EXAMPLES, loaded=load_model())


def test_one_step_lowers_the_loss_and_the_adapter_round_trips(
    engine: KVRAGEngine, tmp_path: Path
) -> None:
    trainer = make_trainer(tmp_path / "run", lr=1e-4)
    sample = trainer.sample(0)
    before, _ = sample_loss(trainer.model, trainer.teacher, sample)
    trainer.train_step()
    after, _ = sample_loss(trainer.model, trainer.teacher, sample)
    assert float(after) < float(before)

    out = trainer.save(tmp_path / "adapter")
    assert (out / "adapter_model.safetensors").is_file()
    from peft import PeftModel

    reloaded = PeftModel.from_pretrained(load_model().model, str(out))
    trained = {k: v for k, v in trainer.model.named_parameters() if "lora_" in k}
    again = dict(reloaded.named_parameters())
    assert trained and all(torch.equal(v, again[k].detach()) for k, v in trained.items())

    # on_miss="encode": its chunks are not cached yet, and this compares turbo's logits
    # (at model precision: the student saw float32 caches)
    tuned = KVRAGEngine.from_pretrained(adapter=out, on_miss="encode", cache_precision="model")
    assert tuned.fingerprint != engine.fingerprint
    assert tuned.chunk_key(CHUNKS[0]) != engine.chunk_key(CHUNKS[0])
    # Inference with the merged adapter is what the student saw in training.
    inference = tuned.prefill(question=QUESTION, chunks=CHUNKS, strategy="turbo").logits
    prompt_only = prompt_sample(engine, [])
    with torch.no_grad():
        last = torch.tensor([prompt_only.num_tokens - 1])
        student = student_logits(trainer.model, prompt_only, last)
    torch.testing.assert_close(student[0], inference, atol=1e-3, rtol=0)


def test_resume_continues_at_the_saved_step(tmp_path: Path) -> None:
    straight = make_trainer(tmp_path / "a", max_steps=2, save_every=1)
    straight.fit()
    first = make_trainer(tmp_path / "b", max_steps=1, save_every=1)
    first.fit()
    resumed = make_trainer(tmp_path / "b", max_steps=2, save_every=1)
    assert resumed.resume() == 1
    resumed.fit()
    assert resumed.step == 2 and resumed.losses[0] == straight.losses[0]
    expected, got = trainable_state(straight.model), trainable_state(resumed.model)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_cli_mounts_as_a_subcommand() -> None:
    import argparse

    from kvrag_integrations.train.cli import config_from_args, register, run

    parser = argparse.ArgumentParser(prog="kvrag")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "--out", "x", "--max-steps", "7", "--full", "--lr", "1e-5"])
    config = config_from_args(args)
    assert args.func is run
    assert (config.out, config.max_steps, config.full, config.lr) == ("x", 7, True, 1e-5)
