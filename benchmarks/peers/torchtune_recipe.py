"""torchtune's stock `full_finetune_single_device` recipe with two benchmark-only changes.

1. Every per-step metric line also carries `real_tokens` (non-pad input tokens of the step, counted
   by id: the SmolLM2 tokenizer here pads with `<|endoftext|>`, which never occurs in the data)
   and `label_tokens` (the tokens the stock recipe counts, labels != -100; its
   `tokens_per_second_per_gpu` is `label_tokens / step time`, so the step time can be recovered).
2. `save_checkpoint` does nothing: the stock recipe always writes the full model at the end of an
   epoch, which a throughput benchmark does not want (disk, time, and RSS after training).

Training itself (model, loss, optimizer, optimizer-in-backward, dtype, clipping, timing) is the
stock recipe's code, inherited unchanged. Launched by `torchtune_run.py` as

    cd benchmarks/peers && tune run torchtune_recipe.py --config torchtune_sft.yaml ...

(`tune run` imports a custom recipe as a module from the working directory).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torchtune
from omegaconf import DictConfig
from torchtune import config


def _load_stock_recipe_class():
    """Import the installed stock recipe file (torchtune forbids `import recipes...`)."""
    path = Path(torchtune.__file__).parent.parent / "recipes" / "full_finetune_single_device.py"
    spec = importlib.util.spec_from_file_location("torchtune_stock_full_finetune", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FullFinetuneRecipeSingleDevice


FullFinetuneRecipeSingleDevice = _load_stock_recipe_class()


class _CountingLogger:
    """Wraps the recipe's metric logger and adds the step's token counts to each `log_dict`."""

    def __init__(self, inner, recipe: BenchmarkRecipe) -> None:
        self._inner = inner
        self._recipe = recipe

    def log_dict(self, payload, step: int) -> None:
        payload = dict(payload)
        payload["real_tokens"] = self._recipe.bench_real_tokens
        payload["label_tokens"] = self._recipe.bench_label_tokens
        self._recipe.bench_real_tokens = 0
        self._recipe.bench_label_tokens = 0
        self._inner.log_dict(payload, step=step)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class BenchmarkRecipe(FullFinetuneRecipeSingleDevice):
    """The stock single-device full fine-tuning recipe plus token counting, minus saving."""

    def setup(self, cfg: DictConfig) -> None:
        super().setup(cfg)
        self.bench_real_tokens = 0
        self.bench_label_tokens = 0
        self._metric_logger = _CountingLogger(self._metric_logger, self)

    def _loss_step(self, batch):
        # Count before the stock step pops the labels.
        self.bench_real_tokens += int((batch["tokens"] != self._tokenizer.pad_id).sum())
        self.bench_label_tokens += int((batch["labels"] != self._loss_fn.ignore_index).sum())
        return super()._loss_step(batch)

    def save_checkpoint(self, epoch: int) -> None:
        """Benchmark runs save nothing."""


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point, as in the stock recipe."""
    config.log_config(recipe_name="BenchmarkRecipe", cfg=cfg)
    recipe = BenchmarkRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
