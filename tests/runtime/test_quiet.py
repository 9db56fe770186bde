"""runtime.quiet: the known start-up noise (torchao's failed CUDA-kernel loads on a CPU-only torch,
the pytree note on torchao's Enums, DeviceMesh's flattened-dim slice) is gone from a real run's
stderr, while any other warning, even from the same emitters, still shows. Real processes: what
is tested is what a process prints from its first import on."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
NOISE = {
    "torchao kernel load": "Failed to load ",
    "pytree enum note": "<enum 'KernelPreference'> is an Enum subclass",
    "mesh slice": "Slicing a flattened dim from root mesh",
}
# The steps that print the noise, and one warning of each kind that must survive the filters.
STEPS = """
import enum, logging, warnings
import torch.utils._pytree as pytree
from runtime.parallel import build_mesh, destroy_distributed, init_distributed

init_distributed("cpu")
mesh = build_mesh("cpu")
mesh["dp"].size()  # a flattened dim, sliced as the scripts slice it

class Color(str, enum.Enum):  # the shape of torchao's Enums (str mixin: a value __eq__)
    RED = "red"

pytree.register_constant(Color)  # the same pytree note, for an Enum that is not torchao's
warnings.warn("a user warning that must show", UserWarning)
logging.getLogger("torchao").warning("another torchao warning that must show")
warnings.warn_explicit(
    "another DeviceMesh warning that must show", UserWarning, "device_mesh.py", 1,
    module="torch.distributed.device_mesh",
)
destroy_distributed()
"""
KEPT = (
    "a user warning that must show",
    "another torchao warning that must show",
    "<enum 'Color'> is an Enum subclass",
    "another DeviceMesh warning that must show",
)


def stderr_of(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


@pytest.mark.skipif(torch.version.cuda is not None, reason="the kernel-load filter is CPU-only")
def test_known_noise_is_silenced_and_every_other_warning_still_shows():
    # `import runtime` first, as in the scripts (the low-bit AdamW slots import torchao after it)
    quiet = stderr_of("import runtime\nimport torchao.optim\n" + STEPS)
    for what, line in NOISE.items():
        assert line not in quiet, f"{what} still printed:\n{quiet}"
    for line in KEPT:
        assert line in quiet, f"{line!r} was swallowed:\n{quiet}"
    # the control: torchao imported before runtime, and the mesh filter taken out again, print
    # all three (so the lines above are absent because of the filters, not of the versions)
    control = stderr_of(
        "import torchao.optim\nimport runtime, warnings\n"
        "warnings.filters[:] = [f for f in warnings.filters if not (f[1] and 'flattened' in "
        "f[1].pattern)]\n" + STEPS
    )
    for what, line in NOISE.items():
        assert line in control, f"{what}: the control no longer prints it\n{control}"


@pytest.mark.skipif(torch.version.cuda is not None, reason="the kernel-load filter is CPU-only")
def test_qlora_run_prints_none_of_the_known_noise(tiny_model_dir, small_dataset, tmp_path):
    """One QLoRA step (torchao's NF4 base, the mesh's flattened dims) on the tiny model: stderr
    holds no known noise line and no other warning either."""
    args = [
        *("--model", str(tiny_model_dir), "--dataset", str(small_dataset), "--dtype", "fp32"),
        *("--max_steps", "1", "--warmup_steps", "0", "--max_seq_len", "64"),
        *("--micro_batch_size", "2", "--eval_every_steps", "0", "--val_fraction", "0"),
        *("--sample_max_new_tokens", "0", "--save_merged", "false"),
        *("--out_dir", str(tmp_path / "out")),
    ]
    script = REPO / "examples" / "qlora_smollm2" / "train.py"
    proc = subprocess.run(
        [sys.executable, str(script), *args], cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for what, line in NOISE.items():
        assert line not in proc.stderr, f"{what} printed:\n{proc.stderr}"
    # no other warning either: Python's ("...: UserWarning: ...") nor torch's logger ("W1202 ...")
    assert "Warning" not in proc.stderr, proc.stderr
    assert not re.search(r"^(\[rank\d+\]:)?W\d{4} ", proc.stderr, re.MULTILINE), proc.stderr
