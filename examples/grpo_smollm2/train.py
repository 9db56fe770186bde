"""GRPO (Group Relative Policy Optimization) of smollm2-135m (llama family), rollouts on Ray.

Online RL with verifiable rewards: for each prompt the generator engines sample num_generations
completions, the reward functions below score them, each completion's advantage is its reward
relative to its group, and the policy takes a clipped policy-gradient step. Generation,
reward scoring and training run as an assembly line of Ray actors (--rollout):
- sync: generate batch k with policy k, then train on it (every sample on-policy);
- async: generate batch k+1 while training on batch k (samples at most 1 policy version old);
- off-policy: up to max_staleness batches generated ahead; older samples are dropped and counted,
  and the importance weight against the sampler's log-probs corrects the rest.
Parallelism: FSDP2 `fully_shard` over all trainer processes; engines are separate Ray actors
(runtime engine by default: --engine runtime is the runtime's KV-cache sampler on CPU or one
GPU, --engine vllm is vLLM on engine_tensor_parallel_size GPUs per engine, its tensor parallelism).
GPU layout: the trainer and the engines share the GPU(s) (a local Ray gets all of them when none
is left after the trainer's); on larger nodes give the engines their own (`scaffold new --engine-gpus`).

Weight sync (--weight_transfer) after every rollout batch's last optimizer step:
- collective ("auto" with vllm, unless the engines share the trainer's GPUs): rank 0 and every
  engine worker form one process group (vLLM's weight-transfer engine: NCCL on CUDA, gloo on
  CPU); the trainer ranks gather one full tensor at a time, rank 0 broadcasts it, each engine
  worker loads its shard. No full copy of the model is made anywhere. Each engine first finishes
  the batches already queued on it.
- object-store ("auto" otherwise): the trainer ranks gather the full model to rank 0's host
  memory, which sends it through the Ray object store to the engines without waiting for them.
  Simple, but the whole model is copied to host memory, the object store and each engine's RPC.

Launch (rank 0 is the Ray driver: it starts a local Ray, or joins --ray_address; with several
trainer processes it broadcasts every step's rollouts to the other ranks):
    python train.py                                   # 1 trainer process + local Ray
    python train.py --rollout sync --max_steps 20     # strictly on-policy
    torchrun --nproc-per-node 1 train.py --lr 1e-06 --max_steps 100
    ray start --head && python train.py --ray_address auto   # join a running Ray cluster
A Ray cluster's nodes must expose only the engines' GPUs to Ray
(`CUDA_VISIBLE_DEVICES=... ray start --num-gpus ...`); the trainer uses cuda:0..LOCAL_WORLD_SIZE-1 of its nodes.

Objective (--loss_type; one script runs every variant, `grpo_loss` and `loss_weights` below).
Per completion token t of sequence i: A_i its advantage, r = pi / pi_old, w the truncated
importance weight to the sampler, clip(x) = clip(x, 1 - clip_eps_low, 1 + clip_eps_high),
sg = stop-gradient. They differ in the token loss and in its weight in the step (normaliser);
T = the step's loss tokens, M = its sequences, |o_i| = sequence i's loss tokens, L =
max_new_tokens, all counted over every micro-batch and rank, so the micro-batching never
changes the gradient:
- dapo (default): -w min(r A, clip(r) A), weight 1 / T: every token of the step weighs the same
  (DAPO, Yu et al. 2025, arXiv:2503.14476: clip-higher, token-level loss).
- grpo: the same token loss, weight 1 / (M |o_i|): a mean over each sequence's tokens, then over
  the sequences (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300 eq. 3); a long completion's
  tokens weigh less.
- dr_grpo: the same token loss, weight 1 / (M L), a constant, and advantages not divided by the
  group's std (requires --scale_rewards false) (Liu et al. 2025, "Understanding R1-Zero-Like
  Training", arXiv:2503.20783): no length or difficulty bias.
- gspo: the sequence's ratio s_i = exp(mean_t log(pi / pi_old)) in place of r, clipped per
  sequence, in the GSPO-token form sg(s_i) pi / sg(pi) (s_i in value, the gradient through each
  token), weight as grpo (Zheng et al. 2025, arXiv:2507.18071; the paper clips s_i at 3e-4 /
  4e-4: set --clip_eps_low / --clip_eps_high).
- cispo: -w sg(clip(r)) A log pi, weight as dapo: the clip bounds a token's weight but never
  drops its gradient (MiniMax-M1, arXiv:2506.13585). The paper sets its lower bound so loose that
  only the upper one acts; here clip_eps_low applies as for dapo (--clip_eps_low 0.99 for the
  paper's).
At num_iterations 1 (one optimizer step per batch, the default) r = 1 in value, so gspo's
gradient equals grpo's and cispo's equals dapo's; the clip acts from the second of
num_iterations > 1 steps on a batch, once pi has moved away from pi_old.
--num_iterations mu (TRL's num_iterations, DeepSeekMath's mu, arXiv:2402.03300 alg. 1): each
rollout batch is trained on by mu optimizer steps, each over all its micro-batches. Before the
first, one no-grad pass of the current policy records pi_old's per-token log-probs (as TRL;
at mu = 1 pi_old is the policy itself, detached, and that pass is skipped). The step counter
(max_steps, warmup, save_every_steps, the logged step) counts optimizer steps; the policy version
(what weight sync pushes and staleness bounds) counts rollout batches, since the engines get new
weights only after a batch's last step. Checkpoints are taken only at rollout-batch boundaries,
so max_steps and save_every_steps must be multiples of mu (checked): a resumed run starts with a
fresh batch, exactly as the straight run does.
Advantages (`runtime.group_advantages`): A_i = (R_i - mean of its group) / (std of its group +
1e-4); --scale_rewards false drops the std; --advantage_baseline rloo subtracts the mean of the
other G - 1 rewards instead (RLOO, Ahmadian et al. 2024, arXiv:2402.14740), still divided by the
group's std unless --scale_rewards false (the paper's RLOO has no std). Every advantage needs a
group of at least 2: num_generations >= 2 (checked; PPO's critic is its baseline instead).
DAPO's data tricks (arXiv:2503.14476): --dynamic_sampling drops groups whose rewards are all
equal (advantage 0, no gradient) and generates more prompts in their place, at most
max_refill_rounds extra batches per step (then dropped groups fill the rest; logged as
dropped_groups, num_refills; `reward` is then the trained groups' mean, without the dropped
all-right or all-wrong ones); it works in every rollout mode, as the pipeline filters the groups
before any staleness-bounded step takes them (in sync mode a refill batch's unused groups are too
old for the next step and dropped, as dropped_stale).
--overlong mask leaves truncated completions
(no stop token: they hit max_new_tokens) out of the loss and its token count; --overlong shape adds
DAPO's soft overlong punishment (eq. 13) to the reward: 0 up to max_new_tokens - overlong_buffer
tokens, then falling linearly to -1 at max_new_tokens.

Differs from Shao et al. 2024 (DeepSeekMath, arXiv:2402.03300) / Hugging Face TRL's GRPOTrainer:
- The clipping ratio is taken against the trainer's own log-probs before the batch's first
  step (decoupled PPO, Hilton et al. 2021, arXiv:2110.00641), never the sampler's (TRL does the
  same when num_iterations > 1); the sampler's log-probs enter through a truncated importance weight
  min(pi_old / pi_sampler, is_cap) (TIS, Yao et al. 2025), which corrects stale (async,
  off-policy) samples and engine/trainer numeric mismatch.
- Clipping is asymmetric, [1 - clip_eps_low, 1 + clip_eps_high] (DAPO, arXiv:2503.14476, sec. 3.1),
  and the default loss is token-level: the sum over every completion token of the step divided by
  the number of those tokens (DAPO sec. 3.3), not a mean of per-sequence means (--loss_type grpo).
- KL to the reference (kl_coef > 0) uses Schulman's k3 estimator, added to the loss per token;
  kl_coef = 0 (default, as DAPO) loads no reference model.
- Groups whose rewards are all equal get advantage 0 (logged as frac_reward_zero_std; dropped
  and replaced with --dynamic_sampling).
- Log-prob convention (sampler and trainer alike): the log-prob of a completion token is taken
  under the distribution that generated it, softmax(logits / temperature) restricted to the
  top-k / top-p support and renormalised over it (vLLM's logprobs_mode="processed_logprobs";
  `truncate_logits` applies vLLM's rules, top-k then top-p, in the CPU engine and here). TRL's
  trainer takes the untruncated tempered log-prob, so with top_p < 1 or top_k > 0 its
  importance ratio against vLLM's processed log-probs carries the kept mass of every position;
  here the ratio is 1 when the weights agree. The policy, old and reference log-probs all take
  their support from their own logits, the sampled token always kept in it (a finite log-prob
  where the boundary moved).
- Log-probabilities take lm_head's logits at the completion positions only ([T, V]); `--tricks
  lce` takes them in chunks instead.
- dtype="bf16" computes in bf16 but keeps fp32 master weights and fp32 AdamW state.
- Bytes per trained parameter (FSDP-sharded, GPU): weights 4 (fp32 master) + gradients 4 (fp32) +
  AdamW state 8 (fp32) = 16; a separate frozen reference 2 (bf16).

Generated by scaffold 0.1.0 with `scaffold new --algo grpo --model smollm2-135m --dataset chain_sum.jsonl --out examples/grpo_smollm2`.
Edit freely; `scaffold regen` merges template or option changes into your edits.
"""

# === 1. Imports ===
import dataclasses
import functools
import math
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from runtime import (
    ADVANTAGE_BASELINES,
    IGNORE_INDEX,
    ConfigError,
    MetricsLogger,
    ModelArgs,
    RewardModelFunction,
    Rollout,
    Tokenizer,
    all_reduce_sum,
    build_mesh,
    build_model,
    cast_frozen_params,
    check_finite,
    check_vocab_fits,
    claim_out_dir,
    clip_grad_norm,
    collate_rollouts,
    common_config_errors,
    cosine_schedule_with_warmup,
    data_parallel,
    destroy_distributed,
    disable_fsdp_gradient_division,
    entry_point,
    expand_to_tokens,
    final_model_config,
    group_advantages,
    hub_repo_id,
    init_distributed,
    load_hf_checkpoint,
    load_rows,
    micro_batch_progress,
    parse_config,
    peak_memory_mib,
    progress_bar,
    read_model_args,
    resolve_data_path,
    resolve_model_dir,
    resolve_weight_transfer,
    resume_training,
    rollout_config_errors,
    rollout_stats,
    run_summary,
    save_hf_model,
    save_train_state,
    scatter_completion_values,
    sequence_sums,
    share_rollouts,
    staleness_bound,
    start_rollout,
    sync_weights,
    transfer_backend,
    truncate_logits,
    weight_source,
)


# === 2. Config ===
@dataclass
class Config:
    # model
    model: str = "smollm2-135m"  # local HF directory, or a name in $SCAFFOLD_HOME/models
    hf_repo_id: str = "HuggingFaceTB/SmolLM2-135M-Instruct"  # Hub fallback
    # data
    dataset: str = "chain_sum.jsonl"  # rows {"question", integer "answer"}: .json/.jsonl/.parquet
    max_prompt_len: int = 256  # tokens after the chat template; longer prompts are dropped
    # GRPO
    num_generations: int = 8  # G: completions per prompt (one group)
    prompts_per_step: int = 8  # N: prompts per rollout batch (all ranks); N * G sequences
    max_new_tokens: int = 64  # completion length cap (tokens)
    temperature: float = 1.0  # sampling temperature; log-probs are taken under the same one
    top_p: float = 1.0  # nucleus sampling mass (1.0 = off)
    top_k: int = 0  # sample from the k most likely tokens, before top_p (0 = off, as TRL and vLLM)
    clip_eps_low: float = 0.2  # ratio clipped below at 1 - clip_eps_low
    clip_eps_high: float = 0.28  # ratio clipped above at 1 + clip_eps_high (DAPO's clip-higher)
    kl_coef: float = 0.0  # weight of the k3 KL to the reference (0 = no reference model)
    num_iterations: int = 1  # mu: optimizer steps per rollout batch (TRL's name; docstring)
    is_cap: float = 2.0  # truncated importance weight min(pi_old / pi_sampler, is_cap) (0 = off)
    loss_type: str = "dapo"  # "grpo" | "dapo" | "dr_grpo" | "gspo" | "cispo" (see the docstring)
    scale_rewards: bool = True  # advantages / group reward std (false for dr_grpo)
    advantage_baseline: str = "group_mean"  # or "rloo": leave-one-out (std: scale_rewards)
    dynamic_sampling: bool = False  # DAPO: replace groups of all-equal rewards
    max_refill_rounds: int = 4  # dynamic_sampling: extra batches per step at most
    overlong: str = "none"  # truncated completions: "none" | "mask" (no loss) | "shape"
    overlong_buffer: int = 16  # overlong="shape": penalty 0 -> -1 over the last tokens
    reward_weights: list[float] = field(
        default_factory=lambda: [1.0, 0.2]
    )  # per REWARD_FUNCS entry, then reward_model's
    reward_model: str = ""  # a saved reward model (scaffold new --algo rm): one more reward, its score of (question, completion)
    # rollout (Ray)
    rollout: str = "async"  # "sync" | "async" | "off-policy" (see the docstring)
    max_staleness: int = 2  # off-policy: policy versions a trained sample may lag (sync 0, async 1)
    weight_sync_every_steps: int = 1  # off-policy: push weights to the engines every k steps
    weight_transfer: str = (
        "auto"  # "collective" (vllm only), "object-store" or "auto" (see the docstring)
    )
    engine: str = "runtime"  # "runtime" (KV-cache sampler, CPU or 1 GPU) or "vllm"
    num_engines: int = 1  # generator actors; each batch's prompts are split over them
    engine_tensor_parallel_size: int = 1  # vllm: GPUs per engine (vLLM tensor_parallel_size)
    engine_gpu_memory_utilization: float = 0.3  # vllm on CUDA: share of each engine GPU it takes
    engine_cpu_kv_cache_gib: float = 1.0  # vllm on CPU: KV cache per engine (host memory, GiB)
    engine_num_cpus: float = 1  # CPU cores Ray reserves per engine (its torch threads)
    num_reward_workers: int = 1  # reward actors (0.5 CPU each)
    weight_sync_timeout_s: float = (
        300.0  # an engine that has not loaded new weights by then is an error
    )
    rollout_timeout_s: float = 1800.0  # one batch (generation + rewards) at most
    ray_address: str = ""  # "" = start a local Ray; "auto" or "host:port" joins a running cluster
    ray_num_cpus: int = 0  # local Ray only: cores it may use (0 = all)
    # optimization
    lr: float = 1e-06  # peak learning rate
    weight_decay: float = 0.0  # AdamW decoupled decay on matrices (not on norms/biases)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 10  # optimizer steps of linear warmup
    min_lr_ratio: float = 1.0  # cosine decays to lr * min_lr_ratio (1.0 = constant after warmup)
    max_steps: int = 100  # optimizer steps = rollout batches trained on
    max_grad_norm: float = 1.0  # clip the global gradient norm to this (0 = off)
    micro_batch_size: int = 4  # sequences per rank per forward
    # parallelism
    dp_replicate: int = 1  # HSDP replica groups (1 = FSDP over all dp ranks)
    # precision and devices
    dtype: str = "bf16"  # "bf16" (fp32 master weights) or "fp32"; engines sample in it
    device: str = "auto"  # "auto" (CUDA if available), "cuda" or "cpu"
    # logging, checkpoints
    out_dir: str = "out"  # metrics.jsonl, checkpoints and the final model go here
    log_every_steps: int = 1
    save_every_steps: int = 0  # resumable checkpoints in out_dir/checkpoints (0 = none)
    keep_last_checkpoints: int = 2  # older complete checkpoints are deleted
    resume: str = "auto"  # "auto" (newest complete checkpoint), "none", or a checkpoint dir
    overwrite: bool = False  # start fresh in an out_dir with an earlier run, deleting its outputs
    save_final_model: bool = True  # write out_dir/model (HF layout) at the end
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])  # also "tensorboard", "wandb"
    seed: int = 0


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "gspo", "cispo")  # the objectives (docstring, grpo_loss)
# grpo_loss's per-token sums, logged as means over the loss tokens under TRL's GRPOTrainer names:
# the share of tokens clipped below, above, either; the k3 KL; the truncated importance weight
LOSS_METRICS = (
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "kl",
    "sampling/importance_sampling_ratio/mean",
)
OVERLONG = ("none", "mask", "shape")  # what happens to a completion that hit max_new_tokens


def validate(cfg: Config, reward_funcs: list | None = None) -> None:
    """Check every field and combination at once, before any model, data or Ray work."""
    errors = common_config_errors(cfg)  # the fields every config has; a missing logger fails now
    positive = ("num_generations", "prompts_per_step", "max_new_tokens", "max_prompt_len")
    num_funcs = len(reward_funcs or REWARD_FUNCS) + bool(
        cfg.reward_model
    )  # the reward model's comes last
    checks = [  # (holds, message when it does not)
        *((getattr(cfg, n) >= 1, f"{n}={getattr(cfg, n)}: must be >= 1") for n in positive),
        (cfg.temperature > 0 and 0 < cfg.top_p <= 1 and cfg.top_k >= 0,
         f"temperature={cfg.temperature} must be > 0, top_p={cfg.top_p} in (0, 1], top_k={cfg.top_k} >= 0 (0 = off)"),
        (0 <= cfg.clip_eps_low < 1 and cfg.clip_eps_high >= 0,
         f"clip_eps_low={cfg.clip_eps_low} must be in [0, 1), clip_eps_high={cfg.clip_eps_high} >= 0"),
        (cfg.kl_coef >= 0 and cfg.is_cap >= 0, f"kl_coef={cfg.kl_coef} and is_cap={cfg.is_cap} must be >= 0"),
        (len(cfg.reward_weights) == num_funcs, f"reward_weights has {len(cfg.reward_weights)} entries for {num_funcs} reward functions{' (the last: --reward_model)' if cfg.reward_model else ''}"),
        (cfg.loss_type in LOSS_TYPES, f"loss_type={cfg.loss_type!r}: choose one of {LOSS_TYPES}"),
        (cfg.loss_type != "dr_grpo" or not cfg.scale_rewards,
         "loss_type='dr_grpo' with scale_rewards=True: Dr. GRPO does not divide advantages by the group's std (pass --scale_rewards false)"),
        (cfg.advantage_baseline in ADVANTAGE_BASELINES,
         f"advantage_baseline={cfg.advantage_baseline!r}: choose one of {ADVANTAGE_BASELINES}"),
        # TRL refuses it too: the group is the baseline (a group of one has advantage 0, and
        # dynamic sampling would drop every group)
        (cfg.num_generations >= 2 or cfg.num_generations < 1,
         f"num_generations={cfg.num_generations}: GRPO's advantage is a completion's reward relative to the other "
         "completions of its prompt, so a group of one has advantage 0 and trains nothing (use num_generations >= 2)"),
        (cfg.max_refill_rounds >= 0, f"max_refill_rounds={cfg.max_refill_rounds}: must be >= 0"),
        (cfg.num_iterations >= 1, f"num_iterations={cfg.num_iterations}: must be >= 1"),
        # checkpoints only at rollout-batch boundaries (a resume never starts mid-batch)
        *((getattr(cfg, n) % max(cfg.num_iterations, 1) == 0,
           f"{n}={getattr(cfg, n)} with num_iterations={cfg.num_iterations}: must be a multiple of it "
           "(optimizer steps; a rollout batch takes num_iterations of them and checkpoints fall between batches)")
          for n in ("max_steps", "save_every_steps")),
        (cfg.weight_sync_every_steps == 1 or cfg.weight_sync_every_steps % max(cfg.num_iterations, 1) == 0,
         f"weight_sync_every_steps={cfg.weight_sync_every_steps} with num_iterations={cfg.num_iterations}: must be 1 "
         "or a multiple of num_iterations (weights are pushed only after a rollout batch's last step)"),
        (cfg.overlong in OVERLONG, f"overlong={cfg.overlong!r}: choose one of {OVERLONG}"),
        (cfg.overlong != "shape" or 1 <= cfg.overlong_buffer <= cfg.max_new_tokens,
         f"overlong_buffer={cfg.overlong_buffer} with overlong='shape': must be in [1, max_new_tokens={cfg.max_new_tokens}]"),
        # options that act only with another one: refused rather than silently ignored
        (cfg.overlong == "shape" or cfg.overlong_buffer == Config.overlong_buffer,
         f"overlong_buffer={cfg.overlong_buffer} applies to overlong='shape' only (overlong={cfg.overlong!r}); drop --overlong_buffer or pass --overlong shape"),
        # sync and async fix their bound (0 and 1 versions)
        (cfg.rollout == "off-policy" or cfg.max_staleness == Config.max_staleness,
         f"max_staleness={cfg.max_staleness} applies to rollout='off-policy' only (rollout={cfg.rollout!r} trains samples "
         f"at most {staleness_bound(cfg)} version(s) old); drop --max_staleness or pass --rollout off-policy"),
        (cfg.dynamic_sampling or cfg.max_refill_rounds == Config.max_refill_rounds,
         f"max_refill_rounds={cfg.max_refill_rounds} applies to dynamic_sampling only; drop it or pass --dynamic_sampling true"),
    ]  # fmt: skip
    errors += [message for holds, message in checks if not holds]
    errors += rollout_config_errors(cfg)  # engines, Ray, staleness, weight transfer
    if errors:
        raise ConfigError("invalid config: " + "; ".join(errors))


# === 3. Distributed + mesh ===
def setup_distributed(cfg: Config):
    """Process group, device and the DeviceMesh; the same code for 1 and N processes.

    Mesh dims: "dp_replicate" (if > 1), "dp_shard" (the rest of the world), and the
    flattened "dp" = dp_replicate x dp_shard: the ranks that read different data.
    """
    dist_info = init_distributed(cfg.device)
    mesh = build_mesh(dist_info.device.type, dp_replicate=cfg.dp_replicate, dp_shard=-1)
    torch.manual_seed(cfg.seed)  # same seed on every rank: identical init and sampling
    return dist_info, mesh


# === 4. Model ===
def parallelize(
    model: torch.nn.Module, cfg: Config, mesh, model_args: ModelArgs, trainable: bool = True
) -> None:
    """Apply the parallel plan and the memory tricks to `model` (still on meta), in place.

    One fixed order, as torchtitan's `parallelize_llama`: tensor + sequence parallel, context
    parallel, expert parallel, activation checkpointing or offloading, per-block compile, then
    FSDP2 (every block, then the root); this script's plan and tricks use FSDP2.
    Each step wraps what the one before produced: compile must see the checkpoint wrappers, and
    FSDP must wrap the compiled blocks. A frozen model (trainable=False: a reference) skips what
    only a backward pass needs.
    """
    # fp32 parameters are the master weights; FSDP casts to param_dtype for compute and reduces
    # gradients in fp32, so bf16 runs still apply every small AdamW update.
    mp_policy = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.dtype], reduce_dtype=torch.float32)
    # FSDP shards over dp_shard; HSDP (dp_replicate > 1) keeps one sharded copy per replica group
    # and all-reduces the gradients across the groups
    fsdp_mesh = mesh["dp_replicate", "dp_shard"] if cfg.dp_replicate > 1 else mesh["dp_shard"]
    fsdp_kwargs = {"mesh": fsdp_mesh, "mp_policy": mp_policy}
    # A 1-process fp32 run is left unwrapped: nothing to shard or cast, and fully_shard's gather and
    # reduce copies cost ~25% of a step there (measured: 6.1-6.8 s vs 4.7-5.3 s, SmolLM2-135M,
    # 4 x 256 tokens). Everything below works on both plain and sharded (DTensor) parameters.
    if fsdp_mesh.size() > 1 or cfg.dtype != "fp32":
        # one FSDP unit per block: forward and backward gather one block's weights at a time
        for layer in model.model.layers:
            fully_shard(layer, **fsdp_kwargs)
        # root unit: embed_tokens, norm and lm_head together, so a tied lm_head stays one parameter
        fully_shard(model, **fsdp_kwargs)
        # forward_hidden runs FSDP's unshard hooks too, so lm_head.weight is whole when a chunked
        # loss reads it
        register_fsdp_forward_method(model, "forward_hidden")


def setup_model(cfg: Config, model_dir: Path, mesh, device: torch.device) -> torch.nn.Module:
    """The trained model: built on meta (no memory) with HF module names, parallelized, then
    materialised on `device` and loaded from the HF checkpoint (each rank copies its shards)."""
    model_args = read_model_args(
        model_dir, {"max_prompt_len": cfg.max_prompt_len, "max_new_tokens": cfg.max_new_tokens}
    )
    model = build_model(model_args, device="meta")  # HF module names: keys equal the checkpoint's
    parallelize(model, cfg, mesh, model_args)
    disable_fsdp_gradient_division(model)  # the loss is already divided by the step's global count
    model.to_empty(device=device)
    model.init_rope()  # RoPE tables are buffers, not weights: compute them on the real device
    load_hf_checkpoint(model, model_dir)  # each rank copies its shard of every tensor
    return model


def setup_frozen_model(cfg: Config, model_dir: Path, mesh, device: torch.device) -> torch.nn.Module:
    """A frozen copy of the checkpoint (a reference): no gradients or optimizer state, stored in
    the compute dtype (half the memory in bf16), parallelized like the trained model."""
    model_args = read_model_args(
        model_dir, {"max_prompt_len": cfg.max_prompt_len, "max_new_tokens": cfg.max_new_tokens}
    )
    model = build_model(model_args, device="meta")
    model.requires_grad_(False)
    cast_frozen_params(model, DTYPES[cfg.dtype])
    parallelize(model, cfg, mesh, model_args, trainable=False)
    model.to_empty(device=device)
    model.init_rope()
    load_hf_checkpoint(model, model_dir)
    return model.eval()


# === 5. Loss ===
def policy_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    cfg: Config,
    **model_kwargs,
) -> torch.Tensor:
    """Per-token log-probs [B, S] fp32 of the completion tokens under the sampling distribution:
    softmax(logits / temperature) cut to the top-k / top-p support and renormalised, the label
    always kept in it; 0.0 off the completions (labels == IGNORE_INDEX); differentiable. The
    engines record their log-probs under the same convention (docstring), so ratios against them
    compare like with like. model_kwargs: a packed batch's position_ids and attention_mask."""
    completion = labels != IGNORE_INDEX  # [B, S]
    # prompt and padding positions skip lm_head: [T, V] logits of the T completion positions only
    logits = model(input_ids, **model_kwargs, logits_mask=completion)
    logps = torch.zeros(completion.shape, device=input_ids.device)  # 0 off the completions
    logps[completion] = sampled_logprobs(logits, labels[completion], cfg)
    return logps


def sampled_logprobs(logits: torch.Tensor, targets: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Log-probs [T] fp32 of the sampled tokens `targets` [T] int64 under the sampling
    distribution: softmax(logits / temperature) cut to the top-k / top-p support and
    renormalised, the target always kept in it. logits: lm_head's [T, V] at the targets'
    positions."""
    logits = logits.float() / cfg.temperature
    # the support the engines sampled from (top-k, then top-p); the sampled token stays in it
    logits = truncate_logits(logits, cfg.top_k, cfg.top_p, keep=targets)
    return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


def sequence_mean(
    values: torch.Tensor, mask: torch.Tensor, sequence_ids: torch.Tensor, num_sequences: int
) -> torch.Tensor:
    """At every token, the mean of `values` over its sequence's tokens where `mask` holds.

    Args:
        values: [B, S] fp32; mask: [B, S] bool; sequence_ids: [B, S] int64, the index of each
            position's sequence in the micro-batch (< num_sequences; -1: none).

    Returns:
        [B, S] fp32, 0 at a position outside the mask and in a sequence with no masked token.
    """
    ids = torch.where(mask, sequence_ids, -1)
    sums = sequence_sums(values * mask, ids, num_sequences)  # [n], accumulated in fp64
    counts = sequence_sums(mask, ids, num_sequences).clamp(min=1)  # [n] int64
    return expand_to_tokens(sums / counts, ids)


def loss_weights(
    mask: torch.Tensor,
    sequence_ids: torch.Tensor,
    num_sequences_here: int,
    cfg: Config,
    num_tokens: int,
    num_sequences: int,
) -> torch.Tensor:
    """Each token's weight in the step's loss (the normaliser of each loss_type), [B, S] fp32.

    The counts are the whole step's (every micro-batch and rank), so the weighted sums of the
    micro-batches add up to the full batch's loss and their gradients to its gradient:
        dapo, cispo:  1 / T              T = the step's loss tokens (num_tokens): all weigh the same
        grpo, gspo:   1 / (M * |o_i|)    M = the step's sequences, |o_i| = this sequence's loss
                                         tokens: the mean over each sequence, then over sequences
        dr_grpo:      1 / (M * L)        L = max_new_tokens: a constant, no length bias

    Args:
        mask: [B, S] bool, the loss tokens; sequence_ids: [B, S] int64, each position's sequence
            (< num_sequences_here, the sequences in this micro-batch).
        num_tokens, num_sequences: T and M (`step_totals`).
    """
    if cfg.loss_type in ("grpo", "gspo"):
        ids = torch.where(mask, sequence_ids, -1)
        lengths = sequence_sums(mask, ids, num_sequences_here).float()  # [n] |o_i|
        lengths = expand_to_tokens(lengths, ids)  # [B, S], each token its sequence's
        return mask / (num_sequences * lengths.clamp(min=1))
    if cfg.loss_type == "dr_grpo":
        return mask / (num_sequences * cfg.max_new_tokens)
    return mask / num_tokens  # dapo, cispo


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    is_cap: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    loss_type: str = "dapo",
    weights: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """The GRPO-family loss of one micro-batch, sum over tokens of weights * loss, and its
    summed metrics.

    per token t of completion i (A = A_i, sg = stop-gradient, clip(x) = clip(x, 1 - clip_eps_low,
    1 + clip_eps_high)):
        r = exp(logprobs - old_logprobs)                        (= 1 in value at one step per batch)
        w = min(exp(old_logprobs - sampler_logprobs), is_cap)   (detached; 1 when is_cap = 0)
        grpo, dapo, dr_grpo:  loss = -w * min(r * A, clip(r) * A)
        gspo:   s_i = exp(mean over i's tokens of (logprobs - old_logprobs))   (sequence ratio)
                s = sg(s_i) * exp(logprobs - sg(logprobs))    (= s_i in value, grad through token t)
                loss = -w * min(s * A, clip(s) * A)
        cispo:  loss = -w * sg(clip(r)) * A * logprobs
        all:    loss += kl_coef * k3,  k3 = exp(ref - logprobs) - (ref - logprobs) - 1  (>= 0;
                unbiased for KL(pi || ref))
    The loss types differ again in `weights` (`loss_weights`: how the step normalises).

    Args:
        logprobs: [B, S] fp32 log-probs of the completion tokens under the policy (with grad).
        old_logprobs: [B, S] the proximal policy's: pi_old's, recorded before a batch's
            num_iterations steps (`old_policy_logprobs`), or `logprobs.detach()` at one step.
        sampler_logprobs: [B, S] the generating engine's, stored with each sample.
        advantages: [B] fp32 advantage per sequence, or [B, S] per token (packing).
        mask: [B, S] bool, True on the loss's completion tokens.
        ref_logprobs: [B, S] the reference model's, or None (kl_coef must then be 0).
        loss_type: one of LOSS_TYPES.
        weights: [B, S] fp32 each token's weight in the step (`loss_weights`); None: 1 on the
            mask (the plain sum).
        sequence_ids: [B, S] int64, each position's sequence in the micro-batch (gspo's
            sequence ratio); None: each row is one sequence.

    Returns:
        (scalar: the weighted sum; sums over the mask's tokens of LOSS_METRICS: clipped below
        1 - clip_eps_low, clipped above 1 + clip_eps_high, either (0/1 each), kl, is_weight).
        Clipped: the clip zeroed the token's policy gradient (grpo, dapo, dr_grpo, gspo), or
        changed its weight (cispo). The names are TRL's GRPOTrainer's once divided by the
        tokens (`train_step`).

    Reference:
        GRPO: arXiv:2402.03300 eq. 3 (k3 KL: Schulman 2020, http://joschu.net/blog/kl-approx.html);
        clip-higher and token-level sum: DAPO arXiv:2503.14476 eq. 8; Dr. GRPO arXiv:2503.20783;
        GSPO (and GSPO-token) arXiv:2507.18071; CISPO: MiniMax-M1 arXiv:2506.13585; decoupled
        proximal policy and importance weight: Hilton et al. 2021, arXiv:2110.00641 eq. 5;
        truncation: TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
        Off-Policy RL Training").
    Differs from reference: the importance weight is truncated at is_cap (bias for variance).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: choose one of {LOSS_TYPES}")
    A = advantages if advantages.dim() == 2 else advantages[:, None]  # [B, S] or [B, 1]
    low, high = 1 - clip_eps_low, 1 + clip_eps_high
    log_ratio = logprobs - old_logprobs  # [B, S]
    if loss_type == "gspo":  # one ratio per sequence: the geometric mean of its token ratios
        if sequence_ids is None:  # row i is sequence i
            sequence_ids = torch.arange(mask.shape[0], device=mask.device)[:, None]
            sequence_ids = sequence_ids.expand(mask.shape)
        # mask.numel() bounds the micro-batch's sequences without reading sequence_ids (no sync)
        seq_log_ratio = sequence_mean(log_ratio.detach(), mask, sequence_ids, mask.numel())
        ratio = torch.exp(seq_log_ratio + logprobs - logprobs.detach())  # s_i in value
    else:
        ratio = torch.exp(log_ratio)
    is_weight = torch.ones_like(ratio)
    if is_cap > 0:
        is_weight = torch.exp(old_logprobs - sampler_logprobs).clamp(max=is_cap).detach()
    if loss_type == "cispo":  # REINFORCE, each token weighted by its clipped, detached ratio
        per_token = -is_weight * ratio.clamp(low, high).detach() * A * logprobs
        low_clipped, high_clipped = ratio < low, ratio > high
    else:  # PPO's pessimistic clipped surrogate
        surrogate = torch.minimum(ratio * A, ratio.clamp(low, high) * A)
        per_token = -is_weight * surrogate
        low_clipped, high_clipped = (ratio < low) & (A < 0), (ratio > high) & (A > 0)
    kl = torch.zeros_like(ratio)
    if kl_coef > 0:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + kl_coef * kl
    values = (
        low_clipped & mask,
        high_clipped & mask,
        (low_clipped | high_clipped) & mask,
        kl.detach() * mask,
        is_weight * mask,
    )
    sums = {name: v.sum().float() for name, v in zip(LOSS_METRICS, values, strict=True)}
    return (per_token * (mask if weights is None else weights)).sum(), sums


# === 6. Optimizer + LR schedule ===
def build_optimizer(cfg: Config, model: torch.nn.Module):
    """AdamW over trainable parameters (decay on matrices only) and a warmup + cosine schedule."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    # norms and biases: decay would only shrink them
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # fused: one kernel over all tensors; on CPU measured 0.36 s/step vs 1.3 s for foreach (135M
    # params) and 0.5 GB less peak memory, because foreach materialises per-step temporaries
    optimizer_cls = functools.partial(torch.optim.AdamW, fused=True)
    optimizer = optimizer_cls(groups, lr=cfg.lr, betas=tuple(cfg.betas))
    scheduler = cosine_schedule_with_warmup(
        optimizer, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio
    )
    return optimizer, scheduler


# === 7. Data ===
INSTRUCTION = " Answer with the final integer only."  # appended to every question


def math_answer_reward(completion: str, answer: str, **kwargs) -> float:
    """1.0 if the last integer in the completion equals the reference answer, else 0.0."""
    numbers = re.findall(r"-?\d+", completion.replace(",", ""))
    return float(bool(numbers) and int(numbers[-1]) == int(answer))


def format_reward(completion: str, **kwargs) -> float:
    """1.0 for a one-line reply that ends in an integer ("7", "4 + 3 = 7."), else 0.0."""
    return float(re.fullmatch(r"[^\n]{0,40}?-?\d+\.?", completion.strip()) is not None)


# Each is called per completion with prompt=, completion= (decoded text), answer= and
# completion_ids=; the total reward is the sum weighted by cfg.reward_weights.
REWARD_FUNCS = [math_answer_reward, format_reward]


def load_prompts(cfg: Config, tokenizer: Tokenizer) -> list[dict]:
    """Rows {"question", "answer"} -> chat-templated prompt ids; too-long prompts are dropped.

    Returns:
        [{"id": row number, "prompt_ids": list[int], "prompt": question text, "answer": str}].
    """
    source = resolve_data_path(cfg.dataset)
    examples = []
    for i, row in enumerate(load_rows(source)):
        question, answer = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(
                f"{source} row {i}: key 'question' must be a non-empty string, got {question!r:.60}"
            )
        if not re.fullmatch(r"\s*-?\d+\s*", str(answer)):
            raise ValueError(
                f"{source} row {i}: key 'answer' must be an integer (as number or string), got {answer!r:.60}"
            )
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question + INSTRUCTION}], add_generation_prompt=True
        )
        ids = tokenizer.encode(text)
        if len(ids) <= cfg.max_prompt_len:
            examples.append(
                {"id": i, "prompt_ids": ids, "prompt": question, "answer": str(answer).strip()}
            )
    if not examples:
        raise ValueError(
            f"{source}: no prompt fits max_prompt_len={cfg.max_prompt_len} tokens; raise --max_prompt_len"
        )
    return examples


def prompt_batches(
    examples: list[dict], prompts_per_step: int, seed: int, epoch: int = 0, consumed: int = 0
):
    """Yield ((epoch, consumed), prompts) forever: a fresh (seed, epoch) shuffle each epoch,
    starting `consumed` prompts into `epoch` (resume)."""
    while True:
        order = list(range(len(examples)))
        random.Random(seed * 100_003 + epoch).shuffle(order)
        while consumed + prompts_per_step <= len(order):
            batch = [examples[j] for j in order[consumed : consumed + prompts_per_step]]
            consumed += prompts_per_step
            yield (epoch, consumed), batch
        epoch, consumed = epoch + 1, 0


# === 8. Rollout ===
def overlong_penalty(length: int, cfg: Config) -> float:
    """DAPO's soft overlong punishment of a completion of `length` tokens (arXiv:2503.14476 eq.
    13, L_max = max_new_tokens, L_cache = overlong_buffer):
        0                                    if length <= L_max - L_cache
        ((L_max - L_cache) - length) / L_cache   if L_max - L_cache < length <= L_max
        -1                                   if length > L_max (the engines stop at L_max)
    """
    free = cfg.max_new_tokens - cfg.overlong_buffer
    return 0.0 if length <= free else max(-1.0, (free - length) / cfg.overlong_buffer)


def total_reward(r: Rollout, cfg: Config) -> float:
    """The reward the advantages see: the reward functions' weighted sum (r.reward), plus the
    overlong penalty under overlong="shape"."""
    penalty = overlong_penalty(len(r.completion_ids), cfg) if cfg.overlong == "shape" else 0.0
    return r.reward + penalty


def rewards_differ(group: list, cfg: Config) -> bool:
    """Dynamic sampling's filter (DAPO arXiv:2503.14476 eq. 11): keep a group only if its total
    rewards are not all equal (an all-equal group has advantage 0: no policy gradient)."""
    rewards = torch.tensor([total_reward(r, cfg) for r in group])  # fp32, as group_advantages
    return bool(rewards.max() > rewards.min())


def rollout_metrics(groups: list, cfg: Config, version: int) -> tuple[torch.Tensor, dict]:
    """Advantages [N*G] of the step's groups (each total reward relative to its group:
    `group_advantages` with scale_rewards and advantage_baseline) and, under TRL's GRPOTrainer
    names, their mean reward (the reward functions', without the overlong penalty), reward_std
    (the mean over groups of the group's std), frac_reward_zero_std, the share of truncated
    completions (completions/clipped_ratio), under overlong="shape" the mean penalty
    (rewards/overlong_penalty/mean), and the runtime's bookkeeping (`rollout_stats`)."""
    flat = [r for g in groups for r in g]  # [N*G], group by group
    rewards = torch.tensor([total_reward(r, cfg) for r in flat])
    advantages, frac_zero_std = group_advantages(
        rewards, cfg.num_generations, scale=cfg.scale_rewards, baseline=cfg.advantage_baseline
    )
    scores = torch.tensor([r.reward for r in flat])  # [N*G] fp32
    G = cfg.num_generations
    metrics = {
        "reward": scores.mean().item(),
        # a group of one has no spread: 0, not torch.std's NaN
        "reward_std": scores.view(-1, G).std(dim=1).mean().item() if G > 1 else 0.0,
        "frac_reward_zero_std": frac_zero_std,
        "completions/clipped_ratio": sum(r.truncated for r in flat) / len(flat),
        **rollout_stats(groups, version),
    }
    if cfg.overlong == "shape":
        penalties = [overlong_penalty(len(r.completion_ids), cfg) for r in flat]
        metrics["rewards/overlong_penalty/mean"] = sum(penalties) / len(flat)
    return advantages, metrics


def step_totals(groups: list, cfg: Config) -> tuple[int, int]:
    """The step's loss tokens T (completion tokens, less the truncated completions' under
    overlong="mask"; at least 1) and sequences M (N * G), over all ranks: `loss_weights`'
    counts."""
    flat = [r for g in groups for r in g]
    kept = [r for r in flat if not (cfg.overlong == "mask" and r.truncated)]
    return max(1, sum(len(r.completion_ids) for r in kept)), len(flat)


# === 9. train_step ===
def backward_and_step(
    model, optimizer, scheduler, micro_batches: list, loss_fn, cfg: Config
) -> tuple[dict, torch.Tensor, float]:
    """Backward through every micro-batch, clip the global gradient norm, step, advance the schedule.

    Args:
        micro_batches: what `loss_fn` takes, one per backward.
        loss_fn: micro_batch -> (loss, stats): a scalar already divided by the step's global
            count (so the micro-batches' gradients add up to the step's), and a dict of detached
            scalar tensors to sum over the micro-batches (metrics).

    Returns:
        (the summed stats plus "loss", the global gradient norm before clipping (a plain fp32
        scalar, also under FSDP), the lr the step used). The weights never see a NaN/inf, and
        main() stops without saving at a non-finite gradient norm, so the last checkpoint holds
        the weights before this step; the update is skipped.
    """
    totals: dict = {}
    for micro_batch in micro_batch_progress(micro_batches):  # a bar on a terminal, for long steps
        loss, stats = loss_fn(micro_batch)
        loss.backward()
        for k, v in {"loss": loss.detach(), **stats}.items():
            totals[k] = totals.get(k, 0) + v
    # over plain tensors, FSDP shards (DTensor) and expert-parallel experts alike
    grad_norm = clip_grad_norm(model, cfg.max_grad_norm)  # max_grad_norm 0: measure only
    lr = float(scheduler.get_last_lr()[0])  # a tensor under torchao optimizers
    if torch.isfinite(grad_norm):  # a NaN/inf gradient never reaches the weights; main() stops
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return totals, grad_norm, lr


def microbatch_inputs(mb: list, advantages: torch.Tensor, cfg: Config, device) -> dict:
    """A micro-batch of `Rollout`s as the model and the loss take it, on `device`: input_ids,
    labels [B, S] (IGNORE_INDEX off the completions), model_kwargs (a packed batch's positions
    and attention mask, else empty), sampler_logprobs [B, S] fp32, advantages ([B] fp32, or
    [B, S] when packed) and sequence_ids [B, S] int64 (each position's rollout in `mb`, -1 on
    padding). The same rollouts give the same layout: the no-grad pass of pi_old and the loss
    line up token for token."""
    batch = collate_rollouts(
        [r.prompt_ids for r in mb], [r.completion_ids for r in mb], pad_token_id=0
    )
    input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)  # [B, S]
    prompt_lens = [len(r.prompt_ids) for r in mb]
    sampler_logprobs = scatter_completion_values(
        [r.sampler_logprobs for r in mb], prompt_lens, input_ids.shape[1]
    )
    sequence_ids = torch.arange(len(mb), device=device)[:, None].expand(input_ids.shape)  # row i
    packed = {}
    return {
        "input_ids": input_ids, "labels": labels, "model_kwargs": packed, "sampler_logprobs": sampler_logprobs.to(device),
        "advantages": advantages.to(device), "sequence_ids": sequence_ids,
    }  # fmt: skip


def old_policy_logprobs(model, micro_batches: list, cfg: Config, device) -> list[torch.Tensor]:
    """pi_old's per-token log-probs of a rollout batch, one no-grad pass of the current policy
    before its num_iterations optimizer steps (TRL's old_per_token_logps): [B, S] fp32 per
    micro-batch of `micro_batches` ((rollouts, advantages) pairs, `train_step`'s split), in
    `microbatch_inputs`' layout. An empty micro-batch (this rank ran out) still runs a forward,
    so FSDP's all-gathers pair up across ranks, and gives an empty tensor."""
    old = []
    with torch.no_grad():
        for mb, mb_advantages in micro_batches:
            if not mb:
                model(torch.zeros(1, 1, dtype=torch.long, device=device))
                old.append(torch.zeros(0, 0, device=device))
                continue
            x = microbatch_inputs(mb, mb_advantages, cfg, device)
            old.append(
                policy_logprobs(model, x["input_ids"], x["labels"], cfg, **x["model_kwargs"])
            )
    return old


def microbatch_loss(
    model,
    reference,
    mb: list,
    advantages: torch.Tensor,
    cfg: Config,
    device,
    num_tokens: int,
    num_sequences: int,
    old_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """`grpo_loss` of a micro-batch of `Rollout`s (advantages: [len(mb)] fp32), weighted by
    `loss_weights` with the step's num_tokens and num_sequences (`step_totals`): this
    micro-batch's share of the step's loss, and the metric sums. old_logprobs: pi_old's [B, S]
    (`old_policy_logprobs`, num_iterations > 1), or None: the policy's own, detached (ratio 1)."""
    x = microbatch_inputs(mb, advantages, cfg, device)
    input_ids, labels, sequence_ids = x["input_ids"], x["labels"], x["sequence_ids"]
    logprobs = policy_logprobs(model, input_ids, labels, cfg)  # [B, S]
    ref_logprobs = None
    if reference is not None:
        with torch.no_grad():
            ref_logprobs = policy_logprobs(reference, input_ids, labels, cfg)
    mask = labels != IGNORE_INDEX  # [B, S] the completion tokens
    # overlong="mask": a truncated completion (no stop token) leaves the loss (DAPO sec. 3.4)
    if cfg.overlong == "mask":
        kept = torch.tensor([not r.truncated for r in mb], device=device)
        mask = mask & expand_to_tokens(kept, sequence_ids)
    weights = loss_weights(mask, sequence_ids, len(mb), cfg, num_tokens, num_sequences)
    # num_iterations 1: the proximal policy is the current one (ratio 1 in value), as TRL
    old_logprobs = logprobs.detach() if old_logprobs is None else old_logprobs
    return grpo_loss(
        logprobs, old_logprobs, x["sampler_logprobs"], x["advantages"], mask,
        cfg.clip_eps_low, cfg.clip_eps_high, cfg.is_cap, ref_logprobs, cfg.kl_coef, cfg.loss_type, weights, sequence_ids,
    )  # fmt: skip


def split_micro_batches(
    rollouts: list, advantages: torch.Tensor, num_micro_batches: int, cfg: Config
) -> list[tuple]:
    """(rollouts, advantages) of each of `num_micro_batches` micro-batches of
    cfg.micro_batch_size, in order; the last ones empty where this rank's share runs out."""
    size = cfg.micro_batch_size
    return [
        (rollouts[i * size : (i + 1) * size], advantages[i * size : (i + 1) * size])
        for i in range(num_micro_batches)
    ]


def train_step(
    model,
    reference,
    optimizer,
    scheduler,
    rollouts: list,
    advantages: torch.Tensor,
    num_tokens: int,
    num_micro_batches: int,
    cfg: Config,
    device,
    num_sequences: int | None = None,
    old_logprobs: list | None = None,
    dp_group=None,
) -> dict:
    """One optimizer step over this rank's rollouts, in `num_micro_batches` micro-batches.

    Args:
        rollouts: this rank's `Rollout`s; advantages: [len(rollouts)] fp32, theirs.
        num_tokens: loss tokens of the whole step (all ranks, `step_totals`): the completion
            tokens, less the truncated completions' under overlong="mask".
        num_micro_batches: the same on every rank (FSDP's collectives must pair up); a rank
            whose share is shorter runs zero-gradient micro-batches.
        num_sequences: rollouts of the whole step (all ranks), the grpo / gspo / dr_grpo
            normaliser; None: len(rollouts) (one process).
        old_logprobs: pi_old's log-probs per micro-batch (`old_policy_logprobs`, taken once
            before a batch's num_iterations steps); None: the policy's own, detached (ratio 1).
        dp_group: the data-parallel ranks' group (mesh["dp"]), which the metric sums are reduced
            over (tp / cp ranks hold the same rollouts); None: every rank.

    Returns:
        loss (the step's, as its loss_type normalises it), the LOSS_METRICS (means over
        the loss tokens), grad_norm, lr.
    """
    num_sequences = len(rollouts) if num_sequences is None else num_sequences
    micro_batches = split_micro_batches(rollouts, advantages, num_micro_batches, cfg)
    olds = old_logprobs or [None] * num_micro_batches
    micro_batches = [(*pair, old, None) for pair, old in zip(micro_batches, olds, strict=True)]
    step_keys = ("loss",)  # already the step's (loss_weights)
    token_keys = LOSS_METRICS  # sums over the loss tokens

    def loss_fn(micro_batch: tuple) -> tuple[torch.Tensor, dict]:
        mb, mb_advantages, old, mb_critic = micro_batch
        if not mb:  # this rank ran out: join the collectives with a zero gradient
            dummy = torch.zeros(1, 1, dtype=torch.long, device=device)
            zero = model(dummy).sum().mul(0)
            return zero, {k: torch.zeros((), device=device) for k in (*step_keys[1:], *token_keys)}
        # already weighted for the whole step (loss_weights): the micro-batches' gradients add up
        return microbatch_loss(
            model, reference, mb, mb_advantages, cfg, device, num_tokens, num_sequences, old
        )

    totals, grad_norm, lr = backward_and_step(
        model, optimizer, scheduler, micro_batches, loss_fn, cfg
    )
    # the losses are already the step's; the other sums become means over its loss tokens here
    keys = (*step_keys, *token_keys)
    sums = all_reduce_sum(torch.stack([totals[k] for k in keys]), dp_group)
    divisors = torch.tensor(
        [1.0] * len(step_keys) + [float(num_tokens)] * len(token_keys), device=sums.device
    )
    return dict(
        zip(keys, (sums / divisors).tolist(), strict=True), grad_norm=grad_norm.item(), lr=lr
    )


# === 10. main ===
def main(argv: list[str] | None = None, reward_funcs: list | None = None) -> list[dict]:
    """Train; returns every step's metrics (tests pass their own reward_funcs)."""
    cfg = parse_config(Config, argv)
    reward_funcs = reward_funcs or REWARD_FUNCS
    validate(cfg, reward_funcs)
    if (
        cfg.reward_model
    ):  # a model-graded reward after the verifiable ones: each reward worker loads it once
        reward_funcs = [*reward_funcs, RewardModelFunction(cfg.reward_model)]
    dist_info, mesh = setup_distributed(cfg)
    is_main, device = dist_info.is_main, dist_info.device
    dp_rank, dp_size, dp_group = data_parallel(mesh)  # tp / cp ranks of one dp rank: the same rows
    # an earlier run in out_dir: resume it, or refuse (never mix two runs' metrics or models)
    out_dir = claim_out_dir(cfg.out_dir, cfg.resume, cfg.overwrite, is_main)
    # the default hf_repo_id is the default model's: another --model needs its own (or a local copy)
    model_dir = resolve_model_dir(
        cfg.model, hub_repo_id(cfg.model, cfg.hf_repo_id, Config.model, Config.hf_repo_id)
    )
    tokenizer = Tokenizer.from_dir(model_dir)
    check_vocab_fits(tokenizer, model_dir)  # ids past the embedding table would fail mid-step
    examples = load_prompts(cfg, tokenizer)
    model = setup_model(cfg, model_dir, mesh, device)
    reference = setup_frozen_model(cfg, model_dir, mesh, device) if cfg.kl_coef > 0 else None
    optimizer, scheduler = build_optimizer(cfg, model)
    ckpt_dir = out_dir / "checkpoints"
    state = resume_training(
        cfg.resume, ckpt_dir, model, optimizer, scheduler, dataclasses.asdict(cfg), is_main
    )
    start_step = state.step
    resumed = state.step > 0
    # rank 0 drives Ray; engines start from the checkpoint on disk, so a resumed policy is pushed once
    pipeline = start_rollout(cfg, model_dir, tokenizer, reward_funcs) if is_main else None
    # collective transfer: the policy's HF tensors, read afresh at every sync (None: object-store)
    source = weight_source(cfg, model, device)
    if resumed:  # checkpoints fall between rollout batches: the version is batches trained
        sync_weights(pipeline, model, cfg, state.step // cfg.num_iterations, source, wait=True)
    batches = prompt_batches(
        examples, cfg.prompts_per_step, cfg.seed, state.epoch, state.samples_consumed
    )
    # dynamic sampling: the pipeline sets aside groups whose rewards are all equal and refills
    keep = functools.partial(rewards_differ, cfg=cfg) if cfg.dynamic_sampling else None
    logger = (
        MetricsLogger(out_dir, cfg.loggers, cfg, state.step, argv, state.config_changes)
        if is_main
        else None
    )
    if is_main:
        print(run_summary(cfg, model, model_dir, dist_info.world_size, device, (
            f"{len(examples)} prompts | {cfg.prompts_per_step} x {cfg.num_generations} rollouts per step | "
            f"rollout {cfg.rollout} (staleness <= {staleness_bound(cfg)}) | {cfg.num_engines} {cfg.engine} engine(s), "
            f"weight sync {resolve_weight_transfer(cfg)}{f' ({transfer_backend(cfg)})' if source is not None else ''}"
        )))  # fmt: skip
    progress = progress_bar(state.step, cfg.max_steps, is_main)  # on a terminal only
    history: list[dict] = []
    for step in progress:
        # policy version = rollout batches trained so far (= what the engines hold: weights are
        # pushed after a batch's last step); each batch takes num_iterations optimizer steps
        version, iteration = divmod(step - 1, cfg.num_iterations)
        start = time.perf_counter()
        if iteration == 0:
            # rank 0 asks the pipeline for the step's groups: it keeps the engines `prefetch` batches ahead
            # (sync 0, async 1, off-policy max_staleness), drops groups older than staleness_bound and
            # seeds each batch's sampling by its data position (a resumed run samples the same)
            groups, dropped, waited, position, filtered, refills = (
                pipeline.next_groups(
                    batches, cfg.prompts_per_step, version, staleness_bound(cfg), cfg.seed, keep=keep, max_refills=cfg.max_refill_rounds,
                ) if is_main else (None, 0, 0.0, None, 0, 0)
            )  # fmt: skip
            # rank 0's, on every rank (tp / cp ranks too: they train the rows of their dp rank)
            groups, position = share_rollouts(groups, position, dist_info.world_size)
            state.epoch, state.samples_consumed = position  # after the prompts submitted so far
            advantages, batch_metrics = rollout_metrics(
                groups, cfg, version
            )  # [N*G], same on every rank
            rollouts = [r for g in groups for r in g][dp_rank::dp_size]  # this rank's share
            # the loss's counts: loss tokens and sequences of all ranks; micro-batches: as many on every rank
            num_tokens, num_sequences = step_totals(groups, cfg)
            num_micro = math.ceil(
                math.ceil(len(groups) * cfg.num_generations / dp_size) / cfg.micro_batch_size
            )
            old_logprobs = (
                None  # num_iterations 1: pi_old is the policy itself (ratio 1), no extra pass
            )
            if cfg.num_iterations > 1:  # pi_old for all of the batch's steps, before the first
                split = split_micro_batches(rollouts, advantages[dp_rank::dp_size], num_micro, cfg)
                old_logprobs = old_policy_logprobs(model, split, cfg, device)
        else:  # the same batch again: its rollout metrics repeat, nothing new was waited for
            dropped, waited, filtered, refills = 0, 0.0, 0, 0
        metrics = dict(batch_metrics)
        train_start = time.perf_counter()
        metrics.update(train_step(
            model, reference, optimizer, scheduler, rollouts, advantages[dp_rank::dp_size], num_tokens, num_micro, cfg, device,
            num_sequences, old_logprobs, dp_group=dp_group,
        ))  # fmt: skip
        train_time = time.perf_counter() - train_start
        check_finite(step, metrics, state.path, hint="lower --lr")  # NaN/inf: stop, save nothing
        state.step = step
        # a push after a batch's last step only, and none after the run's last: no rollout would use
        # it (a resumed run pushes at its start)
        last_iteration = iteration == cfg.num_iterations - 1
        if (
            last_iteration
            and step < cfg.max_steps
            and (step % cfg.weight_sync_every_steps == 0 or cfg.rollout != "off-policy")
        ):
            metrics["weight_sync_s"] = sync_weights(pipeline, model, cfg, version + 1, source)
        step_time = time.perf_counter() - start
        metrics.update(
            dropped_stale=dropped, dropped_groups=filtered, num_refills=refills, rollout_wait_s=waited, train_s=train_time, step_time_s=step_time,
            # new rollouts per second: each of a batch's num_iterations steps is credited its share
            samples_per_s=cfg.prompts_per_step * cfg.num_generations / cfg.num_iterations / step_time, peak_mem_mib=peak_memory_mib(device),
        )  # fmt: skip
        history.append(metrics)
        if is_main and (step % cfg.log_every_steps == 0 or step == cfg.max_steps):
            logger.log({k: v for k, v in metrics.items() if k != "policy_versions"}, step)
            progress.write(
                f"step {step:5d} | reward {metrics['reward']:.3f} | loss {metrics['loss']:.4f} | zero-std groups "
                f"{metrics['frac_reward_zero_std']:.2f} | clip {metrics['clip_ratio/region_mean']:.3f} | kl {metrics['kl']:.4f} | "
                f"stale <= {metrics['staleness_max']} | len {metrics['completions/mean_length']:.1f} | {metrics['samples_per_s']:.1f} samples/s"
            )
        if cfg.save_every_steps and (step % cfg.save_every_steps == 0 or step == cfg.max_steps):
            config = dataclasses.asdict(cfg)
            state.path = save_train_state(
                ckpt_dir, state, model, optimizer, scheduler, config, cfg.keep_last_checkpoints
            )
    # what training_config.json records; None: this run trained no step and the saved model stays
    record = final_model_config(dataclasses.asdict(cfg), state, start_step, out_dir / "model")
    if cfg.save_final_model and record is not None:
        save_hf_model(model, model_dir, out_dir / "model", record, is_main)
    if pipeline:
        pipeline.shutdown()  # kills the actors; stops Ray if this run started it
    if logger:
        logger.close()
    del model, reference, optimizer, scheduler  # free FSDP state before the process group goes away
    destroy_distributed()
    return history


if __name__ == "__main__":
    # one-line errors (SCAFFOLD_DEBUG=1 for the traceback), printed once, with exit code 1
    entry_point(main)
