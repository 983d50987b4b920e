"""``trainfit verify``'s flags (the command: :mod:`trainfit.commands.verify`)."""

from __future__ import annotations

from trainfit.commands.flags import add_output_group, add_run_flags

FRAMEWORKS = ("hf-trainer", "accelerate", "lightning")
"""Mirror of ``trainfit.integrations.frameworks.FRAMEWORKS`` (that module imports torch): ``--framework``'s
choices."""
LOSSES = ("default", "token-weighted")
"""Mirror of ``trainfit.integrations.frameworks.LOSSES``: ``--framework-loss``'s choices."""
UNUSED = ("checkpoint_every", "checkpoint_minutes", "keep_checkpoints", "save_every", "eval_every", "eval_batches",
          "log")
"""Run flags one verified step does not read (it writes no checkpoint, export, evaluation or log)."""


def register(sub) -> None:
    p = sub.add_parser("verify", help="check one step of the configured levers against the fp32 reference")
    groups = add_run_flags(p, leave_out=UNUSED)
    groups["model"].add_argument(
        "--trainer", metavar="MODULE:CALLABLE", default="",
        help="with --framework hf-trainer: your transformers.Trainer subclass (its own compute_loss), run in place "
             "of the Trainer")
    groups["data"].add_argument(
        "--collator", metavar="MODULE:CALLABLE", default="",
        help="with --framework hf-trainer: your data collator, its class or a function of tokenizer returning one "
             "(e.g. transformers:DataCollatorWithPadding); each row goes through it once, seeded, so every run sees "
             "the same masks")
    fw = p.add_argument_group("framework")
    fw.add_argument("--framework", choices=FRAMEWORKS, default=None,
                    help="run THAT tool's own optimizer step with accumulation and without, on micro-batches with "
                         "uneven target counts: reports its accumulation error (exit 1) apart from its normalisation "
                         "difference to the fp32 token mean (hf-trainer: --model hf:DIR or hf:<Class>, any head; "
                         "--data rows with text and label(s))")
    fw.add_argument("--framework-loss", choices=LOSSES, default="default",
                    help="with --framework accelerate|lightning: the loop's loss, the micro-batch mean (default) or "
                         "token-weighted (sum / the window's token count, the fix)")
    fw.add_argument("--from", dest="from_file", metavar="FILE",
                    help="the job from a transformers TrainingArguments JSON, an accelerate config YAML or Lightning "
                         "Trainer arguments (flags override it); with --framework hf-trainer the Trainer runs with "
                         "those TrainingArguments")
    out = add_output_group(p)
    out.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    out.add_argument("--report", action="store_true",
                     help="also save RUN_DIR/verify.json and write RUN_DIR/report.html")
