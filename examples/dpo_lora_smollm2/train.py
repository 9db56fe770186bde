"""LoRA DPO (Direct Preference Optimization) of smollm2-135m (llama family); IPO, SimPO, ORPO, KTO.

Trains on preference data (a prompt, a chosen and a rejected reply; or, for KTO, single replies
labelled desirable or not): the policy learns to prefer the chosen replies, with no reward model
and no sampling. Parallelism: FSDP2 `fully_shard` over the data-parallel processes (HSDP with
--dp_replicate > 1: notes below); one code path for 1..N devices.

Losses (--loss_type; each one's function in section 5 writes out its math and cites its paper):
- sigmoid: DPO (Rafailov et al. 2023), pairs, against a frozen reference model (--ref_mode).
- ipo: IPO (Azar et al. 2023), the same on per-token mean log-probs with a squared loss.
- simpo: SimPO (Meng et al. 2024), pairs, per-token mean log-probs and a target margin
  simpo_gamma; no reference.
- orpo: ORPO (Hong et al. 2024), pairs, the chosen reply's NLL plus orpo_lambda x an odds-ratio
  term; no reference.
- kto: KTO (Ethayarajh et al. 2024), unpaired desirable / undesirable replies against the
  reference, around a reference point z_ref (the step's KL estimate on mismatched pairs).
simpo and orpo build, load and precompute no reference model (only the policy is resident);
--ref_mode and --ref_device set to other than their defaults are refused with them (the
defaults cannot be told from not given, and are ignored). beta defaults to 2.0 for simpo (the SimPO
paper's; torchtune's SimPOLoss), else 0.1 (TRL's); orpo has no beta (its weight is orpo_lambda).

Launch:
    python train.py                                   # 1 process (CPU, or 1 GPU)
    torchrun --nproc-per-node 1 train.py --lr 5e-05 --max_steps 100
    bash launch/torchrun.sh --max_steps 100           # the same line, from the file beside this one
    sbatch launch/slurm.sbatch                        # Slurm: 1 node(s) x 1 GPU(s), c10d rendezvous
    launch/torchrun_multinode.sh                      # torchrun --nnodes 1: the line to run on each node
    python train.py --ref_mode precomputed --beta 0.05   # reference log-probs cached before training
    python train.py --loss_type simpo                  # reference-free: one model resident

Data (--dataset, .json/.jsonl/.parquet or a `datasets` name), one pair per row, either
- TRL's `prompt` (or `messages`), `chosen`, `rejected`: strings or message lists ({"role",
  "content"}), or only `chosen`/`rejected` conversations that share their prompt turns (TRL's
  implicit prompt); or
- LLaMA-Factory's `conversations` (the prompt turns) with `chosen`/`rejected` replies.
kto also reads TRL's unpaired rows: `prompt` (or `messages`, `conversations`), `completion` and a
bool `label` (true: desirable); a pair there is two examples, chosen desirable and rejected not
(TRL's unpair_preference_dataset).

Logged (TRL's names), means over the step's pairs: rewards/chosen and rewards/rejected, each
reply's implicit reward (sigmoid: beta * (policy - reference) log-prob, summed over its tokens;
ipo: of the per-token means; simpo: beta * the policy's mean log-prob; orpo: orpo_lambda * it),
rewards/margins (their difference), rewards/accuracies (the share of pairs whose chosen reward is
higher; 0 at DPO's step 1, where the policy is the reference), logps/chosen and logps/rejected
(the policy's log-probs the loss uses). orpo adds nll_loss, log_odds_ratio (mean log sigmoid of
the log odds ratio) and log_odds_chosen (the mean log odds ratio). kto (unpaired: no accuracy)
logs its rewards beta * (policy - reference) and logps per label, over the step's examples of
that label (count/chosen, count/rejected; left out when there are none), their margin, and kl
(z_ref).

Reference modes (--ref_mode; sigmoid, ipo and kto):
- adapters-off: the policy's own frozen base with the LoRA adapters skipped: no second copy
- separate: a frozen copy of the checkpoint (--ref_device cpu keeps it in host memory)
- precomputed: one pass over the data before training caches the reference log-probs per pair, then
  only the policy is resident

Differs from the papers above / Hugging Face TRL's DPOTrainer, CPOTrainer (SimPO), ORPOTrainer
and KTOTrainer:
- Loss = mean over all pairs (KTO: examples) of the optimizer step (all micro-batches and ranks),
  as TRL per batch.
- kto: z_ref is one estimate per optimizer step: the mean policy - reference log-ratio of the KL
  sequences of all its micro-batches and ranks (a no-grad pass before the backward passes; TRL
  takes it per micro-batch, averaged over ranks), so gradient accumulation changes nothing. An
  example's KL sequence is its prompt with the next example's completion (file order, pairs
  unpaired as chosen ones then rejected ones), fixed once (TRL pairs neighbours within a batch).
- orpo: the NLL term is each chosen reply's per-token mean, averaged over pairs (the paper's
  per-example loss); TRL averages over all chosen tokens of the batch, weighting long replies more.
  log(1 - p) is taken as log(-expm1(log p)) where p > 1/2 (TRL's log1p(-exp(log p)) there loses
  its digits, and is -inf at log p = 0), else as TRL.
- A pair longer than max_seq_len is cut at the end (TRL truncates the prompt first); pairs with no
  supervised token left in either reply (KTO: examples with none in their completion) are dropped.
- Log-probabilities take lm_head's logits at the supervised positions only ([T, V], T = reply
  tokens); `--tricks lce` takes them in chunks instead.
- dtype="bf16" computes in bf16 but keeps fp32 master weights and fp32 AdamW state.
- Bytes per trained parameter (FSDP-sharded, GPU): weights 4 (fp32 master) + gradients 4 (fp32) +
  AdamW state 8 (fp32) = 16; frozen base 2 (bf16).
- LoRA (Hu et al. 2021, arXiv:2106.09685): each targeted linear gains lora_A [r, D_in] and lora_B
  [D_out, r], scaled by lora_alpha / lora_rank; only they reach the optimizer. A is
  kaiming-uniform and B zero, as Hugging Face PEFT. The adapter is saved in PEFT layout
  (`peft.PeftModel.from_pretrained` loads it) and, with save_merged, merged into an HF model.

Generated by scaffold 0.1.0 with `scaffold new --algo dpo-lora --model smollm2-135m --dataset dpo_en_demo.json --out examples/dpo_lora_smollm2`.
Edit freely; `scaffold regen` merges template or option changes into your edits.
"""

# === 1. Imports ===
import dataclasses
import functools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.utils.data import DataLoader

from runtime import (
    IGNORE_INDEX,
    LORA_TARGET_MODULES,
    ConfigError,
    MetricsLogger,
    ModelArgs,
    Tokenizer,
    adapter_param_names,
    adapters_disabled,
    add_lora,
    all_reduce_sum,
    base_model_id,
    build_dataloader,
    build_mesh,
    build_model,
    cast_frozen_params,
    check_finite,
    check_vocab_fits,
    checkpoint_dtype,
    claim_out_dir,
    clip_grad_norm,
    common_config_errors,
    copy_tokenizer_files,
    cosine_schedule_with_warmup,
    data_parallel,
    destroy_distributed,
    disable_fsdp_gradient_division,
    entry_point,
    final_model_config,
    frozen_cpu_copy,
    hub_repo_id,
    infinite_batches,
    init_distributed,
    init_lora,
    is_adapter_param,
    last_user_message,
    load_adapter,
    load_hf_checkpoint,
    load_reference_logprobs,
    load_rows,
    merged_hf_tensors,
    micro_batch_progress,
    pad_batch,
    parse_config,
    peak_memory_mib,
    progress_bar,
    read_hf_config,
    read_model_args,
    reference_logprobs,
    resolve_data_path,
    resolve_model_dir,
    resolve_resume,
    resume_training,
    run_summary,
    sample,
    save_adapter,
    save_hf_checkpoint,
    save_train_state,
    split_train_val,
    step_line,
    to_preference,
    to_unpaired,
)


# === 2. Config ===
@dataclass
class Config:
    # model
    model: str = "smollm2-135m"  # local HF directory, or a name in $SCAFFOLD_HOME/models
    hf_repo_id: str = "HuggingFaceTB/SmolLM2-135M-Instruct"  # Hub fallback
    # data
    dataset: str = "dpo_en_demo.json"  # preference rows: .json/.jsonl/.parquet or HF dataset name
    max_seq_len: int = 512  # tokens per sequence (prompt + one reply); longer ones are cut
    pad_to_max_seq_len: bool = False  # pad every batch to max_seq_len (fixed shapes for benchmarks)
    val_fraction: float = 0.02  # held-out share of the pairs for validation metrics
    # preference loss (the docstring's list; section 5)
    loss_type: str = "sigmoid"  # sigmoid (DPO) | ipo | simpo | orpo | kto
    beta: float | None = None  # reward scale; None: 2.0 for simpo, else 0.1 (orpo has none)
    label_smoothing: float = 0.0  # sigmoid, simpo: assumed share of flipped labels (cDPO)
    simpo_gamma: float = 0.5  # simpo: target reward margin gamma (TRL's default)
    orpo_lambda: float = 0.1  # orpo: weight of the odds-ratio term (TRL's ORPOConfig.beta)
    desirable_weight: float = 1.0  # kto: weight of the desirable examples' losses (lambda_D)
    undesirable_weight: float = 1.0  # kto: weight of the undesirable examples' losses (lambda_U)
    ref_mode: str = "adapters-off"  # adapters-off | separate | precomputed; simpo, orpo: none
    ref_device: str = (
        "auto"  # ref_mode=separate: "auto" (the policy's device, sharded) or "cpu" (a full copy)
    )

    def __post_init__(self):  # beta's default is the loss's: SimPO's rewards are per-token means
        if self.beta is None and self.loss_type != "orpo":
            self.beta = 2.0 if self.loss_type == "simpo" else 0.1

    # optimization
    lr: float = 5e-05  # peak learning rate
    weight_decay: float = 0.0  # AdamW decoupled decay on matrices (not on norms/biases)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 10  # optimizer steps of linear warmup
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio (1.0 = constant after warmup)
    max_steps: int = 100  # optimizer steps in total
    max_grad_norm: float = 1.0  # clip the global gradient norm to this (0 = off)
    micro_batch_size: int = 4  # pairs per rank per forward (2x sequences)
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    # parallelism
    dp_replicate: int = 1  # HSDP replica groups (1 = FSDP over all dp ranks)
    # precision and devices
    dtype: str = "bf16"  # "bf16" (bf16 compute, fp32 master weights) or "fp32"
    device: str = "auto"  # "auto" (CUDA if available), "cuda" or "cpu"
    # adapters: W x + lora_scale * B A x with lora_scale = lora_alpha / lora_rank; only A, B (and
    # DoRA's magnitude) train
    lora_rank: int = 8  # r
    lora_alpha: float = 16.0  # adapter scale = lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the adapter input (training only)
    lora_target_modules: list[str] = field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )  # HF module names; "lm_head" too on models without tied embeddings
    use_dora: bool = False  # DoRA: a learned magnitude per output row
    resume_adapter: str = ""  # adapter dir (PEFT layout) to start from; "" = fresh adapters
    save_merged: bool = True  # also save the merged model (HF layout) in <save dir>/merged
    # logging, evaluation, checkpoints
    out_dir: str = "out"  # metrics.jsonl, checkpoints and the final model go here
    log_every_steps: int = 1
    eval_every_steps: int = 25  # 0 = only at the end
    save_every_steps: int = 0  # resumable checkpoints in out_dir/checkpoints (0 = none)
    keep_last_checkpoints: int = 2  # older complete checkpoints are deleted
    resume: str = "auto"  # "auto" (newest complete checkpoint), "none", or a checkpoint dir
    overwrite: bool = False  # start fresh in an out_dir with an earlier run, deleting its outputs
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])  # also "tensorboard", "wandb"
    seed: int = 0
    sample_prompt: str = ""  # answered at the end; "" = the first validation example's prompt
    sample_max_new_tokens: int = 48  # 0 = skip the sample


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LOSS_TYPES = ("sigmoid", "ipo", "simpo", "orpo", "kto")
REFERENCE_FREE = ("simpo", "orpo")  # they score the policy alone: no reference model at all
REF_MODES = ("adapters-off", "separate", "precomputed")
# each loss's own fields: set for another loss they would do nothing, so validate refuses them
LOSS_FIELDS = {
    "simpo_gamma": "simpo",
    "orpo_lambda": "orpo",
    "desirable_weight": "kto",
    "undesirable_weight": "kto",
}


def validate(cfg: Config) -> None:
    """Check every field and combination at once, before any model or data work."""
    errors = common_config_errors(cfg)  # the fields every config has; a missing logger fails now
    if cfg.loss_type not in LOSS_TYPES:
        errors.append(f"loss_type={cfg.loss_type!r}: choose one of {LOSS_TYPES}")
    if cfg.loss_type == "orpo" and cfg.beta is not None:
        errors.append(
            f"beta={cfg.beta} with loss_type='orpo': ORPO has no beta, its odds-ratio weight is "
            "orpo_lambda (TRL's ORPOConfig.beta); drop --beta or set --orpo_lambda"
        )
    elif cfg.beta is not None and cfg.beta <= 0:
        errors.append(f"beta={cfg.beta} must be > 0")
    if not 0 <= cfg.label_smoothing < 0.5:
        errors.append(f"label_smoothing={cfg.label_smoothing} must be in [0, 0.5)")
    elif cfg.label_smoothing and cfg.loss_type not in ("sigmoid", "simpo"):
        errors.append(
            f"label_smoothing={cfg.label_smoothing} applies to loss_type sigmoid and simpo only; set it to 0"
        )
    for name, loss_type in LOSS_FIELDS.items():
        value = getattr(cfg, name)
        if value < 0 or (name.endswith("weight") and value == 0):
            errors.append(f"{name}={value} must be {'> 0' if name.endswith('weight') else '>= 0'}")
        elif (
            cfg.loss_type in LOSS_TYPES
            and cfg.loss_type != loss_type
            and value != getattr(Config, name)
        ):
            errors.append(
                f"{name}={value} applies to loss_type={loss_type!r} only, and this run's is "
                f"{cfg.loss_type!r}; drop --{name}"
            )
    if cfg.loss_type in REFERENCE_FREE:  # the reference's options would do nothing: refuse them
        for name in ("ref_mode", "ref_device"):
            if getattr(cfg, name) != getattr(Config, name):
                errors.append(
                    f"{name}={getattr(cfg, name)!r} with loss_type={cfg.loss_type!r}: {cfg.loss_type} uses "
                    f"no reference model (none is built, loaded or precomputed); drop --{name}"
                )
    elif cfg.ref_mode not in REF_MODES:
        errors.append(f"ref_mode={cfg.ref_mode!r}: choose one of {REF_MODES}")
    elif cfg.ref_device not in ("auto", "cpu") or (
        cfg.ref_device == "cpu" and cfg.ref_mode != "separate"
    ):
        errors.append(
            f"ref_device={cfg.ref_device!r}: 'auto', or 'cpu' with ref_mode='separate' only"
        )
    if cfg.lora_rank < 1 or cfg.lora_alpha <= 0 or not 0 <= cfg.lora_dropout < 1:
        errors.append(
            f"lora_rank={cfg.lora_rank} must be >= 1, lora_alpha={cfg.lora_alpha} > 0, "
            f"lora_dropout={cfg.lora_dropout} in [0, 1)"
        )
    unknown = [m for m in cfg.lora_target_modules if m not in LORA_TARGET_MODULES]
    if unknown or not cfg.lora_target_modules:
        errors.append(
            f"lora_target_modules={cfg.lora_target_modules}: unknown {unknown or '(empty list)'}; "
            f"valid: {', '.join(LORA_TARGET_MODULES)}"
        )
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if cfg.resume_adapter and not (Path(cfg.resume_adapter) / name).is_file():
            errors.append(f"resume_adapter={cfg.resume_adapter!r}: {name} not found there")
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
    """The trained model: built on meta (no memory) with HF module names, adapters added and the base frozen, parallelized, then
    materialised on `device` and loaded from the HF checkpoint (each rank copies its shards)."""
    model_args = read_model_args(model_dir, {"max_seq_len": cfg.max_seq_len})
    model = build_model(model_args, device="meta")  # HF module names: keys equal the checkpoint's
    # adapters on the targeted linears (on meta, like the base; lora_scale is computed inside)
    add_lora(
        model,
        cfg.lora_target_modules,
        cfg.lora_rank,
        cfg.lora_alpha,
        cfg.lora_dropout,
        use_dora=cfg.use_dora,
    )
    # train the adapters only: base weights, embeddings and norms stay frozen
    for name, param in model.named_parameters():
        param.requires_grad = is_adapter_param(name)
    cast_frozen_params(model, DTYPES[cfg.dtype])  # no optimizer step: bf16 runs keep them in bf16
    parallelize(model, cfg, mesh, model_args)
    disable_fsdp_gradient_division(model)  # the loss is already divided by the step's global count
    model.to_empty(device=device)
    model.init_rope()  # RoPE tables are buffers, not weights: compute them on the real device
    # the base checkpoint has no adapters: load the base strictly, then initialise the adapters
    load_hf_checkpoint(model, model_dir, exclude=adapter_param_names(model))
    # A kaiming-uniform, B = 0 (the model starts equal to the base), DoRA magnitude = ||W|| per row
    init_lora(model, seed=cfg.seed)
    if cfg.resume_adapter:
        load_adapter(model, cfg.resume_adapter)  # strict: every adapter key, no other key
    return model


def setup_frozen_model(cfg: Config, model_dir: Path, mesh, device: torch.device) -> torch.nn.Module:
    """A frozen copy of the checkpoint (a reference): no gradients or optimizer state, stored in
    the compute dtype (half the memory in bf16), parallelized like the trained model."""
    model_args = read_model_args(model_dir, {"max_seq_len": cfg.max_seq_len})
    model = build_model(model_args, device="meta")
    model.requires_grad_(False)
    cast_frozen_params(model, DTYPES[cfg.dtype])
    parallelize(model, cfg, mesh, model_args, trainable=False)
    model.to_empty(device=device)
    model.init_rope()
    load_hf_checkpoint(model, model_dir)
    return model.eval()


def build_reference(cfg: Config, model_dir: Path, mesh, device: torch.device) -> torch.nn.Module:
    """ref_mode="separate": the base checkpoint loaded a second time, frozen. On the policy's device
    it is parallelized like the policy; ref_device="cpu": a full copy in host memory on each rank."""
    if cfg.ref_device == "cpu":
        model_args = read_model_args(model_dir, {"max_seq_len": cfg.max_seq_len})
        return frozen_cpu_copy(model_args, model_dir, DTYPES[cfg.dtype])
    return setup_frozen_model(cfg, model_dir, mesh, device)


# === 5. Loss ===
def sequence_logprobs(
    model: torch.nn.Module, batch: dict, cfg: Config
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each sequence's supervised tokens (its reply) under `model`.

    Args:
        batch: input_ids [2P, S] int64 (P chosen rows, then their P rejected rows); labels [2P, S]
            int64, pre-shifted, IGNORE_INDEX on the prompt and padding.

    Returns:
        (logps [2P] fp32: sum over supervised tokens of log p(token), num_tokens [2P] int64).
    """
    supervised = batch["labels"] != IGNORE_INDEX  # [2P, S]
    # prompt and padding positions skip lm_head: [T, V] logits of the T supervised positions only
    logits = model(batch["input_ids"], logits_mask=supervised).float()
    targets = batch["labels"][supervised][:, None]  # [T, 1]
    token_logps = logits.log_softmax(-1).gather(-1, targets).squeeze(-1)  # [T]
    logps = torch.zeros(supervised.shape, device=logits.device)
    logps[supervised] = token_logps  # [B, S], 0 off the replies
    return logps.sum(-1), supervised.sum(-1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference loss and the implicit rewards.

    Args:
        policy_chosen, policy_rejected, ref_chosen, ref_rejected: [P] fp32 sequence log-probs
            (summed over the reply's tokens; per-token means for loss_type="ipo").
        beta: temperature of the implicit reward r = beta * (log pi - log pi_ref).
        label_smoothing: cDPO's assumed probability that a pair's label is flipped (sigmoid only).
        loss_type: "sigmoid" or "ipo".

    Returns:
        (losses [P], chosen_rewards [P], rejected_rewards [P]); rewards are detached.

    Reference:
        Rafailov et al. 2023, arXiv:2305.18290, eq. 7: -log sigmoid(beta * h), h = the difference
        of the chosen and rejected log-ratios; cDPO (Mitchell 2023) as TRL: (1 - eps) * that +
        eps * -log sigmoid(-beta * h). IPO: Azar et al. 2023, arXiv:2310.12036, eq. 17:
        (h - 1 / (2 beta))^2, on per-token mean log-probs as TRL.
    """
    logits = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)  # [P] h
    if loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def simpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair SimPO loss and its rewards: no reference model.

    Args:
        policy_chosen, policy_rejected: [P] fp32 per-token mean log-probs of each reply
            (length-normalised: the sum over its tokens / its token count).
        beta: reward scale; the reward of a reply is r = beta * its mean log-prob.
        gamma: target reward margin: the chosen reward should exceed the rejected one by gamma.
        label_smoothing: assumed probability that a pair's label is flipped, as in cDPO.

    Returns:
        (losses [P], chosen_rewards [P], rejected_rewards [P]); rewards are detached.

    Reference:
        Meng et al. 2024, arXiv:2405.14734, eq. 6: -log sigmoid(r_chosen - r_rejected - gamma),
        written as TRL's CPOTrainer (loss_type="simpo", cpo_alpha=0):
        -log sigmoid(beta * (h - gamma / beta)), h = the difference of the mean log-probs.
    """
    logits = (policy_chosen - policy_rejected) - gamma / beta  # [P]
    losses = (
        -F.logsigmoid(beta * logits) * (1 - label_smoothing)
        - F.logsigmoid(-beta * logits) * label_smoothing
    )
    return losses, beta * policy_chosen.detach(), beta * policy_rejected.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, accurate everywhere: log(-expm1(x)) for x > -log 2, where
    1 - exp(x) would cancel (and log1p(-exp(x)) is -inf for x within fp32 rounding of 0), else
    log1p(-exp(x)) (Maechler 2012, "Accurately computing log(1 - exp(-|a|))")."""
    near_zero = x > -math.log(2)
    # each branch gets only the inputs it serves (-1 elsewhere): torch.where passes a zero
    # gradient to the branch it drops, and 0 * inf (log1p(-exp(x)) as x -> 0) would be NaN
    upper = torch.log(-torch.expm1(torch.where(near_zero, x, -1.0)))
    lower = torch.log1p(-torch.exp(torch.where(near_zero, -1.0, x)))
    return torch.where(near_zero, upper, lower)


def orpo_loss(
    policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, orpo_lambda: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair ORPO loss, its rewards and log odds ratios: no reference model.

    Args:
        policy_chosen, policy_rejected: [P] fp32 per-token mean log-probs of each reply: log p,
            p = the reply's length-normalised probability (exp of its mean token log-prob).
        orpo_lambda: weight of the odds-ratio term (TRL's ORPOConfig.beta).

    Returns:
        (losses [P], chosen_rewards [P], rejected_rewards [P], log_odds [P]); all but the losses
        detached. rewards = orpo_lambda * mean log-prob (TRL's); log_odds = log(odds_chosen /
        odds_rejected).

    Reference:
        Hong et al. 2024, arXiv:2403.07691, eqs. 6-7: L = L_SFT + lambda * L_OR, with
        odds(y) = p / (1 - p), L_OR = -log sigmoid(log(odds_chosen / odds_rejected)) and L_SFT
        the chosen reply's NLL (its per-token mean here); log odds = log p - log(1 - p), as TRL.
    """
    log_odds = (policy_chosen - log1mexp(policy_chosen)) - (
        policy_rejected - log1mexp(policy_rejected)
    )
    nll = -policy_chosen  # [P] L_SFT: the chosen reply's mean negative log-likelihood
    losses = nll - orpo_lambda * F.logsigmoid(log_odds)  # L_SFT + lambda * L_OR
    chosen_rewards = orpo_lambda * policy_chosen.detach()
    rejected_rewards = orpo_lambda * policy_rejected.detach()
    return losses, chosen_rewards, rejected_rewards, log_odds.detach()


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example KTO loss and the implicit rewards.

    Args:
        policy_logps, ref_logps: [E] fp32 log-probs of each example's completion (summed over its
            tokens) under the policy and the reference.
        desirable: [E] bool, the examples' labels.
        kl: scalar fp32 z_ref >= 0, detached: the step's KL estimate (`kto_reference_point`).
        beta: reward scale; r = beta * (log pi - log pi_ref).
        desirable_weight, undesirable_weight: lambda_D and lambda_U.

    Returns:
        (losses [E], rewards [E]); rewards are detached.

    Reference:
        Ethayarajh et al. 2024, arXiv:2402.01306, eq. 8, as TRL's KTOTrainer: with h = log pi -
        log pi_ref, a desirable example loses lambda_D * (1 - sigmoid(beta * (h - z_ref))), an
        undesirable one lambda_U * (1 - sigmoid(beta * (z_ref - h))).
    """
    logratios = policy_logps - ref_logps  # [E] h
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios))),
    )
    return losses, beta * logratios.detach()


@torch.no_grad()
def base_logprobs(
    model: torch.nn.Module, batch: dict, cfg: Config, during_training: bool = True
) -> torch.Tensor:
    """Sequence log-probs [2P] fp32 of the policy's frozen base (LoRA adapters skipped): the
    reference of ref_mode adapters-off, and of the precomputed pass (during_training False: it
    runs before the first step, so a trainable non-adapter weight has not moved yet)."""
    with adapters_disabled(model, check_frozen_base=during_training):
        return sequence_logprobs(model, batch, cfg)[0]


def reference_side(model, reference, ref_cache, batch: dict, cfg: Config) -> torch.Tensor:
    """The reference's sequence log-probs [2P] fp32 of `batch` (no gradient), by ref_mode."""
    if cfg.ref_mode == "adapters-off":
        return base_logprobs(model, batch, cfg)
    # the frozen copy, or the rows of the precomputed table ([N, 2] per pair id)
    return reference_logprobs(
        reference, ref_cache, batch, lambda m, b: sequence_logprobs(m, b, cfg)[0]
    )


def pair_losses(model, reference, ref_cache, batch: dict, cfg: Config) -> tuple[torch.Tensor, dict]:
    """Pair losses [P] of one micro-batch (sigmoid, ipo, simpo, orpo) and its summed metrics
    (TRL's names)."""
    P = batch["sample_ids"].numel()
    policy_logps, num_tokens = sequence_logprobs(model, batch, cfg)  # [2P], [2P]
    extra = {}
    if cfg.loss_type in REFERENCE_FREE:  # the policy alone, on per-token means (length-normalised)
        policy_logps = policy_logps / num_tokens
        if cfg.loss_type == "simpo":
            losses, chosen_rewards, rejected_rewards = simpo_loss(
                policy_logps[:P], policy_logps[P:], cfg.beta, cfg.simpo_gamma, cfg.label_smoothing
            )
        else:
            losses, chosen_rewards, rejected_rewards, log_odds = orpo_loss(
                policy_logps[:P], policy_logps[P:], cfg.orpo_lambda
            )
            extra = {
                "nll_loss": -policy_logps[:P].detach().sum(),
                "log_odds_ratio": F.logsigmoid(log_odds).sum(),
                "log_odds_chosen": log_odds.sum(),
            }
    else:
        ref_logps = reference_side(model, reference, ref_cache, batch, cfg)  # [2P]
        if cfg.loss_type == "ipo":  # IPO compares per-token means (TRL), not sums
            policy_logps, ref_logps = policy_logps / num_tokens, ref_logps / num_tokens
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            policy_logps[:P], policy_logps[P:], ref_logps[:P], ref_logps[P:],
            cfg.beta, cfg.label_smoothing, cfg.loss_type,
        )  # fmt: skip
    sums = {
        "rewards/chosen": chosen_rewards.sum(),
        "rewards/rejected": rejected_rewards.sum(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum(),
        "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
        "logps/chosen": policy_logps[:P].detach().sum(),
        "logps/rejected": policy_logps[P:].detach().sum(),
        **extra,
    }
    return losses, sums


@torch.no_grad()
def kto_reference_point(
    model, reference, ref_cache, micro_batches: list[dict], cfg: Config, device, dp_group=None
):
    """KTO's reference point z_ref for one optimizer step, and each micro-batch's reference
    log-probs of its completions (scored here once, for the loss pass).

    z_ref estimates KL(pi || pi_ref) by the mean policy - reference log-ratio of the step's KL
    sequences (each example's prompt with another example's completion: a reply not written for
    it), over every micro-batch and data-parallel rank (`dp_group`; None = all ranks); clamped at
    0 and detached, as TRL's.

    Returns:
        (z_ref: scalar fp32, [[E] fp32 reference log-probs of each micro-batch's completions]).
    """
    totals = torch.zeros(2, device=device)  # sum of the KL log-ratios, number of examples
    ref_completions = []
    for mb in micro_batches:
        batch = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
        E = batch["sample_ids"].numel()  # rows: E completions, then their E KL sequences
        ref_logps = reference_side(model, reference, ref_cache, batch, cfg)  # [2E]
        kl_rows = {k: batch[k][E:] for k in ("input_ids", "labels")}
        policy_kl = sequence_logprobs(model, kl_rows, cfg)[0]  # [E]
        totals += torch.stack(
            [(policy_kl - ref_logps[E:]).sum(), torch.tensor(float(E), device=device)]
        )
        ref_completions.append(ref_logps[:E])
    all_reduce_sum(totals, dp_group)
    return (totals[0] / totals[1]).clamp(min=0), ref_completions


def kto_losses(model, batch: dict, kl: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, dict]:
    """KTO losses [E] of one micro-batch of examples and its summed metrics (TRL's names), from
    batch["ref_logps"] [E] and z_ref `kl` of `kto_reference_point`."""
    E = batch["sample_ids"].numel()
    completions = {k: batch[k][:E] for k in ("input_ids", "labels")}  # the KL rows are not trained
    policy_logps = sequence_logprobs(model, completions, cfg)[0]  # [E]
    desirable = batch["desirable"]  # [E] bool
    losses, rewards = kto_loss(
        policy_logps, batch["ref_logps"], desirable, kl,
        cfg.beta, cfg.desirable_weight, cfg.undesirable_weight,
    )  # fmt: skip
    chosen, rejected = desirable.float(), (~desirable).float()
    logps = policy_logps.detach()
    sums = {
        "rewards/chosen": (rewards * chosen).sum(),
        "rewards/rejected": (rewards * rejected).sum(),
        "logps/chosen": (logps * chosen).sum(),
        "logps/rejected": (logps * rejected).sum(),
        "count/chosen": chosen.sum(),
        "count/rejected": rejected.sum(),
    }
    return losses, sums


def preference_losses(
    model, reference, ref_cache, batch: dict, cfg: Config, kl=None
) -> tuple[torch.Tensor, dict]:
    """One micro-batch's losses and summed metrics: `kto_losses` for kto (z_ref `kl`), else `pair_losses`."""
    if cfg.loss_type == "kto":
        return kto_losses(model, batch, kl, cfg)
    return pair_losses(model, reference, ref_cache, batch, cfg)


# === 6. Optimizer + LR schedule ===
def build_optimizer(cfg: Config, model: torch.nn.Module):
    """AdamW over trainable parameters (decay on matrices only) and a warmup + cosine schedule."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    # norms and biases (and DoRA's magnitudes): decay would only shrink them
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
def tokenize_sequence(
    prompt: list[dict], reply: list[dict], tokenizer: Tokenizer, max_seq_len: int
) -> dict:
    """Token ids and pre-shifted labels of prompt + reply; only the reply's assistant text is supervised.

    Masks by character position of the reply's assistant messages (end-of-turn token included),
    as the SFT recipe; assistant turns inside the prompt stay masked.

    Returns:
        {"input_ids": [S] list[int], "labels": [S] list[int]}, S <= max_seq_len.
    """
    text, spans = tokenizer.render_with_assistant_spans(prompt + reply)
    spans = spans[sum(m["role"] == "assistant" for m in prompt) :]  # the reply's spans only
    ids, offsets = tokenizer.encode_with_offsets(text)
    ids, offsets = ids[:max_seq_len], offsets[:max_seq_len]
    supervised = [any(s <= start < e for s, e in spans) for start, _ in offsets]
    labels = [ids[t + 1] if supervised[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)]
    return {"input_ids": ids, "labels": labels + [IGNORE_INDEX]}


def keep_supervised(
    items: list[dict], keys: tuple[str, ...], noun: str, source, cfg: Config
) -> list[dict]:
    """The items (pairs, examples) whose sequences under `keys` each keep a supervised token after
    truncation to max_seq_len; rank 0 says how many were dropped. Raises ValueError if none is left."""
    kept = [x for x in items if all(any(t != IGNORE_INDEX for t in x[k]["labels"]) for k in keys)]
    where = "in both replies" if len(keys) > 1 else f"in its {keys[0]}"
    if not kept:
        raise ValueError(
            f"{source}: no {noun} keeps a supervised token {where} after truncation to "
            f"max_seq_len={cfg.max_seq_len}; raise --max_seq_len"
        )
    if len(kept) < len(items) and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"{source}: {len(items) - len(kept)} of {len(items)} {noun}s dropped: their prompt leaves no reply "
            f"token within max_seq_len={cfg.max_seq_len} (raise --max_seq_len to keep them)"
        )
    return kept


def build_datasets(cfg: Config, tokenizer: Tokenizer) -> tuple[list[dict], list[dict]]:
    """Load preference rows, apply the chat template, tokenize and mask; split off a validation set."""
    source = resolve_data_path(cfg.dataset)
    pairs = []
    for i, row in enumerate(load_rows(source)):
        pref = to_preference(row, i, source)
        chosen = tokenize_sequence(pref["prompt"], pref["chosen"], tokenizer, cfg.max_seq_len)
        rejected = tokenize_sequence(pref["prompt"], pref["rejected"], tokenizer, cfg.max_seq_len)
        # "id" = row number in the file: logged per step as sample_ids, and the precomputed-cache key;
        # "prompt" = what the end-of-run sample asks
        pairs.append({"id": i, "prompt": pref["prompt"], "chosen": chosen, "rejected": rejected})
    kept = keep_supervised(pairs, ("chosen", "rejected"), "pair", source, cfg)
    return split_train_val(kept, cfg.val_fraction, cfg.seed)


def build_kto_datasets(cfg: Config, tokenizer: Tokenizer) -> tuple[list[dict], list[dict]]:
    """KTO's examples: each reply with its label and its KL sequence; split off a validation set.

    A row is one unpaired example, or a pair, which gives two (`to_unpaired`: chosen desirable,
    rejected undesirable); the pairs' chosen examples come first, then their rejected ones, as
    TRL's unpair_preference_dataset lays them out. An example's KL sequence is its prompt with the
    next example's completion (the last one's: the first's), a reply not written for it unless the
    two share their prompt (as in TRL): the policy / reference log-ratio of these estimates
    KL(pi || pi_ref), KTO's reference point. It is fixed here, so the precomputed reference can
    cache it with the example.

    Returns:
        (train, val): [{"id": example number, "prompt": [messages], "desirable": bool,
        "completion": {"input_ids", "labels"}, "kl": {"input_ids", "labels"}}, ...].
    """
    source = resolve_data_path(cfg.dataset)
    firsts, seconds = [], []  # unpaired rows and chosen replies; rejected replies
    for i, row in enumerate(load_rows(source)):
        first, *second = to_unpaired(row, i, source)
        firsts.append(first)
        seconds += second
    unpaired = firsts + seconds
    examples = []
    for i, ex in enumerate(unpaired):
        other = unpaired[(i + 1) % len(unpaired)]["completion"]
        examples.append({
            "id": i, "prompt": ex["prompt"], "desirable": ex["label"],
            "completion": tokenize_sequence(ex["prompt"], ex["completion"], tokenizer, cfg.max_seq_len),
            "kl": tokenize_sequence(ex["prompt"], other, tokenizer, cfg.max_seq_len),
        })  # fmt: skip
    # the KL sequence shares the prompt, so it keeps a reply token whenever the completion does
    kept = keep_supervised(examples, ("completion",), "example", source, cfg)
    return split_train_val(kept, cfg.val_fraction, cfg.seed)


def collate(
    pairs: list[dict], pad_token_id: int, pad_to: int = 0, pad_to_multiple_of: int = 1
) -> dict:
    """Right-pad P pairs into one batch, the P chosen sequences then their P rejected ones, S
    rounded up to a multiple of `pad_to_multiple_of`: input_ids [2P, S] int64 (pad_token_id on
    padding), labels [2P, S] int64 (IGNORE_INDEX on padding), num_tokens (scalar, non-padding
    input tokens), sample_ids [P] int64."""
    sequences = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    pad_values = {"input_ids": pad_token_id, "labels": IGNORE_INDEX}
    return pad_batch(
        sequences, pad_values, pad_to, pad_to_multiple_of, ids=[p["id"] for p in pairs]
    )


def collate_kto(
    examples: list[dict], pad_token_id: int, pad_to: int = 0, pad_to_multiple_of: int = 1
) -> dict:
    """Right-pad E KTO examples into one batch in the pairs' layout, their E completions then
    their E KL sequences: input_ids [2E, S], labels [2E, S] int64, num_tokens, sample_ids [E]
    int64, and desirable [E] bool (the labels)."""
    sequences = [e["completion"] for e in examples] + [e["kl"] for e in examples]
    pad_values = {"input_ids": pad_token_id, "labels": IGNORE_INDEX}
    batch = pad_batch(
        sequences, pad_values, pad_to, pad_to_multiple_of, ids=[e["id"] for e in examples]
    )
    batch["desirable"] = torch.tensor([e["desirable"] for e in examples], dtype=torch.bool)
    return batch


# === 8. train_step ===
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


def train_step(
    model,
    reference,
    ref_cache,
    optimizer,
    scheduler,
    micro_batches: list[dict],
    cfg: Config,
    device,
    dp_group=None,
) -> dict:
    """One optimizer step over `gradient_accumulation_steps` micro-batches of pairs (kto:
    examples).

    Every micro-batch's summed loss is divided by the pair (example) count of the whole step (all
    micro-batches and data-parallel ranks: all-reduced over `dp_group`, None = all ranks), so the
    gradient is that of the mean over all of them.
    KTO first scores the step's KL sequences (`kto_reference_point`): z_ref enters every example's
    loss, so it is one value for the whole step, whatever its split into micro-batches.

    Returns:
        loss (mean per pair or example), the rewards/* and logps/* means (TRL's names:
        `step_means`),
        kl (kto's z_ref), grad_norm (before clipping), lr, num_tokens (non-pad input tokens, all
        ranks), num_pairs (all ranks; kto: num_examples).
    """
    global_count = all_reduce_sum(
        torch.tensor(float(sum(len(mb["sample_ids"]) for mb in micro_batches)), device=device),
        dp_group,
    )
    global_inputs = all_reduce_sum(
        sum(mb["num_tokens"] for mb in micro_batches).to(device).float(), dp_group
    )
    kl = None
    if cfg.loss_type == "kto":  # z_ref first, and the reference's log-probs of the completions
        kl, ref_logps = kto_reference_point(
            model, reference, ref_cache, micro_batches, cfg, device, dp_group
        )
        micro_batches = [
            {**mb, "ref_logps": ref} for mb, ref in zip(micro_batches, ref_logps, strict=True)
        ]

    def loss_fn(mb: dict) -> tuple[torch.Tensor, dict]:
        batch = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
        losses, sums = preference_losses(model, reference, ref_cache, batch, cfg, kl)
        return losses.sum() / global_count, sums

    totals, grad_norm, lr = backward_and_step(
        model, optimizer, scheduler, micro_batches, loss_fn, cfg
    )
    sums = all_reduce_sum(torch.stack(list(totals.values())), dp_group)  # one collective
    metrics = {
        "sample_ids": torch.cat([mb["sample_ids"] for mb in micro_batches]).tolist(),  # this rank's
        **step_means(dict(zip(totals, sums, strict=True)), global_count, cfg),
        "grad_norm": grad_norm.item(),
        "lr": lr,
        "num_tokens": int(global_inputs.item()),
        "num_pairs": int(global_count.item()),
    }
    if cfg.loss_type == "kto":
        metrics["kl"] = kl.item()
        metrics["num_examples"] = metrics.pop("num_pairs")
    return metrics


def step_means(sums: dict[str, torch.Tensor], count: torch.Tensor, cfg: Config) -> dict[str, float]:
    """The step's summed metrics (all ranks) as TRL logs them: the loss (already a mean), the rest
    means over the step's `count` pairs; for kto each label's rewards and log-probs over that
    label's examples (left out when the step has none), their margin, and the counts."""
    if cfg.loss_type == "kto":
        means = {"loss": sums["loss"].item()}
        for side in ("chosen", "rejected"):
            n = sums[f"count/{side}"]
            means[f"count/{side}"] = int(n.item())
            if means[f"count/{side}"]:
                means[f"rewards/{side}"] = (sums[f"rewards/{side}"] / n).item()
                means[f"logps/{side}"] = (sums[f"logps/{side}"] / n).item()
        if "rewards/chosen" in means and "rewards/rejected" in means:
            means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]
        return means
    return {k: (v if k == "loss" else v / count).item() for k, v in sums.items()}


def step_figures(metrics: dict) -> str:
    """What the printed step line adds after the loss: the reward accuracy and margin, and kto's
    z_ref, those the step logged."""
    figures = (
        ("rewards/accuracies", "acc", ".2f"),
        ("rewards/margins", "margin", ".4f"),
        ("kl", "kl", ".4f"),
    )
    return "".join(
        f" | {name} {metrics[key]:{fmt}}" for key, name, fmt in figures if key in metrics
    )


@torch.no_grad()
def evaluate(
    model, reference, ref_cache, loader: DataLoader, cfg: Config, device, dp_group=None
) -> dict:
    """Validation loss and reward accuracy (pairs only), means over every (sharded) validation pair
    or example; kto's z_ref is each validation batch's own (TRL's per-batch estimate)."""
    model.eval()
    totals = torch.zeros(3, device=device)
    for mb in loader:
        batch = {k: v.to(device) for k, v in mb.items()}
        kl = None
        if cfg.loss_type == "kto":
            kl, ref_logps = kto_reference_point(
                model, reference, ref_cache, [batch], cfg, device, dp_group
            )
            batch["ref_logps"] = ref_logps[0]
        losses, sums = preference_losses(model, reference, ref_cache, batch, cfg, kl)
        correct = sums.get("rewards/accuracies", torch.zeros((), device=device))
        totals += torch.stack(
            [losses.sum(), correct, torch.tensor(float(losses.numel()), device=device)]
        )
    model.train()
    all_reduce_sum(totals, dp_group)
    n = totals[2].clamp(min=1)
    metrics = {"val_loss": (totals[0] / n).item()}
    if cfg.loss_type != "kto":
        metrics["val_rewards/accuracies"] = (totals[1] / n).item()
    return metrics


def save(
    model,
    tokenizer: Tokenizer,
    model_dir: Path,
    cfg: Config,
    record: dict,
    path: Path,
    is_main: bool,
) -> None:
    """The adapters in PEFT layout (adapter_config.json, adapter_model.safetensors: load them
    with `peft.PeftModel.from_pretrained(base, path)` or --resume_adapter), the tokenizer and
    `record`, the config the weights were trained with, as training_config.json; with
    save_merged also the merged model in HF layout (path / "merged")."""
    # the base named in adapter_config.json: the Hub id for a cached or downloaded base (the adapter then
    # loads on any machine), the directory itself for a local one passed as --model
    repo_id = hub_repo_id(cfg.model, cfg.hf_repo_id, Config.model, Config.hf_repo_id)
    base_id = base_model_id(cfg.model, model_dir, repo_id)
    save_adapter(model, path, base_model_name_or_path=base_id)  # gathers shards; rank 0 writes
    if is_main:
        copy_tokenizer_files(model_dir, path)
        (path / "training_config.json").write_text(json.dumps(record, indent=2))
    if cfg.save_merged:
        hf_config = read_hf_config(model_dir)
        # W + lora_scale * B A per adapted linear (DoRA: rescaled per row), one tensor at a time, in the base's dtype
        merged, dtype = merged_hf_tensors(model, hf_config), checkpoint_dtype(model_dir)
        save_hf_checkpoint(model, path / "merged", hf_config, dtype=dtype, tensors=merged)
        if is_main:
            copy_tokenizer_files(model_dir, path / "merged")


# === 9. main ===
def main(argv: list[str] | None = None) -> dict:
    """Train, evaluate, save the HF model and print a sample. Returns the final metrics."""
    cfg = parse_config(Config, argv)
    validate(cfg)
    dist_info, mesh = setup_distributed(cfg)
    is_main, device = dist_info.is_main, dist_info.device
    # data parallel = "dp" (dp_replicate x dp_shard): each dp rank reads its own shard of the pairs
    dp_rank, dp_size, dp_group = data_parallel(mesh)
    # an earlier run in out_dir: resume it, or refuse (never mix two runs' metrics or models)
    out_dir = claim_out_dir(cfg.out_dir, cfg.resume, cfg.overwrite, is_main)
    # the default hf_repo_id is the default model's: another --model needs its own (or a local copy)
    model_dir = resolve_model_dir(
        cfg.model, hub_repo_id(cfg.model, cfg.hf_repo_id, Config.model, Config.hf_repo_id)
    )
    tokenizer = Tokenizer.from_dir(model_dir)
    check_vocab_fits(tokenizer, model_dir)  # ids past the embedding table would fail mid-step
    # kto: unpaired examples (a pair gives two); the other losses: pairs
    what = "examples" if cfg.loss_type == "kto" else "pairs"
    train_set, val_set = (build_kto_datasets if cfg.loss_type == "kto" else build_datasets)(
        cfg, tokenizer
    )
    model = setup_model(cfg, model_dir, mesh, device)
    optimizer, scheduler = build_optimizer(cfg, model)
    pad_to = cfg.max_seq_len if cfg.pad_to_max_seq_len else 0
    collate_batch = collate_kto if cfg.loss_type == "kto" else collate
    collate_fn = functools.partial(
        collate_batch, pad_token_id=tokenizer.pad_token_id, pad_to=pad_to
    )
    # each dp rank reads a disjoint shard; training shuffles by (seed, epoch) and can resume part-way
    loader_args = (collate_fn, cfg.micro_batch_size, dp_rank, dp_size, cfg.seed)
    train_loader = build_dataloader(train_set, *loader_args, train=True, what=what)
    val_loader = build_dataloader(val_set, *loader_args, train=False, unsupervised_fill=False)
    resumed = resolve_resume(cfg.resume, out_dir / "checkpoints")  # the checkpoint, or None
    # simpo and orpo score the policy alone: no reference is built, loaded or precomputed
    ref_mode = "none" if cfg.loss_type in REFERENCE_FREE else cfg.ref_mode
    reference, ref_cache = None, None
    if ref_mode == "separate":
        reference = build_reference(cfg, model_dir, mesh, device)
    # precomputed: every pair (kto: example) scored once by the untrained policy, kept for a resume
    if ref_mode == "precomputed":
        ref_cache = load_reference_logprobs(
            out_dir / "reference_logps.pt", {k: getattr(cfg, k) for k in ("model", "dataset", "max_seq_len", "dtype", "loss_type")},
            resumed, is_main, model, train_set + val_set,
            functools.partial(base_logprobs, cfg=cfg, during_training=False), functools.partial(collate_batch, pad_token_id=tokenizer.pad_token_id),
            cfg.micro_batch_size, dp_rank, dp_size, device, dp_group,
        )  # fmt: skip
    global_batch = cfg.micro_batch_size * cfg.gradient_accumulation_steps * dp_size
    if is_main:
        print(run_summary(cfg, model, model_dir, dist_info.world_size, device, (
            f"loss: {cfg.loss_type} | reference: {ref_mode} | {len(train_set)} train / {len(val_set)} val {what} | "
            f"global batch {global_batch} {what} (<= {2 * global_batch * cfg.max_seq_len} tokens)"
        )))  # fmt: skip
    ckpt_dir = out_dir / "checkpoints"
    state = resume_training(
        cfg.resume, ckpt_dir, model, optimizer, scheduler, dataclasses.asdict(cfg), is_main
    )
    start_step = state.step
    logger = (
        MetricsLogger(out_dir, cfg.loggers, cfg, state.step, argv, state.config_changes)
        if is_main
        else None
    )
    batches = infinite_batches(train_loader, state.epoch, state.samples_consumed)
    progress = progress_bar(state.step, cfg.max_steps, is_main)  # on a terminal only
    metrics: dict = {}
    for step in progress:
        micro_batches = []
        for _ in range(cfg.gradient_accumulation_steps):
            (state.epoch, state.samples_consumed), micro_batch = next(batches)
            micro_batches.append(micro_batch)
        start = time.perf_counter()
        metrics = train_step(
            model, reference, ref_cache, optimizer, scheduler, micro_batches, cfg, device, dp_group
        )
        step_time = time.perf_counter() - start
        check_finite(step, metrics, state.path)  # NaN/inf: stop before saving anything of this step
        state.step = step
        metrics.update(
            step_time_s=step_time,
            tokens_per_s=metrics["num_tokens"] / step_time,
            peak_mem_mib=peak_memory_mib(device),
        )
        is_last = step == cfg.max_steps
        if (cfg.eval_every_steps and step % cfg.eval_every_steps == 0) or (is_last and val_set):
            metrics.update(evaluate(model, reference, ref_cache, val_loader, cfg, device, dp_group))
        if is_main and (step % cfg.log_every_steps == 0 or is_last or "val_loss" in metrics):
            logger.log(metrics, step)
            progress.set_postfix(loss=round(metrics["loss"], 4))
            progress.write(step_line(step, metrics, step_figures(metrics)))
        if cfg.save_every_steps and (step % cfg.save_every_steps == 0 or is_last):
            config = dataclasses.asdict(cfg)
            state.path = save_train_state(
                ckpt_dir, state, model, optimizer, scheduler, config, cfg.keep_last_checkpoints
            )
    # what training_config.json records; None: this run trained no step and the saved model stays
    record = final_model_config(dataclasses.asdict(cfg), state, start_step, out_dir / "model")
    if record is not None:
        save(model, tokenizer, model_dir, cfg, record, out_dir / "model", is_main)
    if cfg.sample_max_new_tokens:  # a question from the run's own data unless --sample_prompt
        prompt = cfg.sample_prompt or (val_set or train_set)[0]["prompt"]
        reply = sample(model, tokenizer, prompt, cfg.sample_max_new_tokens)
        if is_main:
            print(f"\nsample | user: {last_user_message(prompt)}\n       | assistant: {reply}")
    if logger:
        logger.close()
    del model, reference, optimizer, scheduler  # free FSDP state before the process group goes away
    destroy_distributed()
    return metrics


if __name__ == "__main__":
    # one-line errors (SCAFFOLD_DEBUG=1 for the traceback), printed once, with exit code 1
    entry_point(main)
