"""`specdec distill`: train a draft to match the target's next-token distributions
(specdec/distill/), write it where `specdec serve draft --model` loads it, and report α
before and after; or with --heads K, train K Medusa-style heads on the target
(specdec/distill/heads_training.py), write them where `specdec serve target --heads` loads them, and
report their accuracy before and after."""

from __future__ import annotations

import argparse
import json

from specdec.config import DTYPES

from specdec_cli.env import env_default


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("distill", help="train a draft on the target's distributions, or heads on the target "
                                       "(docs/models.md#distilled-drafts, docs/models.md#heads)")
    p.add_argument("--target", required=True, help="the target model: directory, hub id or .gguf file")
    p.add_argument("--draft", default="", help="the draft to start from: directory, hub id or .gguf file "
                                               "(required, except with --heads)")
    p.add_argument("--heads", type=int, default=0, help="K > 0: no draft; train K Medusa-style heads on the "
                                                        "target's last hidden states, sharing its output layer")
    p.add_argument("--out", required=True, help="directory the distilled draft (a transformers checkpoint), or "
                                                "the heads, and distill-report.json are written to")
    p.add_argument("--records", default="", help="a coordinator's records (--record-dir): the directory or one "
                                                 "file; with --records-stream, the Redis URL")
    p.add_argument("--records-stream", default="", help="the Redis stream of the records (--record-stream) at "
                                                        "the URL --records gives")
    p.add_argument("--text", nargs="+", default=[], help="text files to learn on, each one sequence")
    p.add_argument("--prompts", nargs="+", default=[], help="prompts files the target answers, the draft learns "
                                                            "on the answers: JSON lines ({\"prompt\": ...} or "
                                                            "{\"messages\": [...]}) or one prompt per line")
    p.add_argument("--eval-prompts", default="", help="held-out prompts (same format) the target answers "
                                                      "greedily; α is measured on the answers (default: "
                                                      "--held-out of the data)")
    p.add_argument("--held-out", type=float, default=0.1, help="without --eval-prompts: the fraction of the "
                                                               "sequences (and prompts) held out for α")
    p.add_argument("--loss", choices=("kl", "tv", "ce"), default="kl",
                   help="forward KL(target || draft), or total variation (1 - TV is α); with --heads also "
                        "ce: cross-entropy on the data's token (kl and tv: the target's distribution)")
    p.add_argument("--top-k", type=int, default=32, help="the target's distribution at each position kept as "
                                                         "its k most likely ids plus the rest (bounds memory)")
    p.add_argument("--temperature", type=float, default=1.0, help="the distributions matched are "
                                                                  "softmax(logits / temperature)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=0, help="windows per step (0: 8); with --heads, positions "
                                                            "per step (0: 256)")
    p.add_argument("--seq-len", type=int, default=256, help="longest training window in tokens")
    p.add_argument("--lr", type=float, default=0.0, help="learning rate (0: 2e-5, 2e-4 with --lora-rank, 1e-3 "
                                                          "with --heads)")
    p.add_argument("--head-vocab", type=int, default=8192,
                   help="--heads: a step's softmax runs over the ids its loss reads plus random others up to "
                        "this many, those standing for the rest of the vocabulary (0: the whole vocabulary)")
    p.add_argument("--proposal-vocab", type=int, default=32768,
                   help="--heads: the served heads propose from this many ids only, those the training data "
                        "holds most often (each Verify then reads that slice of the output layer, not all of "
                        "it; 0: the whole vocabulary)")
    p.add_argument("--warmup", type=int, default=0, help="steps of linear learning-rate warm-up")
    p.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank on every linear "
                                                            "layer (needs peft: the distill extra), merged "
                                                            "into the written weights; 0 = train every weight")
    p.add_argument("--lora-alpha", type=float, default=0.0, help="LoRA alpha (0: twice the rank)")
    p.add_argument("--device", default=env_default("distill", "device", "cpu"),
                   help="torch device of both models: cpu, cuda, cuda:1 ... (env SPECDEC_DISTILL_DEVICE)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="the draft's dtype while it trains")
    p.add_argument("--target-dtype", choices=DTYPES, default="float32", help="the target's dtype")
    p.add_argument("--save-dtype", choices=("", *DTYPES), default="",
                   help="dtype of the written weights (default: the draft checkpoint's own)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="--prompts: tokens the target answers with")
    p.add_argument("--generate-temperature", type=float, default=1.0,
                   help="--prompts: the target answers sampled at this temperature (0: greedy)")
    p.add_argument("--eval-new-tokens", type=int, default=128, help="held-out prompts: tokens the target "
                                                                    "answers with (greedy)")
    p.add_argument("--proposal-top-k", type=int, default=32, help="the draft service's --proposal-top-k, "
                                                                  "for the sampled α")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints in OUT/checkpoint")
    p.add_argument("--resume", action="store_true", help="go on from OUT/checkpoint (its data and step)")
    p.add_argument("--keep-checkpoint", action="store_true", help="keep OUT/checkpoint after the run")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffles and the sampled answers")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from specdec.distill.run import DistillConfig, distill
    from specdec.tokenizer import ModelLoadError

    heads = args.heads > 0
    if args.heads < 0:
        raise SystemExit(f"specdec distill: --heads must be >= 1 (or 0 for a draft), got {args.heads}")
    if not heads and not args.draft:
        raise SystemExit("specdec distill: give --draft (the draft to distil), "
                         "or --heads K to train heads on the target")
    if args.loss == "ce" and not heads:
        raise SystemExit("specdec distill: --loss ce is for --heads (a draft learns the target's distributions)")
    config = DistillConfig(
        target=args.target, draft=args.draft, out=args.out, records=args.records,
        records_stream=args.records_stream, text=tuple(args.text), prompts=tuple(args.prompts),
        eval_prompts=args.eval_prompts, held_out=args.held_out, loss=args.loss, top_k=args.top_k,
        temperature=args.temperature, steps=args.steps, batch_size=args.batch_size or (256 if heads else 8),
        seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        device=args.device, dtype=args.dtype, target_dtype=args.target_dtype, save_dtype=args.save_dtype,
        max_new_tokens=args.max_new_tokens, generate_temperature=args.generate_temperature,
        eval_new_tokens=args.eval_new_tokens, proposal_top_k=args.proposal_top_k,
        checkpoint_every=args.checkpoint_every, resume=args.resume, keep_checkpoint=args.keep_checkpoint,
        seed=args.seed, progress=not args.no_progress, heads=args.heads, head_vocab=args.head_vocab,
        proposal_vocab=args.proposal_vocab)
    for name, value in (("--steps", config.steps), ("--batch-size", config.batch_size), ("--top-k", config.top_k),
                        ("--head-vocab", config.head_vocab), ("--proposal-vocab", config.proposal_vocab)):
        if value < 1 and not (name in ("--steps", "--head-vocab", "--proposal-vocab") and value == 0):
            raise SystemExit(f"specdec distill: {name} must be >= 1, got {value}")
    try:
        if heads:
            from specdec.distill.heads_run import distill_heads

            report = distill_heads(config)
        else:
            report = distill(config)
    except (ModelLoadError, ValueError, FileNotFoundError, RuntimeError) as exc:
        raise SystemExit(f"specdec distill: {exc}")
    print(report.table(), flush=True)
    print(json.dumps({"before": report.before, "after": report.after}), flush=True)
    return 0
