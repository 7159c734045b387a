"""`specdec distill` (specdec/distill/): an unrelated tiny draft learns a tiny target, a draft
equal to the target stays equal, the losses are what they say, a run resumes exactly, LoRA
merges into a plain checkpoint, and the written draft serves.

Here the service tests; the other tiers' are in tests/unit/test_distill.py and
tests/e2e/test_distill.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from specdec.distill.run import REPORT_FILE, DistillConfig, distill
from specdec.distill.trainer import Trainer
from specdec_cli import tiny
from specdec_cli.main import main


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 12-token target of one layer and an unrelated draft of the same shape (another seed),
    with prompts files: random word sequences."""
    root = tmp_path_factory.mktemp("distill")
    tokenizer = tiny.word_tokenizer(12)
    target = tiny.build_model(root / "target", tokenizer, "llama", seed=21, layers=1, init_std=0.15)
    draft = tiny.build_model(root / "draft", tokenizer, "llama", seed=26, layers=1, init_std=0.3)
    rng = random.Random(0)

    def prompts(name: str, count: int) -> str:
        lines = [" ".join(f"w{rng.randint(1, 11)}" for _ in range(rng.randint(2, 6))) for _ in range(count)]
        (root / name).write_text("\n".join(lines) + "\n")
        return str(root / name)
    return {"root": root, "target": str(target), "draft": str(draft), "train": prompts("train.txt", 160),
            "eval": prompts("eval.txt", 24)}


def _small(pair, out: Path, **overrides) -> DistillConfig:
    settings = dict(target=pair["target"], draft=pair["draft"], out=str(out), prompts=(pair["train"],),
                    eval_prompts=pair["eval"], steps=150, lr=2e-2, batch_size=8, seq_len=64, max_new_tokens=24,
                    eval_new_tokens=24, progress=False)
    return DistillConfig(**{**settings, **overrides})


def test_a_draft_equal_to_the_target_stays_there(pair, tmp_path):
    report = distill(_small(pair, tmp_path / "same", draft=pair["target"], steps=30, eval_prompts="",
                            held_out=0.1))
    assert report.before["alpha"] == {"greedy": 1.0, "sampled_t1": 1.0}
    assert report.after["alpha"]["greedy"] == 1.0 and report.after["alpha"]["sampled_t1"] >= 0.9999


def test_an_interrupted_run_resumes_where_it_stopped(pair, tmp_path, monkeypatch):
    """Killed at step 12 of 20, then resumed: the same weights as a run never interrupted (the
    batches are a function of the step, the optimizer state is in the checkpoint)."""
    whole = _small(pair, tmp_path / "whole", steps=20, checkpoint_every=4, eval_prompts="", held_out=0.1)
    distill(whole)
    interrupted = _small(pair, tmp_path / "resumed", steps=20, checkpoint_every=4, eval_prompts="", held_out=0.1)
    real_step = Trainer.train_step

    def dies_at_12(self):
        if self.step == 12:
            raise KeyboardInterrupt
        return real_step(self)
    monkeypatch.setattr(Trainer, "train_step", dies_at_12)
    with pytest.raises(KeyboardInterrupt):
        distill(interrupted)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    prepared = tmp_path / "resumed" / "checkpoint" / "prepared.pt"
    made = prepared.stat().st_mtime_ns
    report = distill(DistillConfig(**{**interrupted.__dict__, "resume": True, "keep_checkpoint": True}))
    assert prepared.stat().st_mtime_ns == made  # the target did not run again
    assert report.steps == 20
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_adapters_are_merged_into_a_plain_checkpoint(pair, tmp_path):
    pytest.importorskip("peft")
    report = distill(_small(pair, tmp_path / "lora", lora_rank=4, steps=60, lr=5e-2))
    files = {p.name for p in (tmp_path / "lora").iterdir()}
    assert "model.safetensors" in files and not any("adapter" in f for f in files)
    assert report.after["alpha"]["greedy"] > report.before["alpha"]["greedy"] + 0.2, report.table()


# ---- heads: `specdec distill --heads K` (specdec/distill/heads_training.py) -----------------------------------


@pytest.fixture(scope="module")
def counting(pair):
    """A one-layer 12-token Llama whose greedy text counts w1, w2, …, w11, w1, … from any prompt:
    its embeddings are orthonormal, its output layer maps each token's to the next token's and
    its layers' weights are near zero. Untrained heads (the target's own next-token head) are
    never right two tokens ahead; trained ones can be. With prompts files of random words."""
    from specdec.runtime.loader import load_model

    path = tiny.build_model(pair["root"] / "counting", tiny.word_tokenizer(12), "llama", seed=31, layers=1,
                            init_std=0.02)
    model = load_model(str(path), "float32").model
    embeddings = torch.linalg.qr(torch.randn(32, 12, generator=torch.Generator().manual_seed(31))).Q.T  # [12, 32]
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(embeddings)
        output = torch.zeros(12, 32)
        for token in range(1, 12):  # w_token follows w_(token-1), w1 follows w11; id 0 (EOS) never
            output[token] = embeddings[11 if token == 1 else token - 1]
        model.get_output_embeddings().weight.copy_(output)
    model.save_pretrained(path)
    rng = random.Random(1)
    files = {}
    for name, count in (("train", 64), ("eval", 16)):
        files[name] = pair["root"] / f"counting-{name}.txt"
        files[name].write_text("".join(" ".join(f"w{rng.randint(1, 11)}" for _ in range(rng.randint(2, 6))) + "\n"
                                       for _ in range(count)))
    return {"target": str(path), "train": str(files["train"]), "eval": str(files["eval"])}


def _heads(counting, out: Path, **overrides) -> DistillConfig:
    settings = dict(target=counting["target"], draft="", out=str(out), prompts=(counting["train"],),
                    eval_prompts=counting["eval"], generate_temperature=0.0, heads=2, steps=60, lr=1e-2,
                    batch_size=128, seq_len=64, max_new_tokens=16, eval_new_tokens=16, progress=False)
    return DistillConfig(**{**settings, **overrides})


def test_heads_learn_the_targets_greedy_text_and_bind_to_it(counting, pair, tmp_path, capsys):
    """Through the CLI: on the target's own greedy text, head 1 (the token after next) goes from
    never right to right at least half the time on held-out text; the directory loads for that
    target and is refused, saying why, for another."""
    from specdec.runtime.heads import HeadsMismatch, load_heads, read_meta
    from specdec.runtime.loader import load_model

    out = tmp_path / "heads"
    assert main(["distill", "--heads", "2", "--target", counting["target"], "--out", str(out),
                 "--prompts", counting["train"], "--eval-prompts", counting["eval"], "--generate-temperature", "0",
                 "--steps", "60", "--lr", "1e-2", "--batch-size", "128", "--seq-len", "64", "--max-new-tokens", "16",
                 "--eval-new-tokens", "16", "--proposal-vocab", "11", "--no-progress"]) == 0
    report = json.loads((out / REPORT_FILE).read_text())
    before, after = ({h["head"]: h["top1"] for h in report[when]["heads"]} for when in ("before", "after"))
    # the 11 words the data holds (never EOS, id 0): every held-out token among them, so the heads
    # rank as they do over the whole vocabulary
    assert report["served"]["proposal_vocab"] == 11 and report["served"]["held_out_coverage"] == 1.0
    assert report["served"]["heads"] == report["after"]["heads"]
    assert before[1] < 0.1 and after[1] >= 0.5, report
    assert report["after"]["heads"][0]["positions"] > 100 and report["loss_last"] < report["loss_first"]
    assert not (out / "checkpoint").exists()
    printed = capsys.readouterr().out
    assert "top-1 before -> after" in printed and f"{after[1]:.4f}" in printed
    assert "proposing from 11 ids (100.00% of the held-out tokens)" in printed
    meta = read_meta(out)
    assert meta.num_heads == 2 and meta.report["after"] == report["after"] and meta.proposal_vocab == 11
    heads, _, _, vocab = load_heads(out, load_model(counting["target"], "bfloat16").model, "cpu", torch.float32)
    assert heads.num_heads == 2 and vocab.tolist() == list(range(1, 12))
    with pytest.raises(HeadsMismatch, match="trained for another model"):
        load_heads(out, load_model(pair["target"], "float32").model, "cpu", torch.float32)


def test_an_interrupted_heads_run_resumes_where_it_stopped(counting, tmp_path, monkeypatch):
    """Killed at step 12 of 20, then resumed: the target does not run again and the heads are
    those of a run never interrupted."""
    from safetensors.torch import load_file

    from specdec.distill.heads_training import HEADS_PREPARED_FILE, HeadsTrainer
    from specdec.distill.heads_run import distill_heads

    distill_heads(_heads(counting, tmp_path / "whole", steps=20, checkpoint_every=4))
    interrupted = _heads(counting, tmp_path / "resumed", steps=20, checkpoint_every=4)
    real_step = HeadsTrainer.train_step

    def dies_at_12(self):
        if self.step == 12:
            raise KeyboardInterrupt
        return real_step(self)
    monkeypatch.setattr(HeadsTrainer, "train_step", dies_at_12)
    with pytest.raises(KeyboardInterrupt):
        distill_heads(interrupted)
    monkeypatch.setattr(HeadsTrainer, "train_step", real_step)
    prepared = tmp_path / "resumed" / "checkpoint" / HEADS_PREPARED_FILE
    made = prepared.stat().st_mtime_ns
    report = distill_heads(DistillConfig(**{**interrupted.__dict__, "resume": True, "keep_checkpoint": True}))
    assert prepared.stat().st_mtime_ns == made  # the target did not run again
    assert report.steps == 20
    a, b = (load_file(tmp_path / name / "heads.safetensors") for name in ("whole", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="other settings"):  # a checkpoint of other settings is not resumed
        distill_heads(DistillConfig(**{**interrupted.__dict__, "resume": True, "head_vocab": 4}))
