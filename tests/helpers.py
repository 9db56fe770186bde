"""Shared test helpers (no fixtures: those are in conftest.py). Test modules import from here,
never from each other.

- `spawn`: run a function on N local processes with a gloo (or NCCL) group.
- `TINY_CONFIG`, `full_tensor`, `safetensors_keys`: tiny random configs and tensor/checkpoint views.
- `import_script`, `run_script`: an emitted train.py imported as a module, or launched as
  `python` / `torchrun`.
- `small_tokenizer_files`: SmolLM2's tokenizer cut to its first few hundred ids (the same bytes,
  merges, special tokens and chat template), so tiny test models need no 49,152-row output layer.
- `even_token_reward`, `run_grpo`: the learnable GRPO reward and a short GRPO run.
"""

from __future__ import annotations

import io
import json
import os
import queue as queue_module
import socket
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# an emitted train.py imported as a module: the planner's own function, shared
from generator.plan_harness import import_script

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # never a hard-coded port: parallel test runs must not collide
        return s.getsockname()[1]


# Ranks are forked from one forkserver per test process that has imported these once: a spawned
# interpreter re-imports torch and the runtime (about 8 s of wall time for 2 ranks on 2 cores,
# 0.1 s from the forkserver, measured). The modules are imported before any intra-op thread pool
# starts, so the fork is safe.
_PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "runtime",
    "tests.helpers",
]


def _worker(
    rank: int, world_size: int, port: int, backend: str, fn, args, queue, env: dict, cwd: str
) -> None:
    # a forkserver child has the server's environment and directory, not the caller's: take the
    # caller's (a spawned interpreter inherited them), and its intra-op thread count
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),  # as torchrun sets it (one node)
    )
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buffer = io.BytesIO()  # plain bytes: shared-memory tensors die with this process
        torch.save(result, buffer)
        message = (rank, "ok", buffer.getvalue())
    except BaseException:
        message = (rank, "error", traceback.format_exc())
    # flush to the pipe now: a process that dies in teardown (an abort at exit) must not take its
    # result with it, and the parent must not wait for a message that will never come
    queue.put(message)
    queue.close()
    queue.join_thread()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class RankCrashed(RuntimeError):
    """A rank exited without sending its result (a native crash: killed by a signal)."""


def spawn(
    fn,
    world_size: int = 2,
    backend: str = "gloo",
    args: tuple = (),
    env: dict | None = None,
    cwd: Path | None = None,
) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return results in rank order.

    `fn` must be picklable (a module-level function). Each rank takes this process's environment
    updated with `env`, and its directory or `cwd`. Raises RuntimeError with every failing rank's
    traceback, or RankCrashed naming the ranks that exited without sending a result.

    A run in which a rank is killed by a signal (seen as such, or first as another rank's gloo
    error, "Connection closed by peer") is started once more, with a warning: the 4-rank
    QLoRA + DoRA HSDP test sees glibc abort one rank ("malloc(): unaligned tcache chunk
    detected", SIGABRT) in about 1 run of 5, at b73145c as now, inside torch/torchao native code
    (not found yet). A second crash fails the test; wrong numbers fail it whatever happens.
    """
    env = {**os.environ, **(env or {})}
    cwd = str(cwd or os.getcwd())
    try:
        return _spawn_once(fn, world_size, backend, args, env, cwd)
    except RankCrashed as crash:
        if "signal" not in str(crash):
            raise
        warnings.warn(f"{crash}; running the {world_size} ranks once more", stacklevel=2)
        return _spawn_once(fn, world_size, backend, args, env, cwd)


def _signalled(procs, results: dict, wait_s: float) -> list[int]:
    """The ranks without a result that were killed by a signal, waiting up to wait_s for those
    still running to exit."""
    deadline = time.monotonic() + wait_s
    pending = [r for r in range(len(procs)) if r not in results]
    for r in pending:
        procs[r].join(timeout=max(0.0, deadline - time.monotonic()))
    return [r for r in pending if (procs[r].exitcode or 0) < 0]


def _spawn_once(fn, world_size: int, backend: str, args: tuple, env: dict, cwd: str) -> list:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, queue, env, cwd))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + 600
    while len(results) < world_size:
        try:
            rank, status, payload = queue.get(timeout=5)
            results[rank] = (status, payload)
            if status == "error":
                # a rank killed by a signal often shows first as a peer's gloo error ("Connection
                # closed by peer"): give the others a moment to exit, so such a run is reported
                # (and retried) as the crash it is
                crashed = _signalled(procs, results, wait_s=5)
                # the other ranks may wait in a collective this one never reaches: stop them now
                # and show this traceback, not a deadline 600 s later
                for p in procs:
                    p.kill()
                if crashed:
                    raise RankCrashed(
                        f"ranks {crashed} killed by a signal; rank {rank} then failed:\n{payload}"
                    )
                raise RuntimeError(f"rank {rank}:\n{payload}")
            continue
        except queue_module.Empty:
            pass
        # a worker flushes its message before it exits: one that exited without it crashed
        lost = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
        if lost or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            codes = {r: procs[r].exitcode for r in range(world_size) if r not in results}
            how = (
                "killed by a signal"
                if any(c is not None and c < 0 for c in codes.values())
                else "exited"
            )
            raise RankCrashed(f"ranks {sorted(codes)} sent no result ({how}; exit codes {codes})")
    for p in procs:
        p.join(timeout=60)
    errors = [
        f"rank {r}:\n{msg}" for r, (status, msg) in sorted(results.items()) if status == "error"
    ]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [torch.load(io.BytesIO(results[r][1]), weights_only=False) for r in range(world_size)]


# The tiny random config of parity tests (HF config names): 2 layers, hidden 64, 4 heads, 2 KV
# heads, head_dim 16, intermediate 128, vocab 256. Tests add what they vary.
TINY_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def safetensors_keys(model_dir) -> set[str]:
    """Every tensor name stored in the `*.safetensors` files of `model_dir` (single or sharded)."""
    from safetensors import safe_open

    keys: set[str] = set()
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            keys |= set(f.keys())
    return keys


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered if `t` is an FSDP2/TP DTensor (a collective), else `t` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run_file(rank: int, world_size: int, entry: str, argv: list[str]) -> None:
    """One rank of `run_script`'s forked launch: `entry` run as `python entry *argv` runs it (as
    `__main__`), in a rank whose process group `spawn` has started (the script joins it)."""
    import runpy

    sys.argv = [entry, *argv]
    try:
        runpy.run_path(entry, run_name="__main__")
    except SystemExit as e:  # entry_point's exit code 1 after a one-line error is a failure
        if e.code not in (None, 0):
            raise


def launch(
    entry: Path,
    argv: list[str],
    nproc: int = 1,
    cwd: Path | None = None,
    launcher: str | None = None,
    timeout: int = 600,
) -> None:
    """Run the file `entry` as `python entry *argv` runs it, on `nproc` processes in `cwd`.

    Launchers: "python" (a new interpreter; the default for one process), "torchrun" (one new
    interpreter per rank under torchrun, gloo: where the launcher is what is tested) and "fork"
    (the default for several: gloo ranks forked from `spawn`'s forkserver, which has imported
    torch and the runtime, with what torchrun sets, RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE and MASTER_ADDR/PORT; the script joins their group). A new interpreter per
    rank costs about 6 s for 2 ranks to import torch and the runtime, a fork a tenth of one.
    Several ranks run at 1 intra-op thread each. `timeout` (s) is python's or torchrun's; forked
    ranks have spawn's 600 s. Raises AssertionError with the output's tail (python, torchrun) or
    RuntimeError with the failing rank's traceback (fork)."""
    launcher = launcher or ("python" if nproc == 1 else "fork")
    cwd = Path(cwd or os.getcwd())
    threads = "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2")
    if launcher == "fork":
        spawn(_run_file, nproc, args=(str(entry), argv), env={"OMP_NUM_THREADS": threads}, cwd=cwd)
        return
    command = [sys.executable]
    if launcher == "torchrun":
        command += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    elif launcher != "python" or nproc != 1:
        raise ValueError(f"launcher {launcher!r} with nproc {nproc}: python runs one process")
    proc = subprocess.run(
        [*command, str(entry), *argv],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": threads},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def run_script(
    tmp: Path,
    args: list[str],
    nproc: int = 1,
    timeout: int = 600,
    script: Path = EXAMPLES / "sft_smollm2" / "train.py",
    launcher: str | None = None,
) -> list[dict]:
    """`launch` a script on `nproc` processes in `tmp`, writing into `tmp/out_{nproc}`; return its
    metrics.jsonl rows. For what needs a real process boundary (`run_in_process` for the rest)."""
    out = tmp / f"out_{nproc}"
    launch(script, [*args, "--out_dir", str(out)], nproc, tmp, launcher, timeout)
    return read_metrics(out)


def run_in_process(
    tmp: Path, args: list[str], script: Path = EXAMPLES / "sft_smollm2" / "train.py"
) -> list[dict]:
    """`run_script(tmp, args, nproc=1, script=script)` without a new process: the script's main()
    here (paths in `args` must be absolute); writes into `tmp/out_1`, returns the metrics rows."""
    out = tmp / "out_1"
    name = "inproc_" + "".join(c if c.isalnum() else "_" for c in str(script))
    import_script(script, name).main([*args, "--out_dir", str(out)])
    return read_metrics(out)


def read_metrics(out_dir: Path) -> list[dict]:
    """The rows of `out_dir/metrics.jsonl`, in order."""
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


# ChatML as SmolLM2 writes it, without SmolLM2's default system message (about 40 tokens of the
# small vocabulary, which would leave 64-token rows no reply to learn).
SMALL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMALL_VOCAB = 512


def small_tokenizer_files(src: Path, out: Path, vocab_size: int = SMALL_VOCAB) -> None:
    """Write SmolLM2's tokenizer (from `src`) cut to its first `vocab_size` ids into `out`, with
    `SMALL_CHAT_TEMPLATE`.

    SmolLM2's byte-level BPE numbers its tokens in merge order (17 special tokens, the 256 byte
    symbols from id 17, then merge k makes id 252 + k up to 49,151), so the first `vocab_size`
    ids with the first `vocab_size - 252` merges are a complete tokenizer: every text still
    encodes (bytes at worst), the special tokens keep their ids (`<|im_end|>` = eos = pad = 2),
    and tokenizer_config.json and generation_config.json are copied unchanged. Alpaca rows take
    about 2x the tokens at 512 (median 333 vs 163 with the real tokenizer and template); at
    max_seq_len 96 every one of the first 40 keeps a reply token.
    """
    data = json.loads((src / "tokenizer.json").read_text())
    model = data["model"]
    merges = model["merges"][: vocab_size - 252]
    vocab = {tok: i for tok, i in model["vocab"].items() if i < vocab_size}
    # the rule above, checked: every kept merge's result is a kept token
    assert all("".join(m if isinstance(m, list) else m.split(" ")) in vocab for m in merges)
    data["model"] = {**model, "vocab": vocab, "merges": merges}
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < vocab_size]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    (out / "chat_template.jinja").write_text(SMALL_CHAT_TEMPLATE)
    for name in ("tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((src / name).read_bytes())


def even_token_reward(completion_ids, **kwargs) -> float:
    """Share of even token ids in the completion (learnable by the even_model_dir model)."""
    return sum(t % 2 == 0 for t in completion_ids) / max(len(completion_ids), 1)


_REWARD_DRIVER = """
import sys
sys.path.insert(0, {repo!r})
from tests.helpers import even_token_reward, import_script


if __name__ == "__main__":
    script = import_script({script!r}, {name!r})
    script.main(sys.argv[1:], reward_funcs=[even_token_reward])
"""


def write_reward_driver(path: Path, script: Path, name: str) -> Path:
    """A file at `path` that runs a GRPO-skeleton `script`'s main() with `even_token_reward` as
    its one reward function: what torchrun (or `run_script`) launches where the process boundary
    is tested. `name` is the module name the script is imported under. Returns `path`."""
    path.write_text(_REWARD_DRIVER.format(repo=str(REPO), script=str(script), name=name))
    return path


def run_grpo(script, model_dir, data, out_dir, *overrides) -> list[dict]:
    """A GRPO script's main() on the tiny reward: 2 prompts x 4 completions of <= 6 tokens per
    step, fp32, lr 1e-2, no final save, fresh start; `overrides` (flags) come last and win."""
    args = [
        "--model", str(model_dir), "--dataset", str(data), "--out_dir", str(out_dir),
        "--dtype", "fp32", "--num_generations", "4", "--prompts_per_step", "2",
        "--max_new_tokens", "6", "--micro_batch_size", "8", "--lr", "1e-2", "--warmup_steps", "0",
        "--reward_weights", "1.0", "--save_final_model", "false", "--resume", "none",
        *overrides,
    ]  # fmt: skip
    return script.main(args, reward_funcs=[even_token_reward])


def joined_ray(ray) -> list[str]:
    """The flags that make a GRPO-skeleton script join `ray` (the `ray_session` fixture's Ray, in
    the test process) instead of starting a local Ray of its own: a module's runs share one Ray
    (no start-up, dashboard or prestarted workers per run), and each run's actors die with it
    (`pipeline.shutdown`), so no run sees another's state."""
    return ["--ray_address", ray.get_runtime_context().gcs_address]


def run_math_task(example: str, steps: int, *flags: str, model_dir, dataset, out_dir) -> list:
    """The emitted `example` (examples/<example>/train.py, a GRPO-skeleton script) on the real
    chain_sum task with the script's own rewards, in this process (a Ray must be running): sync,
    fp32, lr 2e-5, 12-token completions, micro-batches of 8, seed 0, no checkpoint, `steps`
    optimizer steps, with `flags` on top (they win); its per-step metrics."""
    script = import_script(EXAMPLES / example / "train.py", f"real_task_{Path(out_dir).name}")
    return script.main([
        "--model", str(model_dir), "--dataset", str(dataset), "--out_dir", str(out_dir),
        "--dtype", "fp32", "--rollout", "sync", "--max_steps", str(steps),
        "--max_new_tokens", "12", "--lr", "2e-5", "--warmup_steps", "2", "--micro_batch_size", "8",
        "--seed", "0", "--save_final_model", "false", "--save_every_steps", "0", "--resume", "none",
        *flags,
    ])  # fmt: skip


def odd_length_rows(vocab_size: int) -> list[dict]:
    """8 SFT rows of odd lengths (so TP and CP pad them), the first 3 positions unsupervised
    (a prompt): {"id", "input_ids", "labels"} with pre-shifted labels."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, n in enumerate([13, 15, 11, 16, 9, 15, 14, 7]):
        ids = torch.randint(0, vocab_size, (n,), generator=g).tolist()
        labels = [-100, -100, -100] + ids[4:] + [-100]
        rows.append({"id": i, "input_ids": ids, "labels": labels})
    return rows


def two_step_args(out: Path, model_dir: Path, data: Path, max_seq_len: int = 64) -> list[str]:
    """Flags of the trick-parity runs: 2 steps of 2 micro-batches of 2 rows, fp32, lr 1e-3,
    clipping on (the script's default max_grad_norm), no validation or sample."""
    return ["--model", str(model_dir), "--dataset", str(data), "--dtype", "fp32", "--max_steps", "2",
            "--warmup_steps", "0", "--lr", "1e-3", "--micro_batch_size", "2",
            "--max_seq_len", str(max_seq_len),
            "--gradient_accumulation_steps", "2", "--val_fraction", "0", "--sample_max_new_tokens", "0",
            "--out_dir", str(out)]  # fmt: skip


def two_step_losses(
    script: Path,
    out: Path,
    model_dir: Path,
    data: Path,
    max_seq_len: int = 64,
    fresh_process: bool = False,
) -> list[float]:
    """The 2 losses of `two_step_args` for an emitted script: its main() in this process, or a
    fresh `python` process (compile: inductor's caches and config stay out of ours)."""
    args = two_step_args(out, model_dir, data, max_seq_len)
    if fresh_process:
        proc = subprocess.run(
            [sys.executable, str(script), *args], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        name = "script_" + "".join(c if c.isalnum() else "_" for c in str(script))
        import_script(script, name).main(args)
    return [row["loss"] for row in read_metrics(out)]


def first_short_pairs(tmp: Path, tokenizer_dir: Path, max_tokens: int) -> Path:
    """The first 4 real dpo_en_demo pairs whose prompt + reply both fit in `max_tokens` tokens of
    the tokenizer in `tokenizer_dir` (its chat template included)."""
    from generator.assets import ensure_dataset
    from runtime import Tokenizer, to_preference

    rows = json.loads(ensure_dataset("dpo_en_demo.json").read_text())
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    kept = []
    for i, row in enumerate(rows):
        pref = to_preference(row, i, "dpo_en_demo.json")
        lengths = [
            len(tokenizer.encode(tokenizer.apply_chat_template(pref["prompt"] + pref[k])))
            for k in ("chosen", "rejected")
        ]
        if max(lengths) <= max_tokens:
            kept.append(row)
    assert len(kept) >= 4, f"only {len(kept)} short pairs"
    path = tmp / "short_pairs.json"
    path.write_text(json.dumps(kept[:4]))
    return path


def grpo_fixed_rollouts():
    """8 fixed rollouts of 2 groups (prompt, completion, sampler log-probs, reward)."""
    from runtime.grpo import group_advantages
    from runtime.rollout import Rollout

    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25]
    rollouts = [
        Rollout([1, 2, 3 + i], [10 + i, 20, 30 + 2 * i], [-1.0] * 3, r, {}, 0, i // 4)
        for i, r in enumerate(rewards)
    ]
    advantages, _ = group_advantages(torch.tensor(rewards), 4)
    return rollouts, advantages


def grpo_two_steps(
    script, model_dir: Path, dtype: str = "fp32", synced: dict | None = None
) -> list[tuple[float, ...]]:
    """(loss, grad_norm, kl, importance weight, clip ratio) of 2 GRPO train_steps on the same 8 fixed
    rollouts, 2 micro-batches of 4 each, kl_coef 0.1 (the reference's log-probs too), clipping on,
    in `dtype` (no Ray: the step only). Under several data-parallel ranks each trains its share
    (rank r: rollouts r, r + size, ...) in micro-batches of 4, as the script's main() splits them.

    synced: if given, filled after the 2 steps with what a weight sync would send the engines,
    {HF name: full CPU tensor in `dtype`}, by either transfer: "object-store"
    (`gather_hf_state_dict`) and "collective" (`HFWeightSource`, gloo's CPU side)."""
    cfg = script.Config(
        model=str(model_dir), dtype=dtype, device="cpu", lr=1e-3, warmup_steps=0,
        micro_batch_size=4, kl_coef=0.1, max_prompt_len=8, max_new_tokens=8,
    )  # fmt: skip
    if hasattr(cfg, "lora_rank"):
        cfg.lora_rank = 4
    script.validate(cfg)
    _, mesh = script.setup_distributed(cfg)
    device = torch.device("cpu")
    model = script.setup_model(cfg, model_dir, mesh, device)
    reference = None
    if hasattr(script, "setup_frozen_model"):
        reference = script.setup_frozen_model(cfg, model_dir, mesh, device)
    optimizer, scheduler = script.build_optimizer(cfg, model)
    rollouts, advantages = grpo_fixed_rollouts()
    num_tokens = sum(len(r.completion_ids) for r in rollouts)
    rank, size, _ = script.data_parallel(mesh)
    rollouts, advantages = rollouts[rank::size], advantages[rank::size]
    num_micro = -(-len(rollouts) // cfg.micro_batch_size)  # the same on every rank (8 divide)
    out = []
    for _ in range(2):
        m = script.train_step(model, reference, optimizer, scheduler, rollouts, advantages, num_tokens, num_micro, cfg, device)  # fmt: skip
        out.append(
            (
                m["loss"],
                m["grad_norm"],
                m["kl"],
                m["sampling/importance_sampling_ratio/mean"],
                m["clip_ratio/region_mean"],
            )
        )
    if synced is not None:
        from runtime.rollout import HFWeightSource, gather_hf_state_dict

        wire = script.DTYPES[dtype]
        synced["object-store"] = gather_hf_state_dict(model, wire)
        synced["collective"] = dict(HFWeightSource(model, wire, torch.device("cpu")))
    script.destroy_distributed()
    return out
