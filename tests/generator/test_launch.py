"""Launch files next to train.py: they parse as shell, carry the spec's --gpus/--nodes, render
deterministically, and `scaffold regen` merges them like train.py (never clobbering an edit)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from generator.cli import cli
from generator.render import LAUNCH_FILES, render_launch
from generator.spec import Spec


def _bash_n(text: str, tmp_path: Path, name: str) -> None:
    path = tmp_path / name.replace("/", "_")
    path.write_text(text)
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, (name, proc.stderr)


@pytest.mark.parametrize("gpus, nodes", [(1, 1), (8, 4)])
def test_launch_files_parse_and_carry_the_numbers(gpus, nodes, tmp_path):
    files = render_launch(Spec(gpus=gpus, nodes=nodes, out="o"))
    assert list(files) == list(LAUNCH_FILES)
    assert files == render_launch(Spec(gpus=gpus, nodes=nodes, out="o"))  # deterministic
    for name, text in files.items():
        _bash_n(text, tmp_path, name)
        assert "{{" not in text and "{%" not in text
    one = files["launch/torchrun.sh"]
    # train.py by the file's own path: relative arguments keep the caller's directory
    assert (
        f'exec torchrun --standalone --nproc-per-node {gpus} "$(dirname "$0")/../train.py" "$@"'
        in one
    )
    assert "\ncd " not in one and "\ncd " not in files["launch/torchrun_multinode.sh"]
    multi = files["launch/torchrun_multinode.sh"].split("exec torchrun")[1]
    for flag in (
        f"--nnodes {nodes}",
        f"--nproc-per-node {gpus}",
        '--node-rank "$NODE_RANK"',
        "--rdzv-backend c10d",
        '--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"',
    ):
        assert flag in multi, flag
    slurm = files["launch/slurm.sbatch"]
    for line in (
        f"#SBATCH --nodes={nodes}\n",
        "#SBATCH --ntasks-per-node=1\n",
        f"#SBATCH --gpus-per-node={gpus}\n",
        'head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"\n',
    ):
        assert line in slurm, line
    srun = slurm.split("srun torchrun")[1]
    for flag in (f"--nnodes {nodes}", f"--nproc-per-node {gpus}", '"$head_node:29500"'):
        assert flag in srun, flag


def test_multinode_line_refuses_to_start_without_node_rank(tmp_path):
    """Run with no NODE_RANK/MASTER_ADDR, the multi-node file stops with a message naming the
    variable, before torchrun is called."""
    path = tmp_path / "multi.sh"
    path.write_text(render_launch(Spec(gpus=2, nodes=2, out="o"))["launch/torchrun_multinode.sh"])
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "MASTER_ADDR")}
    proc = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and "set NODE_RANK to the index of this node, 0..1" in proc.stderr


def _new(tmp_path: Path, *args: str) -> Path:
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["new", "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    return out


def test_new_writes_launch_files_and_header_names_them(tmp_path):
    out = _new(tmp_path, "--gpus", "4", "--nodes", "2")
    for name, text in render_launch(Spec(gpus=4, nodes=2, out=str(out))).items():
        assert (out / name).read_text() == text
        assert (out / ".scaffold" / name).read_text() == text  # regen's merge base
        assert os.access(out / name, os.X_OK)
    header = (out / "train.py").read_text().split('"""')[1]
    assert "bash launch/torchrun.sh" in header and "sbatch launch/slurm.sbatch" in header
    assert "2 node(s) x 4 GPU(s)" in header


def test_regen_merges_launch_edits_and_never_clobbers_them(tmp_path):
    out = _new(tmp_path)
    slurm = out / "launch" / "slurm.sbatch"
    edited = slurm.read_text().replace(
        "#SBATCH --output=slurm-%j.out\n",
        "#SBATCH --output=slurm-%j.out\n#SBATCH --partition=h100  # user\n",
    )
    slurm.write_text(edited)
    (out / "launch" / "torchrun_multinode.sh").unlink()  # a deletion is an edit too
    result = CliRunner().invoke(cli, ["regen", str(out), "--set", "gpus=8", "--set", "nodes=2"])
    assert result.exit_code == 0, result.output
    new = render_launch(Spec(gpus=8, nodes=2, out=str(out)))
    assert slurm.read_text() == new["launch/slurm.sbatch"].replace(
        "#SBATCH --output=slurm-%j.out\n",
        "#SBATCH --output=slurm-%j.out\n#SBATCH --partition=h100  # user\n",
    )  # the edit and the new numbers
    assert (out / "launch" / "torchrun.sh").read_text() == new["launch/torchrun.sh"]
    assert not (out / "launch" / "torchrun_multinode.sh").exists()  # stays deleted
    assert (out / ".scaffold" / "launch" / "slurm.sbatch").read_text() == new["launch/slurm.sbatch"]

    # an edit of the very line the option changes: conflict markers, .orig kept, exit 1
    before = slurm.read_text().replace("--nproc-per-node 8", "--nproc-per-node 7")
    slurm.write_text(before)
    result = CliRunner().invoke(cli, ["regen", str(out), "--set", "gpus=4"])
    assert result.exit_code == 1
    assert "slurm.sbatch" in result.output and "slurm.sbatch.orig" in result.output
    assert (out / "launch" / "slurm.sbatch.orig").read_text() == before
    text = slurm.read_text()
    assert "<<<<<<< yours" in text and "--nproc-per-node 7" in text and "--nproc-per-node 4" in text
    again = CliRunner().invoke(cli, ["regen", str(out)])
    assert again.exit_code == 1 and "still has conflict markers" in again.output


def test_regen_adds_launch_files_to_an_older_directory(tmp_path):
    """A directory written before launch files existed gains them; a file the user put at one of
    those paths is merged against an empty base, so it conflicts instead of being overwritten."""
    out = _new(tmp_path)
    shutil.rmtree(out / "launch")
    shutil.rmtree(out / ".scaffold" / "launch")
    (out / "launch").mkdir()
    (out / "launch" / "slurm.sbatch").write_text("#!/bin/bash\nsrun python train.py\n")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    result = CliRunner().invoke(cli, ["regen", str(out)])
    assert result.exit_code == 1, result.output  # the user's own slurm.sbatch conflicts
    new = render_launch(Spec(out=str(out)))
    assert (out / "launch" / "torchrun.sh").read_text() == new["launch/torchrun.sh"]
    assert "srun python train.py" in (out / "launch" / "slurm.sbatch").read_text()
    assert (
        out / "launch" / "slurm.sbatch.orig"
    ).read_text() == "#!/bin/bash\nsrun python train.py\n"
    # --abort takes back what the regen created too: the other launch files and their bases
    result = CliRunner().invoke(cli, ["regen", str(out), "--abort"])
    assert result.exit_code == 0, result.output
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not (out / ".scaffold" / "launch").exists()


def test_regen_check_sees_launch_drift(tmp_path):
    out = _new(tmp_path)
    assert CliRunner().invoke(cli, ["regen", "--check", str(tmp_path)]).exit_code == 0
    path = out / "launch" / "torchrun.sh"
    path.write_text(path.read_text() + "# edit\n")
    result = CliRunner().invoke(cli, ["regen", "--check", str(tmp_path)])
    assert result.exit_code != 0 and "launch/torchrun.sh" in result.output


def test_grpo_launch_files_split_the_node_between_trainer_and_engines(tmp_path):
    """GRPO with --engine-gpus: torchrun starts only the trainer's processes; on several nodes the
    Slurm file starts a Ray cluster over the engine GPUs of every node and rank 0 joins it."""
    spec = Spec(algo="grpo", model="llama3.3-70b", gpus=8, nodes=2, engine_gpus=4, engine_tp=4)
    files = render_launch(replace(spec, out="o"))
    for name, text in files.items():
        _bash_n(text, tmp_path, name)
    assert '--nproc-per-node 4 "$(dirname "$0")/../train.py" "$@"' in files["launch/torchrun.sh"]
    assert "--nproc-per-node 4 \\" in files["launch/torchrun_multinode.sh"]
    slurm = files["launch/slurm.sbatch"]
    assert "export CUDA_VISIBLE_DEVICES_RAY=4,5,6,7\n" in slurm
    assert "ray start --head --port 6379 --num-gpus 4 --block" in slurm
    assert "ray start --address $head_node:6379 --num-gpus 4 --block" in slurm
    assert "--nnodes 2 \\\n    --nproc-per-node 4 \\" in slurm
    assert 'train.py --ray_address "$head_node:6379" "$@"' in slurm
    # the Ray cluster starts before the trainer
    assert slurm.index("ray start --head") < slurm.index("srun --overlap torchrun")
    # one node: rank 0 starts a local Ray itself, no cluster lines
    one = render_launch(replace(spec, nodes=1, out="o"))["launch/slurm.sbatch"]
    assert "ray start" not in one and '    train.py "$@"' in one


def _run_sbatch(tmp_path: Path, run_dir: Path, extra_env: dict) -> subprocess.CompletedProcess:
    """Run the rendered slurm.sbatch as Slurm would, with scontrol and srun replaced by scripts
    that print what they were given (srun also the python torchrun would come from)."""
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    (stubs / "scontrol").write_text("#!/bin/bash\necho node1\n")
    (stubs / "srun").write_text('#!/bin/bash\necho "srun python=$(command -v python)"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    sbatch = run_dir / "slurm.sbatch"
    sbatch.write_text(render_launch(Spec(gpus=2, out="o"))["launch/slurm.sbatch"])
    env = {k: v for k, v in os.environ.items() if k not in ("SCAFFOLD_GPU_ENV", "VIRTUAL_ENV")}
    env.update(PATH=f"{stubs}:/usr/bin:/bin", SLURM_SUBMIT_DIR=str(run_dir), SLURM_JOB_NODELIST="node1",
               SLURM_JOB_ID="1", **extra_env)  # fmt: skip
    return subprocess.run(["bash", str(sbatch)], capture_output=True, text=True, env=env)


def _fake_venv(path: Path) -> Path:
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").write_text("#!/bin/bash\n")
    (path / "bin" / "python").chmod(0o755)
    # what a venv's activate does that matters here: its bin first on PATH
    (path / "bin" / "activate").write_text(f'export PATH="{path}/bin:$PATH"\n')
    return path


def test_slurm_activates_the_gpu_env_above_the_run_dir(tmp_path):
    """`make gpu-env`'s .venv-gpu in a parent of the submit directory is activated before srun;
    SCAFFOLD_GPU_ENV names another; one that does not exist is refused in one line."""
    checkout = tmp_path / "checkout"
    venv = _fake_venv(checkout / ".venv-gpu")
    run_dir = checkout / "runs" / "mine"
    run_dir.mkdir(parents=True)
    proc = _run_sbatch(tmp_path, run_dir, {})
    assert proc.returncode == 0, proc.stderr
    assert f"environment: {venv}\n" in proc.stdout
    assert f"srun python={venv}/bin/python\n" in proc.stdout

    other = _fake_venv(tmp_path / "elsewhere")
    proc = _run_sbatch(tmp_path, run_dir, {"SCAFFOLD_GPU_ENV": str(other)})
    assert proc.returncode == 0 and f"srun python={other}/bin/python\n" in proc.stdout

    proc = _run_sbatch(tmp_path, run_dir, {"SCAFFOLD_GPU_ENV": str(tmp_path / "nope")})
    assert proc.returncode == 1 and "srun" not in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        f"slurm.sbatch: SCAFFOLD_GPU_ENV={tmp_path / 'nope'} has no bin/activate (make gpu-env builds one)"
    ]

    lone = tmp_path / "lone"
    lone.mkdir()
    proc = _run_sbatch(tmp_path, lone, {})
    assert proc.returncode == 0 and "environment:" not in proc.stdout


@pytest.mark.parametrize(
    "options, run",
    [
        ([], "cd {out} && python train.py   (or: bash launch/torchrun.sh)"),
        (["--gpus", "2"], "cd {out} && bash launch/torchrun.sh   (torchrun --nproc-per-node 2)"),
        (["--gpus", "2", "--nodes", "2"],
         "cd {out} && sbatch launch/slurm.sbatch   (or: launch/torchrun_multinode.sh)"),
    ],
)  # fmt: skip
def test_new_says_to_run_from_inside_the_directory(options, run, tmp_path):
    """The script's out_dir ("out") is relative to where it runs, and `scaffold plot DIR` reads
    DIR/out: the printed command starts in DIR, so the two meet."""
    out = tmp_path / "my run"
    result = CliRunner().invoke(
        cli, ["new", "--model", "smollm2-135m", "--out", str(out), *options]
    )
    assert result.exit_code == 0, result.output
    quoted = f"'{out}'"  # shell-quoted: the path has a space
    assert f"run: {run.format(out=quoted)}" in result.output.splitlines()
