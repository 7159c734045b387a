"""`specdec distill` (specdec/distill/): an unrelated tiny draft learns a tiny target, a draft
equal to the target stays equal, the losses are what they say, a run resumes exactly, LoRA
merges into a plain checkpoint, and the written draft serves.

Here the unit tests; the other tiers' are in tests/service/test_distill.py and
tests/e2e/test_distill.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdec.distill.objectives import Loss, TopK, per_position, top_k_of
from specdec.maths.alignment import acceptance_per_position
from specdec.types import SamplingParams
from specdec_cli import tiny
from specdec_cli.main import main


def test_one_minus_tv_is_the_acceptance_the_services_compute():
    """With every id kept (k = vocab), 1 − the TV loss is the sampled α of the acceptance maths."""
    generator = torch.Generator().manual_seed(0)
    target, draft = torch.randn(5, 12, generator=generator) * 2, torch.randn(5, 12, generator=generator) * 2
    tv = per_position(draft, top_k_of(target, 12), Loss.TV)
    alpha = acceptance_per_position(target, draft, SamplingParams(temperature=1.0), top_k=12)
    assert torch.allclose(1 - tv, alpha, atol=1e-3)  # the TV loss is smoothed below 1e-4 per id


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


@pytest.mark.parametrize("argv, message", [
    ([], "give --draft"),
    (["--draft", "D", "--loss", "ce"], "--loss ce is for --heads"),
    (["--heads", "-1"], "--heads must be >= 1"),
    (["--heads", "2", "--draft", "D"], "give no --draft"),
    (["--heads", "2", "--lora-rank", "4"], "--lora-rank is for drafts"),
    (["--draft", "D", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["--heads", "2", "--steps", "0"], "--steps must be >= 1, got 0"),
])
def test_the_cli_says_what_a_distill_run_lacks(argv, message, capsys):
    with pytest.raises(SystemExit, match=message):
        main(["distill", "--target", "T", "--out", "O", *argv])


@pytest.mark.parametrize("losses, ends", [
    ([5.0, 4.0, 3.0, 2.0, 1.0], (4.5, 1.5)),           # a 5-step run: the first 2 against the last 2
    ([7.0], (7.0, 7.0)),                                # one step: that one
    ([], (None, None)),
    ([1.0] * 10 + [0.5] * 20 + [0.25] * 10, (1.0, 0.25)),  # a long run: 10 steps at each end
])
def test_a_short_runs_report_compares_steps_it_does_not_share(losses, ends):
    from specdec.distill.run import loss_ends

    assert loss_ends(losses) == ends


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


def test_head_k_learns_the_position_k_ahead_inside_its_window():
    from specdec.distill.heads_training import HeadsData, head_targets

    top = TopK(torch.arange(10).unsqueeze(-1), torch.ones(10, 1))  # position i's top id is i
    data = HeadsData(torch.zeros(10, 4), top, torch.arange(100, 110), torch.tensor([4] * 4 + [10] * 6), [], [], 12)
    rows = torch.tensor([0, 2, 3, 4, 8])
    kl = head_targets(data, rows, 1, Loss.KL)  # the target's distribution at t + 1 (it chooses t + 2)
    assert kl.valid.tolist() == [True, True, False, True, True] and kl.top.ids[kl.valid, 0].tolist() == [1, 3, 5, 9]
    ce = head_targets(data, rows, 1, Loss.CE)  # the data's token at t + 2
    assert ce.valid.tolist() == [True, False, False, True, False] and ce.token[ce.valid].tolist() == [102, 106]


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
