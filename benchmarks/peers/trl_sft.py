"""TRL peer for the CPU SFT benchmark: full fine-tuning of SmolLM2-135M with `SFTTrainer`.

Runs in the TRL venv (`benchmarks/.venvs/trl`, built by `benchmarks/peers.py`):

    benchmarks/.venvs/trl/bin/python benchmarks/peers/trl_sft.py --max_steps 12 --dtype bf16

Setup, kept equal across the benchmarked tools:
- data: the Alpaca demo rows as conversational prompt-completion pairs (prompt = user turn,
  completion = assistant turn, see `sft_data.py`); TRL renders them with the model's chat template.
  For prompt-completion data TRL's default is `completion_only_loss=True`: the prompt (system +
  user turns and the `<|im_start|>assistant\\n` header) is masked and the loss covers the
  completion and its closing `<|im_end|>\\n`.
- batches: micro-batch `--micro_batch_size`, no gradient accumulation, sequences truncated to
  `--max_seq_len` and padded to exactly `--max_seq_len` (`pad_to_multiple_of=max_seq_len`).
- optimizer: AdamW (torch), constant `--lr`, no warmup, weight decay 0, `max_grad_norm` 1.0.
- dtype: fp32, or bf16 = TRL's `bf16=True` (autocast over fp32 weights and fp32 AdamW state).
- no eval, no checkpoint saving, seed 0.

Timing: a TrainerCallback measures each optimizer step from `on_step_begin` to `on_step_end`
(forward, backward, clip, optimizer step; batch fetching is outside). Step 1 is a warm-up and is
excluded. Real tokens are the non-pad tokens of the timed steps, from the attention masks (TRL's own
running `num_tokens` counter, logged every step).

Prints one final JSON line:
{"tool": "trl", "dtype", "steps", "losses", "real_tokens", "seconds", "tokens_per_s", "peak_rss_mib"}
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_data import check_inputs, data_path, model_dir, user_content  # noqa: E402


class StepTimer(TrainerCallback):
    """Records per-step wall time, per-step loss and TRL's cumulative non-pad token count."""

    def __init__(self) -> None:
        self.step_seconds: dict[int, float] = {}
        self.losses: dict[int, float] = {}
        self.num_tokens: dict[int, int] = {}
        self._t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        # state.global_step is already incremented for the step that just finished.
        self.step_seconds[state.global_step] = time.perf_counter() - self._t0

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])
        if "num_tokens" in logs:
            self.num_tokens[state.global_step] = int(logs["num_tokens"])


def build_dataset() -> Dataset:
    """Alpaca rows as conversational prompt-completion examples."""
    rows = json.loads(data_path().read_text())
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": user_content(row)}],
                "completion": [{"role": "assistant", "content": row["output"]}],
            }
            for row in rows
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro_batch_size", type=int, default=4)
    p.add_argument("--max_seq_len", type=int, default=256)
    p.add_argument("--max_steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tricks",
        default="",
        help="no-ac: gradient_checkpointing=False (TRL 1.x's SFTConfig turns it on by default)",
    )
    args = p.parse_args(argv)
    unknown = [t for t in args.tricks.split(",") if t and t != "no-ac"]
    if unknown:
        p.error(f"--tricks: unknown {unknown}; valid: no-ac")
    return args


def summarize(timer: StepTimer, dtype: str, steps: int) -> dict:
    """The benchmark's result record; step 1 (warm-up) is excluded from tokens and seconds."""
    timed = [s for s in sorted(timer.step_seconds) if s >= 2]
    seconds = sum(timer.step_seconds[s] for s in timed)
    real_tokens = 0
    if timed:
        real_tokens = timer.num_tokens[timed[-1]] - timer.num_tokens[1]
    return {
        "tool": "trl",
        "dtype": dtype,
        "steps": steps,
        "losses": [timer.losses[s] for s in sorted(timer.losses)],
        "real_tokens": real_tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(real_tokens / seconds, 2) if seconds > 0 else 0.0,
        # ru_maxrss is in KiB on Linux.
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_inputs()
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    model = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32)
    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out_dir:
        config = SFTConfig(
            output_dir=out_dir,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.micro_batch_size,
            gradient_accumulation_steps=1,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            optim="adamw_torch",
            max_length=args.max_seq_len,
            pad_to_multiple_of=args.max_seq_len,  # every batch is exactly max_seq_len long
            packing=False,
            bf16=args.dtype == "bf16",
            use_cpu=True,
            logging_steps=1,
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=args.seed,
            data_seed=args.seed,
            # TRL's own default (True) unless the tool is "trl+no-ac"
            **({"gradient_checkpointing": False} if "no-ac" in args.tricks.split(",") else {}),
        )
        trainer = SFTTrainer(
            model=model,
            args=config,
            train_dataset=build_dataset(),
            processing_class=tokenizer,
            callbacks=[timer],
        )
        assert trainer.completion_only_loss, "expected TRL's completion-only loss default"
        trainer.train()
    print(json.dumps(summarize(timer, args.dtype, args.max_steps)), flush=True)


if __name__ == "__main__":
    main()
