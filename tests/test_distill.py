"""`specdec distill` (specdec/distill/): an unrelated tiny draft learns a tiny target, a draft
equal to the target stays equal, the losses are what they say, a run resumes exactly, LoRA
merges into a plain checkpoint, and the written draft serves."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from specdec.distill.objectives import Loss, TopK, per_position, top_k_of
from specdec.distill.run import REPORT_FILE, DistillConfig, distill
from specdec.distill.trainer import Trainer
from specdec.maths.alignment import acceptance_per_position
from specdec.types import SamplingParams
from specdec.v1 import coordinator_pb2
from specdec_cli import tiny
from specdec_cli.main import main
from tests.cluster import Cluster


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models train faster on one thread than on two (no thread team to sync per op), and a
    busy machine cannot starve a team of one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


@pytest.mark.e2e
def test_an_unrelated_draft_learns_the_target_and_serves(pair, tmp_path, capsys):
    out = tmp_path / "distilled"
    assert main(["distill", "--target", pair["target"], "--draft", pair["draft"], "--out", str(out),
                 "--prompts", pair["train"], "--eval-prompts", pair["eval"], "--steps", "150", "--lr", "2e-2",
                 "--seq-len", "64", "--max-new-tokens", "24", "--eval-new-tokens", "24", "--no-progress"]) == 0
    report = json.loads((out / REPORT_FILE).read_text())
    before, after = report["before"]["alpha"], report["after"]["alpha"]
    assert before["greedy"] < 0.15 and after["greedy"] >= 0.5, report
    assert after["sampled_t1"] > before["sampled_t1"] + 0.2, report
    assert report["steps"] == 150 and report["loss_last"] < report["loss_first"]
    assert not (out / "checkpoint").exists()
    assert "greedy" in capsys.readouterr().out
    # served: a greedy γ = 1 round accepts its one draft with the per-position α measured above
    with Cluster(str(out), pair["target"]) as cluster:
        prompts = Path(pair["eval"]).read_text().splitlines()
        accepted = proposed = 0
        for prompt in prompts:
            stats = cluster.complete(prompt=prompt, max_new_tokens=24, num_speculative_tokens=1,
                                     proposer=coordinator_pb2.Proposer.Value("PROPOSER_DRAFT")).stats
            accepted, proposed = accepted + stats.accepted_tokens, proposed + stats.draft_tokens
    assert accepted / proposed >= 0.5


@pytest.mark.service
def test_a_draft_equal_to_the_target_stays_there(pair, tmp_path):
    report = distill(_small(pair, tmp_path / "same", draft=pair["target"], steps=30, eval_prompts="",
                            held_out=0.1))
    assert report.before["alpha"] == {"greedy": 1.0, "sampled_t1": 1.0}
    assert report.after["alpha"]["greedy"] == 1.0 and report.after["alpha"]["sampled_t1"] >= 0.9999


@pytest.mark.service
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


@pytest.mark.service
def test_lora_adapters_are_merged_into_a_plain_checkpoint(pair, tmp_path):
    pytest.importorskip("peft")
    report = distill(_small(pair, tmp_path / "lora", lora_rank=4, steps=60, lr=5e-2))
    files = {p.name for p in (tmp_path / "lora").iterdir()}
    assert "model.safetensors" in files and not any("adapter" in f for f in files)
    assert report.after["alpha"]["greedy"] > report.before["alpha"]["greedy"] + 0.2, report.table()


@pytest.mark.unit
def test_one_minus_tv_is_the_acceptance_the_services_compute():
    """With every id kept (k = vocab), 1 − the TV loss is the sampled α of the acceptance maths."""
    generator = torch.Generator().manual_seed(0)
    target, draft = torch.randn(5, 12, generator=generator) * 2, torch.randn(5, 12, generator=generator) * 2
    tv = per_position(draft, top_k_of(target, 12), Loss.TV)
    alpha = acceptance_per_position(target, draft, SamplingParams(temperature=1.0), top_k=12)
    assert torch.allclose(1 - tv, alpha, atol=1e-3)  # the TV loss is smoothed below 1e-4 per id


@pytest.mark.unit
def test_the_losses_on_the_top_k_and_the_rest():
    target = TopK(torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.3]]))  # the rest holds 0.2
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25]])
    kl = per_position(q.log(), target, Loss.KL)
    expected = 0.5 * torch.log(torch.tensor(0.5 / 0.25)) + 0.3 * torch.log(torch.tensor(0.3 / 0.25)) \
        + 0.2 * torch.log(torch.tensor(0.2 / 0.5))
    assert torch.allclose(kl, expected.reshape(1), atol=1e-6)
    tv = per_position(q.log(), target, Loss.TV)
    assert torch.allclose(tv, torch.tensor([0.5 * (0.25 + 0.05 + 0.3)]), atol=1e-3)
    assert float(per_position(torch.tensor([[0.5, 0.3, 0.1, 0.1]]).log(), target, Loss.KL)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.unit
def test_the_benchmark_scales_a_short_runs_rates_to_a_full_run():
    from bench.distill import estimate

    report = {"steps": 10, "seconds": {"train": 50.0, "teacher": 8.0, "alpha_before": 30.0, "alpha_after": 30.0},
              "config": {"batch_size": 2}, "data": {"windows": 4, "positions": 400, "answer_seconds": 20.0,
                                                    "answer_tokens": 100, "held_out_seconds": 60.0}}
    found = estimate(report, full_prompts=50, new_tokens=100, epochs=2.0, prompt_tokens=100)
    # 10 steps x 2 windows x 100 tokens in 50 s; 100 answer tokens in 20 s; 400 teacher tokens in 8 s
    assert (found["seconds_per_trained_token"], found["seconds_per_answer_token"],
            found["seconds_per_teacher_token"]) == (0.025, 0.2, 0.02)
    hours = found["full_run_hours"]  # 10,000 tokens: trained twice, the target's pass once; 5,000 answered
    assert (hours["train"], hours["answers"], hours["teacher"], hours["alpha"]) == (0.14, 0.28, 0.06, 0.03)


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


@pytest.mark.service
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


@pytest.mark.service
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


@pytest.mark.unit
@pytest.mark.parametrize("argv, message", [
    ([], "give --draft"),
    (["--draft", "D", "--loss", "ce"], "--loss ce is for --heads"),
    (["--heads", "-1"], "--heads must be >= 1"),
    (["--heads", "2", "--draft", "D"], "give no --draft"),
    (["--heads", "2", "--lora-rank", "4"], "--lora-rank is for drafts"),
])
def test_the_cli_says_what_a_distill_run_lacks(argv, message, capsys):
    with pytest.raises(SystemExit, match=message):
        main(["distill", "--target", "T", "--out", "O", *argv])


@pytest.mark.unit
def test_several_prompts_files_are_read_in_the_order_given(tmp_path):
    """`--prompts A B`: every prompt of A, then every prompt of B (JSON lines and plain lines
    alike); a file without a prompt is refused by name."""
    from specdec.distill.data import read_prompt_files

    tokenizer = tiny.word_tokenizer(12)
    first, second, empty = tmp_path / "a.jsonl", tmp_path / "b.txt", tmp_path / "empty.txt"
    first.write_text(json.dumps({"prompt": "w1 w2"}) + "\n\n" + json.dumps({"prompt": "w3"}) + "\n")
    second.write_text("w4 w5 w6\n")
    empty.write_text("\n")
    one = [read_prompt_files([path], tokenizer) for path in (first, second)]
    assert [len(prompts) for prompts in one] == [2, 1]
    assert read_prompt_files([first, second], tokenizer) == one[0] + one[1]
    assert read_prompt_files([second, first], tokenizer) == one[1] + one[0]
    with pytest.raises(ValueError, match="empty.txt holds no prompt"):
        read_prompt_files([first, empty], tokenizer)


@pytest.mark.unit
def test_the_output_layers_input_is_the_hidden_state_the_heads_read():
    """The pre-hook's capture, put through the output layer, gives the model's logits."""
    from transformers import LlamaForCausalLM

    from specdec.distill.heads_training import output_layer_inputs

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny.model_config("llama", 12, 0)).eval()
    ids = torch.tensor([[1, 5, 3, 7]])
    with torch.no_grad(), output_layer_inputs(model) as taken:
        logits = model(input_ids=ids).logits
    assert len(taken) == 1 and taken[0].shape == (1, 4, 32)
    assert torch.allclose(model.get_output_embeddings()(taken[0]), logits)


@pytest.mark.unit
def test_head_k_learns_the_position_k_ahead_inside_its_window():
    from specdec.distill.heads_training import HeadsData, head_targets

    top = TopK(torch.arange(10).unsqueeze(-1), torch.ones(10, 1))  # position i's top id is i
    data = HeadsData(torch.zeros(10, 4), top, torch.arange(100, 110), torch.tensor([4] * 4 + [10] * 6), [], [], 12)
    rows = torch.tensor([0, 2, 3, 4, 8])
    kl = head_targets(data, rows, 1, Loss.KL)  # the target's distribution at t + 1 (it chooses t + 2)
    assert kl.valid.tolist() == [True, True, False, True, True] and kl.top.ids[kl.valid, 0].tolist() == [1, 3, 5, 9]
    ce = head_targets(data, rows, 1, Loss.CE)  # the data's token at t + 2
    assert ce.valid.tolist() == [True, False, False, True, False] and ce.token[ce.valid].tolist() == [102, 106]


@pytest.mark.unit
def test_the_sampled_softmax_is_exact_over_the_whole_vocabulary_and_close_over_a_sample():
    from specdec.distill.heads_training import candidates, head_log_probs

    generator = torch.Generator().manual_seed(0)
    states, weight = torch.randn(1, 6, 16, generator=generator), torch.randn(2000, 16, generator=generator) * 0.3
    exact = torch.log_softmax(states @ weight.T, -1)  # [1, 6, 2000]
    kept = torch.tensor([3, 17, 500])
    ids, log_weight = candidates(kept, 2000, 0, generator)
    assert torch.allclose(head_log_probs(states, weight, None, ids, log_weight, 1.0), exact, atol=1e-5)
    estimates = []
    for _ in range(20):
        ids, log_weight = candidates(kept, 2000, 400, generator)
        assert ids.numel() == 400 and ids[:3].tolist() == [3, 17, 500] and log_weight[:3].eq(0).all()
        estimates.append(head_log_probs(states, weight, None, ids, log_weight, 1.0)[..., :3])
    assert torch.allclose(torch.stack(estimates).mean(0), exact[..., kept], atol=0.05)
