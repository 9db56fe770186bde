"""runtime.grpo and runtime.rollout: group advantages on hand-made groups, the engine's sampled
log-probs equal the trainer's completion log-probs, the replay buffer's staleness rule, and, on a
local Ray (2 CPUs), weight sync through the object store (the engine then scores a fixed sequence
exactly as the trainer does) and its timeout error, and the pipeline's own scheduling
(`RolloutPipeline.next_groups`, with stand-in engines that report the seed and weights they
sampled with): per-batch seeds, prefetch by mode, stale groups dropped and replaced, groups a
filter rejects replaced from refill batches (dynamic sampling), the
error when the engines' weights stop advancing, and the progress lines it prints while engines
in actors start and generate."""

from __future__ import annotations

import time

import pytest
import torch

from runtime import ModelArgs, build_model, load_hf_checkpoint, read_hf_config
from runtime.grpo import (
    collate_rollouts,
    completion_logprobs,
    group_advantages,
    scatter_completion_values,
)
from runtime.rollout import (
    ProgressBoard,
    ReplayBuffer,
    Rollout,
    RolloutPipeline,
    engine_gpu_ids,
    gather_hf_state_dict,
    generate_with_logprobs,
    init_ray,
    make_engine_actor,
    push_weights,
    wait_weight_sync,
)

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)


def test_group_advantages_mixed_equal_and_single():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, 1.0, 2.0, 2.0])
    adv, frac_zero = group_advantages(rewards, num_generations=4)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()  # unbiased: sqrt(1/3)
    want_first = [(r - 0.5) / (std + 1e-4) for r in (1.0, 0.0, 0.0, 1.0)]
    torch.testing.assert_close(adv[:4], torch.tensor(want_first))
    assert adv[4:8].tolist() == [0.0] * 4  # all equal: exactly 0, never NaN
    g3 = torch.tensor([3.0, 1.0, 2.0, 2.0])
    torch.testing.assert_close(adv[8:], (g3 - 2.0) / (g3.std() + 1e-4))
    assert frac_zero == pytest.approx(1 / 3)
    # groups that are all equal up to float rounding still get exactly 0
    adv, frac_zero = group_advantages(torch.full((6,), 0.1) * 3, 3)
    assert adv.tolist() == [0.0] * 6 and frac_zero == 1.0
    # group size 1: no spread to normalise by, advantage 0
    adv, frac_zero = group_advantages(torch.tensor([1.0, 5.0]), 1)
    assert adv.tolist() == [0.0, 0.0] and frac_zero == 1.0
    with pytest.raises(ValueError, match="num_generations=4"):
        group_advantages(torch.zeros(6), 4)


def _tiny_model(model_dir):
    args = ModelArgs.from_hf_config(read_hf_config(model_dir))
    model = build_model(args, device="cpu")
    load_hf_checkpoint(model, model_dir)
    return model.eval()


@pytest.mark.parametrize(
    "temperature, top_p, top_k", [(0.7, 1.0, 0), (0.7, 0.9, 0), (0.7, 0.9, 5), (1.0, 1.0, 5)]
)
def test_sampled_logprobs_equal_trainer_logprobs(tiny_model_dir, temperature, top_p, top_k):
    """generate_with_logprobs (KV cache, left padding) reports the log-probs that
    completion_logprobs (one right-padded forward) computes at the same temperature, top-p and
    top-k: the importance weight exp(trainer - sampler) is 1 within 1e-3 on every token. With
    truncation the untruncated tempered log-probs differ, so the check can fail."""
    model = _tiny_model(tiny_model_dir)
    prompts = [[5, 6, 7, 8], [9, 10]]
    out = generate_with_logprobs(
        model, prompts, 6, temperature=temperature, top_p=top_p, stop_token_ids=[2],
        pad_token_id=0, generator=torch.Generator().manual_seed(0), top_k=top_k,
    )  # fmt: skip
    completions, logps = [c for c, _ in out], [lp for _, lp in out]
    assert all(len(c) == len(lp) > 0 for c, lp in out)
    batch = collate_rollouts(prompts, completions, pad_token_id=0)
    ids, labels = batch["input_ids"], batch["labels"]
    with torch.no_grad():
        trainer = completion_logprobs(model, ids, labels, temperature, top_k=top_k, top_p=top_p)
        untruncated = completion_logprobs(model, ids, labels, temperature)
    sampler = scatter_completion_values(logps, [4, 2], ids.shape[1])
    torch.testing.assert_close(trainer, sampler, atol=1e-5, rtol=0)
    mask = labels != -100
    is_weight = torch.exp(trainer - sampler)[mask]
    assert (is_weight - 1).abs().max() <= 1e-3
    assert mask.sum() == sum(len(c) for c in completions)
    if top_p < 1 or top_k > 0:  # the old convention (untruncated) is off by the kept mass
        assert (untruncated - sampler)[mask].abs().max() > 1e-3


def test_samples_of_a_prompt_share_one_prefill(tiny_model_dir):
    """`num_samples=3` prefills each prompt once and copies its KV cache to its 3 samples: the
    same tokens, and log-probs within 1e-5, as the 3-times-repeated prompts each prefilled on its
    own, drawn with the same seed. lm_head runs only on each prompt's last position in the prefill
    ([U, D] rows, where it ran on all U * P before) and on the B = 3U new tokens in each step."""
    model = _tiny_model(tiny_model_dir)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    lm_head_rows = []
    hook = model.lm_head.register_forward_pre_hook(
        lambda module, args: lm_head_rows.append(args[0].shape[:-1])
    )

    def sample(prompts, num_samples):
        lm_head_rows.clear()
        out = generate_with_logprobs(
            model, prompts, 6, temperature=1.0, top_p=0.95, stop_token_ids=[2], pad_token_id=0,
            generator=torch.Generator().manual_seed(0), num_samples=num_samples,
        )  # fmt: skip
        return out, list(lm_head_rows)

    shared, shared_rows = sample(prompts, 3)
    repeated, repeated_rows = sample([p for p in prompts for _ in range(3)], 1)
    hook.remove()
    assert [ids for ids, _ in shared] == [ids for ids, _ in repeated]
    assert len({tuple(ids) for ids, _ in shared}) > len(prompts)  # the samples differ
    for (_, a), (_, b) in zip(shared, repeated, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    steps = max(len(ids) for ids, _ in shared)
    assert shared_rows == [torch.Size([3])] + [torch.Size([9, 1])] * (steps - 1)
    assert repeated_rows == [torch.Size([9])] + [torch.Size([9, 1])] * (steps - 1)
    with pytest.raises(ValueError, match="num_samples=0"):
        generate_with_logprobs(model, prompts, 6, 1.0, 1.0, [2], 0, num_samples=0)
    assert (
        generate_with_logprobs(model, prompts, 0, 1.0, 1.0, [2], 0, num_samples=2) == [([], [])] * 6
    )


def test_generation_reports_finished_completions(tiny_model_dir):
    """`on_progress` gets, after every decoding step, the rows that have sampled a stop token
    so far, and all rows at the end (those cut at max_new_tokens too)."""
    model = _tiny_model(tiny_model_dir)
    prompts, stop, max_new = (
        [[5, 6, 7], [9, 10], [11], [12, 13, 14, 15]] * 2,
        list(range(0, 512, 6)),
        8,
    )
    counts = []
    out = generate_with_logprobs(
        model, prompts, max_new, temperature=1.0, top_p=1.0, stop_token_ids=stop, pad_token_id=0,
        generator=torch.Generator().manual_seed(0), on_progress=counts.append,
    )  # fmt: skip
    stopped = [len(ids) for ids, _ in out if ids[-1] in stop]
    assert 0 < len(stopped) < len(prompts)  # some rows stop early, some run to max_new_tokens
    steps = max(len(ids) for ids, _ in out)
    want = [sum(n <= t for n in stopped) for t in range(1, steps + 1)]
    assert counts == [*want, len(prompts)]


def _group(version: int, n: int = 2) -> list[Rollout]:
    return [Rollout([1], [2], [-0.1], 0.0, {}, version, 0) for _ in range(n)]


def test_replay_buffer_drops_stale_groups_whole():
    buf = ReplayBuffer()
    buf.put([_group(0), _group(1), _group(3), _group(4)])
    groups, dropped = buf.take(2, current_version=4, max_staleness=1)
    assert [g[0].policy_version for g in groups] == [3, 4]
    assert dropped == 4 and buf.dropped == 4 and len(buf) == 0


def test_weight_sync_engine_scores_like_trainer(ray_session, tiny_model_dir):
    ray = ray_session
    engine = make_engine_actor("runtime", str(tiny_model_dir), "float32", seed=0, num_cpus=1)
    model = _tiny_model(tiny_model_dir)
    with torch.no_grad():  # a "trained" policy: every weight moved
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    sequence, prompt_len = [5, 6, 7, 8, 11, 12, 13], 4
    batch = collate_rollouts([sequence[:prompt_len]], [sequence[prompt_len:]], pad_token_id=0)
    with torch.no_grad():
        want = completion_logprobs(model, batch["input_ids"], batch["labels"])[0, 3:6]
    before = ray.get(engine.score.remote([sequence], [prompt_len]))[0]
    assert (torch.tensor(before) - want).abs().max() > 1e-3  # still the checkpoint's weights
    refs = push_weights([engine], gather_hf_state_dict(model), version=7)
    wait_weight_sync(refs, version=7, timeout_s=60)
    after = ray.get(engine.score.remote([sequence], [prompt_len]))[0]
    torch.testing.assert_close(torch.tensor(after), want, atol=1e-5, rtol=0)
    assert ray.get(engine.policy_version.remote()) == 7
    ray.kill(engine)


class SlowEngine:
    """Stands in for an engine stuck in a long generation."""

    def update_weights(self, named_tensors, version):
        time.sleep(5)
        return version


def test_weight_sync_timeout_names_engine(ray_session):
    ray = ray_session
    engine = ray.remote(num_cpus=0.1)(SlowEngine).remote()
    refs = push_weights([engine], {"w": torch.zeros(2)}, version=3)
    with pytest.raises(
        TimeoutError, match=r"engine 0 did not finish within weight_sync_timeout_s=0.5"
    ):
        wait_weight_sync(refs, version=3, timeout_s=0.5)
    ray.kill(engine)


class RecordingEngine:
    """Stands in for a generator engine: each completion is [seed, the engine's weight version],
    so a test reads what every rollout was sampled with. With `delay_s` it finishes its
    completions one per delay_s, reporting each to `on_progress` as the real engines do."""

    def __init__(self, start_s: float = 0.0):
        time.sleep(start_s)  # > 0: an engine still loading its model
        self.version = 0

    def generate(self, prompts, n, seed, on_progress=None, delay_s=0.0, **sampling):
        for done in range(1, len(prompts) * n + 1):
            time.sleep(delay_s)
            if on_progress is not None:
                on_progress(done)
        return [[([seed, self.version], [-0.5, -0.5]) for _ in range(n)] for _ in prompts]

    def update_weights(self, named_tensors, version):
        self.version = version
        return version

    def policy_version(self):
        return self.version


class ZeroRewards:
    """Stands in for a RewardWorker: reward 0 for every completion."""

    def score(self, generations, prompts, answers):
        n = sum(len(group) for group in generations)
        return {
            "generations": generations,
            "rewards": [0.0] * n,
            "per_func": {"zero": [0.0] * n},
            "completions": [""] * n,
            "score_s": 0.0,
        }


def _old_seed(seed: int, epoch: int, consumed: int) -> int:
    """The GRPO script's per-batch sampling seed before the pipeline owned it (next_rollouts)."""
    return ((seed * 1_000_003 + epoch) * 1_000_003 + consumed) % 2**31


def _prompt_batches(per_batch: int = 2, per_epoch: int = 6):
    """((epoch, consumed), prompts) as the script's prompt_batches yields them; prompt k = [k]."""
    epoch, consumed, k = 0, 0, 0
    while True:
        while consumed + per_batch <= per_epoch:
            prompts = [
                {"prompt_ids": [k + j], "prompt": f"q{k + j}", "answer": "0"}
                for j in range(per_batch)
            ]
            k, consumed = k + per_batch, consumed + per_batch
            yield (epoch, consumed), prompts
        epoch, consumed = epoch + 1, 0


@pytest.fixture(scope="module")
def fake_actors(ray_session):
    """Two RecordingEngines, one ZeroRewards worker and a ProgressBoard, started once for the
    module (together: their processes start in parallel)."""
    ray = ray_session
    engines = [ray.remote(num_cpus=0.1)(RecordingEngine).remote() for _ in range(2)]
    workers = [ray.remote(num_cpus=0.1)(ZeroRewards).remote()]
    board = ray.remote(num_cpus=0)(ProgressBoard).remote()
    yield engines, workers, board
    for actor in [*engines, *workers, board]:
        ray.kill(actor)


@pytest.fixture
def fake_pipeline(ray_session, fake_actors):
    """A fresh RolloutPipeline (G = 2) over the module's stand-in actors, engines at version 0."""
    engines, workers, _ = fake_actors
    ray_session.get([e.update_weights.remote({}, 0) for e in engines])  # behind earlier calls
    return RolloutPipeline(engines, workers, {"n": 2}, rollout_timeout_s=60, progress_every_s=0)


def _summary(groups):
    """Per group: (prompt ids, sampling seed, engine weights, policy version)."""
    return [
        (g[0].prompt_ids, g[0].completion_ids[0], g[0].completion_ids[1], g[0].policy_version)
        for g in groups
    ]


def test_next_groups_seeds_and_prefetch(fake_pipeline):
    """async (max_staleness 1): one batch stays in flight; every batch is sampled with the old
    formula's seed of its data position (engine e: seed * 1000 + e), across an epoch boundary,
    and from the weights of the version it was submitted under."""
    pipeline, batches = fake_pipeline, _prompt_batches()
    step = pipeline.next_groups(batches, 2, train_version=0, max_staleness=1, seed=7)
    s02, s04 = _old_seed(7, 0, 2), _old_seed(7, 0, 4)
    assert _summary(step.groups) == [([0], s02 * 1000, 0, 0), ([1], s02 * 1000 + 1, 0, 0)]
    assert (step.dropped, step.position, len(pipeline.pending)) == (0, (0, 4), 1)
    assert step.waited_s > 0 and pipeline.position == (0, 4)
    pipeline.push_weights({}, 1)
    step = pipeline.next_groups(batches, 2, train_version=1, max_staleness=1, seed=7)
    assert _summary(step.groups) == [([2], s04 * 1000, 0, 0), ([3], s04 * 1000 + 1, 0, 0)]
    assert step.position == (0, 6) and len(pipeline.pending) == 1
    pipeline.push_weights({}, 2)
    step = pipeline.next_groups(batches, 2, train_version=2, max_staleness=1, seed=7)
    s06 = _old_seed(7, 0, 6)
    assert _summary(step.groups) == [([4], s06 * 1000, 1, 1), ([5], s06 * 1000 + 1, 1, 1)]
    assert step.position == (1, 2)  # the next epoch's first batch is in flight
    # sync (max_staleness 0) from here: the async batch in flight (version 2) is too old for
    # version 3, so it is dropped and a fresh one generated; nothing stays in flight after
    pipeline.push_weights({}, 3)
    step = pipeline.next_groups(batches, 2, train_version=3, max_staleness=0, seed=7)
    s14, s16 = _old_seed(7, 1, 4), _old_seed(7, 1, 6)
    assert _summary(step.groups) == [([8], s14 * 1000, 3, 3), ([9], s14 * 1000 + 1, 3, 3)]
    assert (step.dropped, step.position, len(pipeline.pending)) == (4, (1, 4), 0)
    pipeline.push_weights({}, 4)
    step = pipeline.next_groups(batches, 2, train_version=4, max_staleness=0, seed=7)
    assert _summary(step.groups) == [([10], s16 * 1000, 4, 4), ([11], s16 * 1000 + 1, 4, 4)]
    assert (step.dropped, step.position, len(pipeline.pending)) == (0, (1, 6), 0)


def test_next_groups_drops_stale_groups_and_replaces_them(fake_pipeline):
    """A batch in flight that is too old by the time it is collected is dropped whole, and the
    next batch (sampled from the new weights) takes its place."""
    pipeline, batches = fake_pipeline, _prompt_batches()
    pipeline.next_groups(batches, 2, train_version=0, max_staleness=1, seed=0)  # batch 2 in flight
    pipeline.push_weights({}, 2)
    step = pipeline.next_groups(batches, 2, train_version=2, max_staleness=0, prefetch=1, seed=0)
    assert step.dropped == 4 and pipeline.buffer.dropped == 4  # batch 2's two groups, version 0
    assert _summary(step.groups) == [
        ([4], _old_seed(0, 0, 6) * 1000, 2, 2),
        ([5], _old_seed(0, 0, 6) * 1000 + 1, 2, 2),
    ]
    assert step.position == (1, 2) and len(pipeline.pending) == 1  # prefetch kept


def test_next_groups_fails_when_weights_stop_advancing(fake_pipeline):
    """Sync mode, engines still at version 0 while training version 3: every batch is too old; a
    clear error after the batches that could legitimately be stale, not an endless loop."""
    pipeline = fake_pipeline
    with pytest.raises(
        TimeoutError,
        match=r"training policy version 3: 8 rollouts in a row were more than 0 version\(s\) old "
        r"\(the engines sample version 0\); weights are not reaching the engines",
    ):
        pipeline.next_groups(_prompt_batches(), 2, train_version=3, max_staleness=0, seed=0)
    assert pipeline.buffer.dropped == 8


def _prompts_of(groups) -> list[int]:
    return [g[0].prompt_ids[0] for g in groups]


def test_next_groups_filter_refills_sync(fake_pipeline):
    """Dynamic sampling (`keep`), sync: rejected groups are replaced from refill batches (counted);
    a step that the buffer completes leaves no batch in flight (it would be stale after the
    push); a refill's unused group is too old for the next step and dropped as stale; at
    max_refills the step is filled with the first rejected groups and nothing more is generated."""
    pipeline, batches = fake_pipeline, _prompt_batches(per_epoch=100)
    keep = lambda g: g[0].prompt_ids[0] not in (0, 2, 4)  # noqa: E731  (prompt k = [k])
    step = pipeline.next_groups(batches, 2, 0, 0, seed=0, keep=keep, max_refills=3)
    assert _prompts_of(step.groups) == [1, 3] and (step.filtered, step.refills) == (2, 1)
    assert (len(pipeline.buffer), len(pipeline.pending), step.dropped) == (0, 0, 0)
    pipeline.push_weights({}, 1)
    step = pipeline.next_groups(batches, 2, 1, 0, seed=0, keep=keep, max_refills=3)
    assert _prompts_of(step.groups) == [5, 6] and (step.filtered, step.refills) == (1, 1)
    assert (len(pipeline.buffer), len(pipeline.pending)) == (1, 0)  # group 7, left over
    pipeline.push_weights({}, 2)
    step = pipeline.next_groups(batches, 2, 2, 0, seed=0, keep=keep, max_refills=3)
    assert _prompts_of(step.groups) == [8, 9] and (step.filtered, step.refills) == (0, 0)
    assert step.dropped == 2  # group 7's 2 rollouts: version 1, training version 2
    pipeline.push_weights({}, 3)
    step = pipeline.next_groups(batches, 2, 3, 0, seed=0, keep=lambda g: False, max_refills=1)
    assert _prompts_of(step.groups) == [10, 11]  # the first rejected groups fill the step
    assert (step.filtered, step.refills, len(pipeline.pending)) == (2, 1, 0)


def test_next_groups_filter_leftovers_serve_the_next_async_step(fake_pipeline):
    """async (max_staleness 1): a refill's unused group is young enough for the next step."""
    pipeline, batches = fake_pipeline, _prompt_batches(per_epoch=100)
    keep = lambda g: g[0].prompt_ids[0] % 4 != 0  # noqa: E731  (0, 4, 8 rejected)
    step = pipeline.next_groups(batches, 2, 0, 1, seed=0, keep=keep, max_refills=3)
    assert _prompts_of(step.groups) == [1, 2] and (step.filtered, step.refills) == (1, 1)
    pipeline.push_weights({}, 1)
    step = pipeline.next_groups(batches, 2, 1, 1, seed=0, keep=keep, max_refills=3)
    assert _prompts_of(step.groups) == [3, 5] and (step.filtered, step.refills) == (1, 0)
    assert step.dropped == 0 and [g[0].policy_version for g in step.groups] == [0, 0]


def test_engine_gpu_ids_after_the_trainers():
    assert engine_gpu_ids(trainer_gpus=4, device_count=8) == ([4, 5, 6, 7], False)
    assert engine_gpu_ids(trainer_gpus=1, device_count=1) == ([0], True)  # shared
    assert engine_gpu_ids(trainer_gpus=2, device_count=2) == ([0, 1], True)
    assert engine_gpu_ids(trainer_gpus=1, device_count=0) == ([], False)  # CPU


_RAY_GPUS = r"""
import json, os, sys
import ray
from runtime.rollout import engine_gpu_ids, init_ray
os.environ["CUDA_VISIBLE_DEVICES"] = sys.argv[1]  # the node's GPUs as this trainer process sees them
ids, shared = engine_gpu_ids(trainer_gpus=int(sys.argv[2]), device_count=len(sys.argv[1].split(",")))
init_ray("", 1, ids)
restored = os.environ["CUDA_VISIBLE_DEVICES"]
@ray.remote(num_gpus=2, num_cpus=0)
def gpus():
    return sorted(ray.get_gpu_ids())
print(json.dumps({"got": sorted(ray.get([gpus.remote(), gpus.remote()])), "restored": restored,
                  "gpu": ray.cluster_resources().get("GPU")}))
ray.shutdown()
"""


@pytest.mark.parametrize(
    ("visible", "trainer", "expected"),
    [
        ("0,1,2,3,4,5,6,7", 4, [["4", "5"], ["6", "7"]]),
        # a job given a scrambled set: the ids are indices into CUDA_VISIBLE_DEVICES
        ("3,2,7,6,1,0", 2, [["0", "1"], ["6", "7"]]),
    ],
)
def test_local_ray_gives_engines_only_the_gpus_after_the_trainers(visible, trainer, expected):
    """A local Ray started by `init_ray` sees only the engine GPUs (Ray's logical GPUs on this
    CPU machine: it assigns CUDA_VISIBLE_DEVICES ids without touching a device), so two 2-GPU
    engine actors land on exactly those, and this process's CUDA_VISIBLE_DEVICES is restored."""
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _RAY_GPUS, visible, str(trainer)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"got": expected, "restored": visible, "gpu": 4.0}


def test_ray_address_nobody_answers_is_a_clear_error_not_minutes_of_retries():
    """Ray's own `ray.init("host:port")` retries an unreachable head for minutes; `init_ray`
    checks the port first and names --ray_address."""
    import socket

    with socket.socket() as s:  # a port that was just free: nothing listens there now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"--ray_address '127.0.0.1:{port}': no Ray head"):
        init_ray(f"127.0.0.1:{port}")
    assert time.monotonic() - start < 10
    with pytest.raises(ValueError, match=r"--ray_address 'headnode': expected auto, host:port"):
        init_ray("headnode")


def test_runtime_engine_refuses_tensor_parallel():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .* need --engine vllm"):
        make_engine_actor("runtime", "unused", tensor_parallel_size=2)


def test_weight_source_yields_the_gathered_state_one_tensor_at_a_time(tiny_model_dir):
    """HFWeightSource (the collective transfer's source): metadata() agrees with iteration, the
    tensors are gather_hf_state_dict's plus the tied head right after the embedding, cast to the
    wire dtype, and every pass reads the current parameters."""
    from runtime import HFWeightSource, gather_merged_hf_state_dict
    from runtime.lora import add_lora, init_lora

    model = _tiny_model(tiny_model_dir)  # tied embeddings
    source = HFWeightSource(model, torch.float32, torch.device("cpu"))
    pairs = list(source)
    names = [n for n, _ in pairs]
    assert [tuple(m) for m in source.metadata()] == [(n, t.dtype, tuple(t.shape)) for n, t in pairs]
    want = gather_hf_state_dict(model)
    assert "lm_head.weight" not in want and names.count("lm_head.weight") == 1
    assert names.index("lm_head.weight") == names.index("model.embed_tokens.weight") + 1
    got = dict(pairs)
    assert got.keys() - {"lm_head.weight"} == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(got["lm_head.weight"], want["model.embed_tokens.weight"])
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(1.0)
    again = dict(HFWeightSource(model, torch.bfloat16, torch.device("cpu")))
    assert all(t.dtype == torch.bfloat16 for t in again.values())
    up = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(again[up], (want[up] + 1.0).to(torch.bfloat16))
    assert torch.equal(dict(source)[up], want[up] + 1.0)  # a second pass of the same source
    # LoRA/DoRA: the merged weights under the base's names, no adapter tensors
    add_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8, use_dora=True)
    init_lora(model, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    merged = dict(HFWeightSource(model, torch.float32, torch.device("cpu"), merged=True))
    want = gather_merged_hf_state_dict(model, torch.float32)
    assert merged.keys() - {"lm_head.weight"} == want.keys()
    assert not any("lora" in k for k in merged)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert (merged[q] - got[q]).abs().max() > 1e-3  # the adapters are in (got: before LoRA)
    assert all(torch.equal(merged[k], want[k]) for k in want)


def _progress_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("rollout |")]


def test_progress_reaches_the_driver_from_engine_actors(ray_session, fake_actors, capsys):
    """Two engine actors generating 4 completions each, 0.15 s apart: while the driver waits it
    prints the completions finished so far (rising, some between 0 and 8), then the batch's end
    and its scoring; a quick later batch prints nothing."""
    import re

    engines, workers, board = fake_actors
    sampling = {"n": 2, "delay_s": 0.15}
    pipeline = RolloutPipeline(
        engines, workers, sampling, rollout_timeout_s=60, progress_every_s=0.1, board=board
    )
    pipeline.wait_engines()
    pipeline.next_groups(_prompt_batches(4, 8), 4, train_version=0, max_staleness=0, seed=0)
    lines = _progress_lines(capsys.readouterr().out)
    assert lines[0] == "rollout | starting 2 engine(s)"
    assert sorted(re.sub(r" \(.*", "", line) for line in lines[1:3]) == [
        "rollout | engine 0 ready",
        "rollout | engine 1 ready",
    ]
    counts = [
        re.fullmatch(r"rollout \| step 1: (\d+)/8 completions \([\d.]+ s\)", line)
        for line in lines[3:-1]
    ]
    assert all(counts), lines
    counts = [int(m.group(1)) for m in counts]
    assert counts == sorted(counts) and counts[-1] == 8 and any(0 < c < 8 for c in counts)
    assert re.fullmatch(r"rollout \| step 1: scored 8 completions \([\d.]+ s\)", lines[-1])
    sampling["delay_s"], pipeline.progress_every_s = 0.0, 5.0
    pipeline.next_groups(_prompt_batches(4, 8), 4, train_version=0, max_staleness=0, seed=0)
    assert _progress_lines(capsys.readouterr().out) == []


def test_slow_engine_start_and_slow_batch_are_timeouts(ray_session, fake_actors):
    """An engine still loading after rollout_timeout_s, and a batch still generating after it,
    are errors that name what was waited for, not a silent wait."""
    ray, (engines, workers, _) = ray_session, fake_actors
    slow_start = ray.remote(num_cpus=0.1)(RecordingEngine).remote(start_s=30)
    timeouts = dict(rollout_timeout_s=0.5, progress_every_s=0)  # no progress board
    pipeline = RolloutPipeline([slow_start], workers, {"n": 1}, **timeouts)
    with pytest.raises(
        TimeoutError, match=r"engine\(s\) \[0\] did not start within rollout_timeout_s=0.5 s"
    ):
        pipeline.wait_engines()
    ray.kill(slow_start)
    # one completion of 5 s (a wide margin over 0.5 s on a loaded machine); the module's last
    # test, so no later test waits behind it on this engine
    sampling = {"n": 1, "delay_s": 5.0}
    pipeline = RolloutPipeline(engines[:1], workers, sampling, **timeouts)
    with pytest.raises(
        TimeoutError, match=r"policy version 0\) did not finish within rollout_timeout_s=0.5 s"
    ):
        pipeline.next_groups(_prompt_batches(1), 1, train_version=0, max_staleness=0, seed=0)
