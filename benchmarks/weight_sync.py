"""Weight sync into a vLLM engine on CPU: the object-store push vs the collective transfer, side by
side in one run, on the real SmolLM2-135M (fp32, 513 MiB of weights).

One local Ray (2 CPUs) and one `VLLMEngine` actor (tensor_parallel_size 1, eager, started with
`weight_transfer_config={"backend": "gloo"}` so both paths work on the same engine); this process
is the trainer's rank 0 and holds the runtime model. Each sync first moves every weight by a
little noise, so every sync really changes the engine. The two paths alternate, --repeats each,
after one warm-up sync of each (the collective's first opens its process group; that time is
reported apart).
- object-store: `gather_hf_state_dict` (a full host copy) -> `push_weights` (`ray.put`, one
  more copy in the object store) -> the engine unpacks and sends it through vLLM's RPC in 256 MiB
  chunks; `wait_weight_sync`.
- collective: `RolloutPipeline.transfer_weights(HFWeightSource)`: one tensor at a time over gloo
  to the engine's worker.
Measured per sync: wall seconds, and this process's peak RSS above its level before the sync
(sampled every 5 ms by a thread: the trainer-side host memory the sync needs). After the last
sync of each path the engine's log-probs of a fixed sequence are checked against the trainer's.

Usage (the vLLM venv; the SmolLM2 files from `scaffold assets`):
    PYTHONPATH=. .venv-vllm/bin/python benchmarks/weight_sync.py --repeats 5
Smoke test (results elsewhere):
    PYTHONPATH=. .venv-vllm/bin/python benchmarks/weight_sync.py --repeats 1 --out /tmp/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _sections import write_marked_section  # noqa: E402

MARK_BEGIN = "<!-- weight_sync:begin -->"
MARK_END = "<!-- weight_sync:end -->"
SEQUENCE = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378, 3458, 282, 4649, 314, 7042, 30]
PROMPT_LEN = 4


class PeakRSS:
    """Peak resident set size of this process above its level at enter (MiB), sampled every 5 ms."""

    def __enter__(self):
        import psutil

        self._proc = psutil.Process()
        self.base = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        self.mib = (self.peak - self.base) / 2**20


def trainer_logprobs(model):
    import torch

    with torch.no_grad():
        ids = torch.tensor([SEQUENCE])
        logits = model(ids)[0, PROMPT_LEN - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[0, PROMPT_LEN:, None])[:, 0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="syncs per path (after one warm-up each)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "RESULTS.md")
    a = p.parse_args()

    import ray
    import torch

    from generator.assets import ensure_smollm2
    from runtime import (
        HFWeightSource,
        ModelArgs,
        build_model,
        gather_hf_state_dict,
        load_hf_checkpoint,
        read_hf_config,
    )
    from runtime.rollout import (
        RolloutPipeline,
        make_engine_actor,
        push_weights,
        wait_weight_sync,
    )

    torch.set_num_threads(1)
    model_dir = ensure_smollm2()
    model = build_model(ModelArgs.from_hf_config(read_hf_config(model_dir)), device="cpu")
    load_hf_checkpoint(model, model_dir)
    model.eval()
    nbytes = sum(t.nbytes for t in gather_hf_state_dict(model).values())
    ray.init(num_cpus=2, include_dashboard=False)
    engine_kwargs = dict(
        enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 * 2**20,
        skip_tokenizer_init=True, max_num_seqs=4, weight_transfer_config={"backend": "gloo"},
    )  # fmt: skip
    engine = make_engine_actor("vllm", str(model_dir), "float32", 0, 1, 1, engine_kwargs)
    pipeline = RolloutPipeline([engine], [], {}, weight_sync_timeout_s=600, owns_ray=True)
    source = HFWeightSource(model, torch.float32, torch.device("cpu"))
    noise = torch.Generator().manual_seed(0)
    version = 0

    def perturb():
        with torch.no_grad():
            for t in model.parameters():
                t.add_(torch.randn(t.shape, generator=noise) * 1e-3)

    def object_store():
        state = gather_hf_state_dict(model)
        wait_weight_sync(push_weights([engine], state, version), version, 600)

    def collective():
        pipeline.transfer_weights(source, version)

    paths = {"object-store": object_store, "collective": collective}
    rows: dict[str, list[tuple[float, float]]] = {k: [] for k in paths}
    first: dict[str, float] = {}
    diffs: dict[str, float] = {}
    try:
        for i in range(a.repeats + 1):
            for name, sync in paths.items():
                perturb()
                version += 1
                with PeakRSS() as mem:
                    start = time.perf_counter()
                    sync()
                    seconds = time.perf_counter() - start
                if i == 0:
                    first[name] = seconds
                else:
                    rows[name].append((seconds, mem.mib))
                if i == a.repeats:
                    got = torch.tensor(ray.get(engine.score.remote([SEQUENCE], [PROMPT_LEN]))[0])
                    diffs[name] = (got - trainer_logprobs(model)).abs().max().item()
                print(f"{name} sync {i}: {seconds:.2f} s, peak RSS +{mem.mib:.0f} MiB", flush=True)
    finally:
        pipeline.shutdown()

    load = os.getloadavg()[0]
    cmd = "PYTHONPATH=. .venv-vllm/bin/python benchmarks/weight_sync.py" + (
        f" --repeats {a.repeats}" if a.repeats != 5 else " --repeats 5"
    )
    lines = [
        MARK_BEGIN,
        "## Weight sync into a vLLM engine (CPU, `benchmarks/weight_sync.py`)",
        f"`{cmd}` ({platform.machine()}, {time.strftime('%Y-%m-%d')}, shared 2-core machine, "
        f"1-min load average {load:.1f} after). SmolLM2-135M fp32 ({nbytes / 2**20:.0f} MiB of "
        "weights), one vLLM 0.32 CPU engine (tensor_parallel_size 1) in a Ray actor, the trainer in "
        f"this process on 1 torch thread; each sync after moving every weight by noise; {a.repeats} "
        "syncs per path, alternating, after one warm-up each. Peak RSS = this process's resident "
        "memory above its level before the sync (sampled every 5 ms): the trainer-side host memory "
        "the sync needs.",
        "",
        "| path | s/sync (median) | s/sync (min..max) | trainer peak RSS +MiB (median) | first sync s | "
        "engine vs trainer log-prob after |",
        "|---|---|---|---|---|---|",
    ]
    for name, vals in rows.items():
        secs = [s for s, _ in vals]
        mibs = [m for _, m in vals]
        lines.append(
            f"| {name} | {statistics.median(secs):.2f} | {min(secs):.2f}..{max(secs):.2f} | "
            f"{statistics.median(mibs):.0f} | {first[name]:.2f} | {diffs[name]:.1e} |"
        )
    ratio = statistics.median(s for s, _ in rows["object-store"]) / statistics.median(
        s for s, _ in rows["collective"]
    )
    lines += [
        "",
        f"object-store / collective s/sync: **{ratio:.2f}x**. Not measured here: the object-store "
        "path also puts one full copy into Ray's object store (shared memory) and the engine "
        "process unpacks another; the collective path copies nothing whole on either side. On "
        "GPUs the collective path is vLLM's NCCL engine (GPU to GPU); no GPU was lent to this "
        "task, so that path has not run.",
        MARK_END,
    ]
    write_marked_section(a.out, "\n".join(lines) + "\n", MARK_BEGIN, MARK_END)
    print("\n".join(lines))


if __name__ == "__main__":  # vLLM spawns its engine core: keep this importable
    main()
