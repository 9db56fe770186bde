"""The bad-input corpus: each case is one wrong input and the one-line error it must produce.

A case runs either the `scaffold` CLI or an emitted script (examples/<recipe>/train.py, by default
the SFT one, on a tiny random Llama with SmolLM2's tokenizer) and expects a non-zero exit status, no traceback, and
one error line matching every regex in `expect` (it must name the file / row / key / option and
what was expected).

Placeholders in `argv`, `files` (text) and `expect`, replaced per case:
    {tmp}    the case's own empty directory (its files are written there; it is the cwd)
    {model}  the model directory: the tiny model, or the case's `model` variant of it
    {data}   a small valid dataset (8 alpaca rows)
In `expect` they are regex-escaped. Script cases get `SCRIPT_ARGS` (a fast 1-step CPU run on
`{model}` and `{data}`) before their own `argv`; later flags win, so a case overrides by repeating.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# GRPO's fields differ (no max_seq_len / eval): its cases fail before Ray starts
GRPO_ARGS = (
    "--model", "{model}", "--out_dir", "{tmp}/out", "--device", "cpu", "--dtype", "fp32",
    "--max_steps", "1", "--warmup_steps", "0", "--max_new_tokens", "4", "--num_generations", "2",
)  # fmt: skip
SCRIPT_ARGS = (
    "--model", "{model}", "--dataset", "{data}", "--out_dir", "{tmp}/out", "--device", "cpu",
    "--dtype", "fp32", "--max_steps", "1", "--warmup_steps", "0", "--max_seq_len", "64",
    "--micro_batch_size", "2", "--eval_every_steps", "0", "--val_fraction", "0",
    "--sample_max_new_tokens", "0",
)  # fmt: skip
# the reward-model script has no end-of-run sample (a scorer does not generate)
RM_ARGS = SCRIPT_ARGS[: SCRIPT_ARGS.index("--sample_max_new_tokens")]

GOOD_ROWS = [{"instruction": f"Say the number {i}.", "output": f"{i}"} for i in range(8)]


@dataclass(frozen=True)
class ModelVariant:
    """A copy of the tiny model directory with one thing broken.

    config: keys to set in config.json (None deletes the key); config_text replaces the file.
    drop: tensor names removed from model.safetensors; add: {name: shape} zero tensors added;
    reshape: {name: shape} tensors replaced by zeros of that shape; truncate_weights: keep only
    this many bytes of model.safetensors; remove: files deleted.
    """

    config: dict = field(default_factory=dict)
    config_text: str | None = None
    drop: tuple[str, ...] = ()
    add: dict = field(default_factory=dict)
    reshape: dict = field(default_factory=dict)
    truncate_weights: int | None = None
    remove: tuple[str, ...] = ()

    def build(self, base: Path, dst: Path) -> Path:
        import torch
        from safetensors.torch import load_file, save_file

        shutil.copytree(base, dst)
        weights = dst / "model.safetensors"
        if self.drop or self.add or self.reshape:
            tensors = load_file(weights)
            for name in self.drop:
                del tensors[name]
            for name, shape in {**self.add, **self.reshape}.items():
                tensors[name] = torch.zeros(shape)
            save_file(tensors, weights, metadata={"format": "pt"})
        if self.truncate_weights is not None:
            weights.write_bytes(weights.read_bytes()[: self.truncate_weights])
        config_path = dst / "config.json"
        if self.config:
            cfg = json.loads(config_path.read_text())
            for key, value in self.config.items():
                if value is None:
                    cfg.pop(key, None)
                else:
                    cfg[key] = value
            config_path.write_text(json.dumps(cfg, indent=2))
        if self.config_text is not None:
            config_path.write_text(self.config_text)
        for name in self.remove:
            (dst / name).unlink()
        return dst


def vocab_256(base: Path, dst: Path) -> Path:
    """The tiny model cut to vocab_size=256 while keeping its 512-token tokenizer."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, dst)
    tensors = load_file(dst / "model.safetensors")
    key = "model.embed_tokens.weight"
    tensors[key] = tensors[key][:256].clone()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "vocab_size": 256}, indent=2))
    return dst


def teacher_with_other_tokenizer(base: Path, dst: Path) -> Path:
    """{model} = the tiny model; {model}-teacher = a copy whose tokenizer has one extra token."""
    shutil.copytree(base, dst)
    teacher = dst.parent / f"{dst.name}-teacher"
    shutil.copytree(base, teacher)
    tok = json.loads((teacher / "tokenizer.json").read_text())
    tok["added_tokens"].append({
        "id": len(tok["model"]["vocab"]), "content": "<|teacher_only|>", "single_word": False, "lstrip": False,
        "rstrip": False, "normalized": False, "special": True,
    })  # fmt: skip
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    return dst


PAIR = {"prompt": "Say hi.", "chosen": "Hi!", "rejected": "No."}
KTO_ROW = {"prompt": "Say hi.", "completion": "Hi!", "label": True}  # TRL's unpaired layout


def parquet(rows: list[dict]) -> Callable[[], bytes]:
    def build() -> bytes:
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buffer)
        return buffer.getvalue()

    return build


def jsonl(rows: list) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


@dataclass(frozen=True)
class Case:
    """One bad input and the error it must produce.

    tool: "scaffold" (the CLI) or "script" (the emitted train.py).
    argv: the arguments (script cases: after SCRIPT_ARGS, or after `pre` when given).
    expect: regexes, each must match the error line.
    files: {relative path: text, bytes, or a function returning bytes} written into {tmp}.
    model: a ModelVariant or function(base, dst) giving this case's {model}.
    pre: script arguments placed first (an overrides file must come first).
    patch: a failure simulated inside the process (see runner._patches).
    absent: globs (relative to {tmp}) that must not exist afterwards.
    read_only: directories (relative to {tmp}) created with mode 0o555.
    recipe: script cases: the example directory whose train.py runs (examples/<recipe>).
    script_args: script cases: replaces SCRIPT_ARGS (recipes with other config fields: GRPO).
    when: "no_cuda" (skip on a CUDA machine); "no_vllm" (skip where vllm imports); "not_root" / "root": a chmod-555 directory stops
        only non-root users, so as root the read-only case writes under /sys instead.
    """

    id: str
    tool: str
    argv: tuple[str, ...]
    expect: tuple[str, ...]
    files: dict = field(default_factory=dict)
    model: ModelVariant | Callable | None = None
    pre: tuple[str, ...] = ()
    patch: str | None = None
    absent: tuple[str, ...] = ()
    read_only: tuple[str, ...] = ()
    when: str | None = None
    recipe: str = "sft_smollm2"  # script cases: the example whose train.py runs
    script_args: tuple[str, ...] | None = None  # None = SCRIPT_ARGS


def scaffold(id, argv, *expect, **kw) -> Case:
    return Case(id, "scaffold", tuple(argv), expect, **kw)


def script(id, argv, *expect, **kw) -> Case:
    return Case(id, "script", tuple(argv), expect, **kw)


# a run directory as `scaffold new` leaves it (the smallest one regen accepts), and the state a
# conflicted regen of it leaves: marked train.py, staged spec, manifest (generator/regen.py)
RUN_DIR = {
    "run/.scaffold/spec.json": json.dumps({"spec": {"out": "run"}}),
    "run/.scaffold/train.py.base": "x = 1\n",
    "run/train.py": "x = 1\n",
}
PENDING_REGEN = {
    "run/train.py": "y = 0\n<<<<<<< yours\nx = 2\n||||||| base (last render)\nx = 1\n=======\n"
    "x = 3\n>>>>>>> new render\n",
    "run/train.py.orig": "y = 0\nx = 2\n",
    "run/.scaffold/pending/before/train.py": "y = 0\nx = 2\n",
    "run/.scaffold/pending/spec.json": json.dumps({"spec": {"out": "run", "dtype": "fp32"}}),
    "run/.scaffold/pending/regen.json": json.dumps(
        {
            "changes": "dtype: 'bf16' -> 'fp32'",
            "conflicted": ["train.py"],
            "created_dirs": [],
            "written": {
                "train.py": {"existed": True, "mode": 0o644},
                "train.py.orig": {"existed": False, "mode": None},
            },
        }
    ),
}
GPT2 = ModelVariant(config={"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
LONG_PROMPT = "Please read this long question carefully before answering it. " * 8

CASES = [
    # --- scaffold new / regen / diff: options, specs, models -------------------------------------
    scaffold("new-unknown-algo", ["new", "--algo", "reinforce", "--out", "{tmp}/o"],
             r"unknown algorithm 'reinforce'", r"valid: sft"),
    scaffold("new-unknown-model", ["new", "--model", "gpt-5", "--out", "{tmp}/o"],
             r"unknown model 'gpt-5'", r"smollm2-135m", r"qwen3-8b", r"config\.json"),
    scaffold("new-unknown-trick", ["new", "--tricks", "ac,flash", "--out", "{tmp}/o"],
             r"unknown trick\(s\) \[.flash.\]",
             r"valid: packing, ac, offload, compile, lce, optim-in-bwd, adamw8bit, adamw4bit"),
    scaffold("new-trick-twice", ["new", "--tricks", "ac,lce,ac", "--out", "{tmp}/o"],
             r"--tricks lists a trick twice: \['ac', 'lce', 'ac'\]"),
    scaffold("new-unknown-dtype", ["new", "--dtype", "fp16", "--out", "{tmp}/o"],
             r"--dtype 'fp16'", r"valid: bf16, fp32"),
    scaffold("new-zero-gpus", ["new", "--gpus", "0", "--out", "{tmp}/o"],
             r"--gpus 0", r"must both be >= 1"),
    scaffold("new-gpus-not-int", ["new", "--gpus", "two", "--out", "{tmp}/o"],
             r"--gpus", r"'two' is not a valid integer"),
    scaffold("new-empty-dataset", ["new", "--dataset", " ", "--out", "{tmp}/o"],
             r"--dataset is empty", r"\.jsonl"),
    scaffold("plan-unknown-gpu", ["plan", "--gpu-memory", "a100-99"],
             r"--gpu-memory 'a100-99'", r"valid names: .*a100-40 \(40 GiB\).*h200-141"),
    scaffold("plan-zero-gpu-memory", ["plan", "--gpu-memory", "0"],
             r"--gpu-memory '0'", r"must be a number of GiB > 0"),
    scaffold("plan-negative-gpu-memory", ["plan", "--gpu-memory", "-8"],
             r"--gpu-memory '-8'", r"must be a number of GiB > 0"),
    scaffold("plan-cannot-simulate-compile", ["plan", "--tricks", "compile"],
             r"cannot simulate --tricks compile", r"inductor", r"plan without it \(no --tricks\)"),
    scaffold("plan-tp-does-not-divide-heads", ["plan", "--gpus", "4", "--tp", "4"],
             r"--tp 4", r"num_attention_heads=9", r"pick tp in \{1, 3\}"),
    scaffold("plan-zero-seq-len", ["plan", "--max-seq-len", "0"],
             r"--max-seq-len 0", r">= 1"),
    scaffold("new-model-unsupported-arch", ["new", "--model", "{model}", "--out", "{tmp}/o"],
             r"--model {model}", r"{model}/config\.json", r"model_type='gpt2'",
             r"'llama' / LlamaForCausalLM", r"'qwen3' / Qwen3ForCausalLM",
             model=GPT2),
    scaffold("new-model-config-not-json", ["new", "--model", "{model}", "--out", "{tmp}/o"],
             r"{model}/config\.json", r"not valid JSON|Expecting",
             model=ModelVariant(config_text='{"model_type": "llama",')),
    scaffold("new-model-dir-without-config", ["new", "--model", "{model}", "--out", "{tmp}/o"],
             r"unknown model '{model}'", r"local Hugging Face directory containing config\.json",
             model=ModelVariant(remove=("config.json",))),
    scaffold("new-existing-script", ["new", "--out", "{tmp}"],
             r"{tmp}/train\.py exists", r"scaffold regen", r"--force",
             files={"train.py": "print('my edits')\n"}),
    scaffold("new-out-is-a-file", ["new", "--out", "{tmp}/taken"],
             r"--out", r"{tmp}/taken", r"is a file", files={"taken": "x"}),
    scaffold("new-out-under-a-file", ["new", "--out", "{tmp}/taken/run"],
             r"--out {tmp}/taken/run: cannot write there", r"Not a directory: {tmp}/taken/run",
             files={"taken": "x"}),
    scaffold("regen-without-spec", ["regen", "{tmp}"],
             r"{tmp}/\.scaffold/spec\.json", r"scaffold new", files={"train.py": "x = 1\n"}),
    scaffold("regen-corrupt-spec", ["regen", "{tmp}"],
             r"{tmp}/\.scaffold/spec\.json: not a scaffold spec", r"scaffold new",
             files={"train.py": "x = 1\n", ".scaffold/spec.json": '{"spec": {"algo": "sft"',
                    ".scaffold/train.py.base": "x = 1\n"}),
    scaffold("regen-spec-unknown-key", ["regen", "--check", "{tmp}"],
             r"spec\.json: unknown spec keys \['lora'\]", r"valid keys",
             files={".scaffold/spec.json": json.dumps({"spec": {"algo": "sft", "lora": True}})}),
    scaffold("regen-check-no-specs", ["regen", "--check", "{tmp}"],
             r"no \.scaffold/spec\.json under {tmp}"),
    scaffold("regen-set-unknown-key", ["regen", "{tmp}/run", "--set", "lr=1e-4"],
             r"--set: unknown key 'lr'", r"valid keys: .*tricks",
             files={"run/.scaffold/spec.json": json.dumps({"spec": {"out": "run"}}),
                    "run/.scaffold/train.py.base": "x = 1\n", "run/train.py": "x = 1\n"}),
    scaffold("regen-abort-nothing-pending", ["regen", "{tmp}/run", "--abort"],
             r"--abort: no regen in progress in {tmp}/run \(nothing to abort\)", files=RUN_DIR),
    scaffold("regen-continue-markers-left", ["regen", "{tmp}/run", "--continue"],
             r"--continue: {tmp}/run/train\.py:2: conflict marker left \(and 3 more",
             r"delete the markers", r"--abort", files={**RUN_DIR, **PENDING_REGEN}),
    scaffold("regen-while-pending", ["regen", "{tmp}/run", "--set", "gpus=2"],
             r"{tmp}/run has a regen in progress \(dtype: 'bf16' -> 'fp32'\)",
             r"train\.py still has conflict markers at line\(s\) 2, 4, 6, 8",
             r"scaffold regen {tmp}/run --continue", r"scaffold regen {tmp}/run --abort",
             files={**RUN_DIR, **PENDING_REGEN}),
    scaffold("regen-pending-manifest-corrupt", ["regen", "{tmp}/run", "--abort"],
             r"{tmp}/run/\.scaffold/pending/regen\.json: not a pending regen's manifest",
             r"delete {tmp}/run/\.scaffold/pending",
             files={**RUN_DIR, "run/.scaffold/pending/regen.json": '{"changes": '}),
    scaffold("plan-dir-without-spec", ["plan", "{tmp}"],
             r"scaffold plan {tmp}: {tmp}/\.scaffold/spec\.json is missing",
             r"not a directory `scaffold new` wrote", files={"train.py": "x = 1\n"}),
    scaffold("plan-dir-with-spec-option", ["plan", "{tmp}/run", "--tricks", "lce", "--gpus", "2"],
             r"--tricks, --gpus given with DIR",
             r"plans the spec recorded in {tmp}/run/\.scaffold/spec\.json",
             r"scaffold regen {tmp}/run --set", files=RUN_DIR),
    scaffold("plan-dir-while-pending", ["plan", "{tmp}/run"],
             r"{tmp}/run has a regen in progress", r"--continue", r"--abort",
             files={**RUN_DIR, **PENDING_REGEN}),
    scaffold("diff-one-spec", ["diff", "--spec", "{tmp}"],
             r"--spec compares two renders: give exactly two --spec"),
    # --- train.py overrides: keys, types, files --------------------------------------------------
    script("override-unknown-key", ["--lrr", "1e-4"],
           r"unknown config key 'lrr'; did you mean --lr\?"),
    script("override-unknown-key-far", ["--frobnicate", "1"],
           r"unknown config key 'frobnicate'", r"valid keys: model, hf_repo_id, dataset"),
    script("override-float-not-number", ["--lr", "abc"], r"--lr: expected float, got 'abc'"),
    script("override-int-fraction", ["--max_steps", "1.5"],
           r"--max_steps: expected int, got '1\.5'"),
    script("override-bool-word", ["--pad_to_max_seq_len", "maybe"],
           r"--pad_to_max_seq_len: expected bool, got 'maybe'"),
    script("override-missing-value", ["--lr"], r"--lr needs a value \(field type float\)"),
    script("override-value-is-next-flag", ["--lr", "--max_steps", "3"],
           r"--lr needs a value \(field type float\), got the next flag --max_steps"),
    # checked in validate(), before the model loads (was a traceback at the first log line)
    script("loggers-wandb-not-installed", ["--loggers", "jsonl,wandb"],
           r"loggers includes 'wandb' but wandb is not installed: pip install wandb"),
    script("loggers-unknown", ["--loggers", "mlflow"], r"loggers: unknown \['mlflow'\]"),
    script("betas-one-float", ["--betas", "0.9"], r"invalid config: betas=\[0\.9\]: AdamW's two floats"),
    script("override-stray-argument", ["--lr", "1e-4", "5e-5"],
           r"unexpected argument '5e-5'", r"--key value"),
    script("overrides-file-bad-key", [],
           r"{tmp}/overrides\.yaml: unknown config key 'learning_rate'; did you mean --lr\?",
           pre=("{tmp}/overrides.yaml",), files={"overrides.yaml": "learning_rate: 1.0e-4\n"}),
    script("overrides-file-bad-type", [], r"{tmp}/o\.json: --max_steps: expected int, got 'ten'",
           pre=("{tmp}/o.json",), files={"o.json": '{"max_steps": "ten"}'}),
    script("overrides-yaml-invalid", [], r"{tmp}/o\.yaml: cannot parse overrides \(\w*Error:",
           r"line 2", pre=("{tmp}/o.yaml",), files={"o.yaml": "lr: 1e-4\n  max_steps: [\n"}),
    script("overrides-file-not-json", [], r"{tmp}/overrides\.json: cannot parse overrides",
           r"line 1 column", pre=("{tmp}/overrides.json",), files={"overrides.json": '{"lr": '}),
    script("overrides-file-list", [], r"{tmp}/o\.json: expected a mapping of config keys",
           r"got list", pre=("{tmp}/o.json",), files={"o.json": "[1, 2]"}),
    script("overrides-file-missing", [], r"overrides file '{tmp}/nope\.yaml' not found",
           pre=("{tmp}/nope.yaml",)),
    # --- train.py config values (validate) -------------------------------------------------------
    script("micro-batch-zero", ["--micro_batch_size", "0"], r"micro_batch_size=0: must be >= 1"),
    script("micro-batch-negative", ["--micro_batch_size", "-4"],
           r"micro_batch_size=-4: must be >= 1"),
    script("warmup-negative", ["--warmup_steps", "-1"], r"warmup_steps=-1: must be >= 0"),
    script("several-bad-values", ["--dtype", "fp16", "--val_fraction", "1.5"],
           r"dtype='fp16': choose one of \['bf16', 'fp32'\]",
           r"val_fraction=1\.5: must be in \[0, 1\)"),
    script("device-cuda-without-cuda", ["--device", "cuda"],
           r"device='cuda'", r"no CUDA device", r"--device cpu", when="no_cuda"),
    script("device-unknown", ["--device", "tpu"], r"device='tpu': choose auto, cuda or cpu"),
    script("max-seq-len-beyond-model", ["--max_seq_len", "100000"],
           r"max_seq_len=100000", r"max_position_embeddings=8192", r"--max_seq_len"),
    # --- train.py data ---------------------------------------------------------------------------
    script("jsonl-malformed-line", ["--dataset", "{tmp}/train.jsonl"],
           r"{tmp}/train\.jsonl:3: invalid JSON", r"one complete JSON object",
           files={"train.jsonl": jsonl(GOOD_ROWS[:2]) + '{"instruction": "x", "output": \n'}),
    script("json-truncated", ["--dataset", "{tmp}/train.json"],
           r"{tmp}/train\.json:1:\d+: invalid JSON",
           files={"train.json": json.dumps(GOOD_ROWS)[:-30]}),
    script("jsonl-row-not-object", ["--dataset", "{tmp}/train.jsonl"],
           r"{tmp}/train\.jsonl:2: expected a JSON object, got list",
           files={"train.jsonl": jsonl([GOOD_ROWS[0], ["a", "b"]])}),
    script("json-object-not-list", ["--dataset", "{tmp}/train.json"],
           r"{tmp}/train\.json: expected a JSON list of row objects", r"keys \['data'\]",
           files={"train.json": json.dumps({"data": GOOD_ROWS})}),
    script("missing-column", ["--dataset", "{tmp}/train.jsonl"],
           r"{tmp}/train\.jsonl row 1: expected one of the columns", r"'instruction'\+'output'",
           r"'messages'", r"found: \['answer', 'question'\]",
           files={"train.jsonl": jsonl([GOOD_ROWS[0], {"question": "q", "answer": "a"}])}),
    script("misnamed-message-keys", ["--dataset", "{tmp}/train.jsonl"],
           r"{tmp}/train\.jsonl row 0: messages\[1\] must have `role` and `content`",
           r"found: \['role', 'text'\]",
           files={"train.jsonl": jsonl([{"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "text": "hello"}]}])}),
    script("unknown-role", ["--dataset", "{tmp}/train.jsonl"],
           r"{tmp}/train\.jsonl row 0: messages\[0\]\.role is 'customer'", r"known roles",
           files={"train.jsonl": jsonl([{"messages": [{"role": "customer", "content": "hi"},
                                                      {"role": "assistant", "content": "yo"}]}])}),
    script("content-not-string", ["--dataset", "{tmp}/train.jsonl"],
           r"row 0: messages\[1\]\.content must be a string, got int",
           files={"train.jsonl": jsonl([{"messages": [{"role": "user", "content": "1+1?"},
                                                      {"role": "assistant", "content": 2}]}])}),
    script("no-assistant-turn", ["--dataset", "{tmp}/train.jsonl"],
           r"{tmp}/train\.jsonl row 2: no assistant message",
           files={"train.jsonl": jsonl([*GOOD_ROWS[:2], {"conversations": [
               {"from": "human", "value": "hi"}]}])}),
    script("empty-jsonl", ["--dataset", "{tmp}/train.jsonl"], r"{tmp}/train\.jsonl: no rows",
           files={"train.jsonl": "\n\n"}),
    script("empty-json-list", ["--dataset", "{tmp}/train.json"], r"{tmp}/train\.json: no rows",
           files={"train.json": "[]"}),
    script("all-replies-empty", ["--dataset", "{tmp}/train.jsonl"],
           r"{tmp}/train\.jsonl row 0: every assistant reply is empty",
           files={"train.jsonl": jsonl([{"instruction": "hi", "output": ""}] * 4)}),
    script("all-truncated-away", ["--dataset", "{tmp}/train.jsonl", "--max_seq_len", "32"],
           r"{tmp}/train\.jsonl: no example has a supervised token", r"max_seq_len=32",
           files={"train.jsonl": jsonl([{"instruction": LONG_PROMPT, "output": "ok"}] * 4)}),
    script("non-utf8", ["--dataset", "{tmp}/train.jsonl"],
           r"{tmp}/train\.jsonl: not valid UTF-8 at byte offset 72", r"line 2", r"iconv",
           files={"train.jsonl": jsonl(GOOD_ROWS[:1]).encode()
                  + b'{"instruction": "caf\xe9", "output": "x"}\n'}),
    script("dataset-not-found", ["--dataset", "missing.jsonl"],
           r"dataset 'missing\.jsonl'", r"{tmp}/missing\.jsonl", r"data/missing\.jsonl"),
    script("dataset-unsupported-suffix", ["--dataset", "{tmp}/train.csv"],
           r"{tmp}/train\.csv: unsupported file type '\.csv'", files={"train.csv": "a,b\n1,2\n"}),
    script("parquet-wrong-schema", ["--dataset", "{tmp}/train.parquet"],
           r"{tmp}/train\.parquet row 0: expected one of the columns", r"found: \['id', 'text'\]",
           files={"train.parquet": parquet([{"id": 1, "text": "hello"}])}),
    script("parquet-corrupt", ["--dataset", "{tmp}/train.parquet"],
           r"{tmp}/train\.parquet: could not read as Parquet", files={"train.parquet": b"PAR1xx"}),
    script("micro-batch-beyond-dataset", ["--micro_batch_size", "16"],
           r"8 training examples give no full micro-batch of 16", r"--micro_batch_size"),
    # --- train.py model directory, tokenizer, checkpoint -----------------------------------------
    script("vocab-mismatch", [], r"tokenizer", r"has 512 tokens", r"vocab_size=256", r"{model}",
           model=vocab_256),
    script("checkpoint-missing-key", [],
           r"{model}/model\.safetensors",
           r"missing keys \['model\.layers\.1\.post_attention_layernorm\.weight'\]",
           model=ModelVariant(drop=("model.layers.1.post_attention_layernorm.weight",))),
    script("checkpoint-extra-key", [],
           r"{model}/model\.safetensors",
           r"unexpected keys \['model\.layers\.2\.mlp\.up_proj\.weight'\]",
           model=ModelVariant(add={"model.layers.2.mlp.up_proj.weight": (128, 64)})),
    script("checkpoint-wrong-shape", [],
           r"{model}/model\.safetensors",
           r"model\.layers\.0\.mlp\.up_proj\.weight: file \[96, 64\] vs model \[128, 64\]",
           model=ModelVariant(reshape={"model.layers.0.mlp.up_proj.weight": (96, 64)})),
    script("checkpoint-truncated", [], r"{model}/model\.safetensors: not a valid safetensors file",
           r"incomplete", model=ModelVariant(truncate_weights=100_000)),
    script("checkpoint-no-weights", [],
           r"no model\.safetensors or model\.safetensors\.index\.json in {model}",
           model=ModelVariant(remove=("model.safetensors",))),
    script("config-unsupported-arch", [], r"{model}/config\.json", r"model_type='gpt2'",
           r"'llama' / LlamaForCausalLM",
           model=GPT2),
    script("config-not-json", [], r"{model}/config\.json is not valid JSON",
           model=ModelVariant(config_text="{'model_type': 'llama'}")),
    script("config-missing-field", [],
           r"{model}/config\.json: missing required llama fields \['hidden_size'\]",
           model=ModelVariant(config={"hidden_size": None})),
    script("model-dir-without-config", [], r"--model '{model}': no config\.json found",
           r"looked at {model}", r"--model",
           model=ModelVariant(remove=("config.json",))),
    # another catalog name: the default hf_repo_id is smollm2-135m's, so it must not be downloaded
    script("model-other-name-not-the-default-repo", ["--model", "smollm2-360m"],
           r"--model 'smollm2-360m': no config\.json found \(looked at smollm2-360m, [^)]*smollm2-360m\)\.",
           r"its Hub id with --hf_repo_id"),
    script("tokenizer-missing", [], r"{model}/tokenizer\.json not found",
           model=ModelVariant(remove=("tokenizer.json",))),
    script("model-context-too-short", [],
           r"max_seq_len=64 exceeds the model's max_position_embeddings=32",
           model=ModelVariant(config={"max_position_embeddings": 32})),
    # --- train.py output directory and saving ----------------------------------------------------
    script("out-dir-is-a-file", ["--out_dir", "{tmp}/taken"], r"out_dir", r"{tmp}/taken",
           files={"taken": "x"}),
    script("out-dir-under-a-file", ["--out_dir", "{tmp}/taken/run"], r"out_dir", r"{tmp}/taken/run",
           files={"taken": "x"}),
    script("out-dir-read-only", ["--out_dir", "{tmp}/ro/run"], r"out_dir", r"{tmp}/ro/run",
           r"[Pp]ermission denied", read_only=("ro",), when="not_root"),
    script("out-dir-read-only-root", ["--out_dir", "/sys/scaffold-bad-input/run"], r"out_dir",
           r"/sys/scaffold-bad-input/run", when="root"),
    script("out-dir-holds-an-earlier-run", ["--out_dir", "{tmp}/used"],
           r"out_dir {tmp}/used holds an earlier run \(metrics\.jsonl\) and no complete checkpoint",
           r"pass --out_dir with a new directory, or --overwrite",
           files={"used/metrics.jsonl": '{"step": 1, "loss": 2.0}\n'}),
    script("out-dir-overwrite-with-a-resume-path", ["--overwrite", "--resume", "{tmp}/ckpt"],
           r"overwrite=True starts a fresh run, but resume='{tmp}/ckpt' asks to continue one"),
    script("disk-full-final-save", [], r"could not save the checkpoint to {tmp}/out/model",
           r"No space left on device", patch="save_file_enospc",
           absent=("out/model", "out/.model.tmp-*")),
    script("disk-full-safetensors-error", [], r"could not save the checkpoint to {tmp}/out/model",
           r"No space left on device", patch="save_file_safetensors_enospc",
           absent=("out/model", "out/.model.tmp-*")),
    script("disk-full-on-rename", [], r"could not save the checkpoint to {tmp}/out/model",
           r"No space left on device", patch="replace_enospc",
           absent=("out/model", "out/.model.tmp-*")),
    script("disk-full-train-state", ["--save_every_steps", "1"],
           r"saving checkpoint {tmp}/out/checkpoints/step_000001 failed",
           r"No space left on device", r"nothing was overwritten", patch="dcp_save_enospc",
           absent=("out/checkpoints/step_000001*",)),
    # --- resume ------------------------------------------------------------------------------------
    script("resume-missing-dir", ["--resume", "{tmp}/nope"],
           r"resume='{tmp}/nope': no such checkpoint directory", r"auto, none"),
    script("resume-incomplete-checkpoint", ["--resume", "{tmp}/ckpt/step_000002"],
           r"{tmp}/ckpt/step_000002/COMPLETE is missing", r"not finished",
           files={"ckpt/step_000002/trainer_state.json": "{}"}),
    script("keep-last-checkpoints-zero", ["--keep_last_checkpoints", "0"],
           r"keep_last_checkpoints=0: must be >= 1"),
    # --- DPO and distillation ----------------------------------------------------------------------
    scaffold("new-qlora-with-tp", ["new", "--algo", "qlora", "--model", "qwen3-0.6b", "--tp", "2", "--gpus", "2", "--out", "{tmp}/o"],
             r"--algo qlora with --tp 2: torchao 0\.18's NF4Tensor splits only along dim 0", r"use --tp 1"),
    script("dpo-missing-rejected", ["--dataset", "{tmp}/pairs.json"],
           r"{tmp}/pairs\.json row 1: missing key `rejected`", r"found: \['chosen', 'prompt'\]",
           files={"pairs.json": json.dumps([PAIR, {"prompt": "Hi", "chosen": "Hello"}])},
           recipe="dpo_smollm2"),
    script("dpo-unpaired-rows-with-a-pair-loss", ["--dataset", "{tmp}/kto.json"],
           r"{tmp}/kto\.json row 0: missing key `chosen`",
           r"this row is an unpaired \(KTO\) one, which --loss_type kto reads",
           files={"kto.json": json.dumps([{"prompt": "Hi", "completion": "Hello", "label": True}])},
           recipe="dpo_smollm2"),
    script("dpo-chosen-not-message", ["--dataset", "{tmp}/pairs.json"],
           r"{tmp}/pairs\.json row 0: `chosen` must be a string or a message list, got int",
           files={"pairs.json": json.dumps([{**PAIR, "chosen": 3}])}, recipe="dpo_smollm2"),
    script("dpo-adapters-off-full-parameters", ["--ref_mode", "adapters-off"],
           r"ref_mode='adapters-off'", r"trains all parameters", r"--algo dpo-lora",
           r"--ref_mode separate or precomputed", recipe="dpo_smollm2"),
    script("dpo-unknown-loss-type", ["--loss_type", "dpop"], r"loss_type='dpop': choose one of",
           r"\('sigmoid', 'ipo', 'simpo', 'orpo', 'kto'\)", recipe="dpo_smollm2"),
    script("simpo-with-ref-mode", ["--loss_type", "simpo", "--ref_mode", "precomputed"],
           r"ref_mode='precomputed' with loss_type='simpo'", r"uses no reference model",
           r"drop --ref_mode", recipe="dpo_smollm2"),
    script("orpo-with-beta", ["--loss_type", "orpo", "--beta", "0.2"],
           r"beta=0\.2 with loss_type='orpo'", r"orpo_lambda", recipe="dpo_smollm2"),
    script("sigmoid-with-simpo-gamma", ["--simpo_gamma", "1.0"],
           r"simpo_gamma=1\.0 applies to loss_type='simpo' only", r"this run's is 'sigmoid'",
           recipe="dpo_smollm2"),
    script("kto-label-not-bool", ["--loss_type", "kto", "--dataset", "{tmp}/kto.jsonl"],
           r"{tmp}/kto\.jsonl row 1: `label` must be true \(desirable\) or false", r"got str 'yes'",
           files={"kto.jsonl": jsonl([KTO_ROW, {**KTO_ROW, "label": "yes"}])}, recipe="dpo_smollm2"),
    script("kto-label-missing", ["--loss_type", "kto", "--dataset", "{tmp}/kto.jsonl"],
           r"{tmp}/kto\.jsonl row 0: missing key `label`", r"found: \['completion', 'prompt'\]",
           files={"kto.jsonl": jsonl([{"prompt": "Say hi.", "completion": "Hi!"}])},
           recipe="dpo_smollm2"),
    script("kto-label-integer", ["--loss_type", "kto", "--dataset", "{tmp}/kto.json"],
           r"{tmp}/kto\.json row 0: `label` must be true \(desirable\) or false", r"got int 1",
           files={"kto.json": json.dumps([{**KTO_ROW, "label": 1}])}, recipe="dpo_smollm2"),
    script("kto-neither-layout", ["--loss_type", "kto", "--dataset", "{tmp}/kto.jsonl"],
           r"{tmp}/kto\.jsonl row 0: expected `completion` and `label`", r"or `chosen` and `rejected`",
           files={"kto.jsonl": jsonl([{"prompt": "Say hi.", "response": "Hi!"}])},
           recipe="dpo_smollm2"),
    script("kto-completion-not-message", ["--loss_type", "kto", "--dataset", "{tmp}/kto.jsonl"],
           r"{tmp}/kto\.jsonl row 0: `completion` must be a string or a message list, got int",
           files={"kto.jsonl": jsonl([{**KTO_ROW, "completion": 7}])}, recipe="dpo_smollm2"),
    # --- reward model ------------------------------------------------------------------------------
    scaffold("new-rm-with-packing", ["new", "--algo", "rm", "--tricks", "packing", "--out", "{tmp}/o"],
             r"not built for reward models yet", r"one scored position per document"),
    script("rm-missing-rejected", ["--dataset", "{tmp}/pairs.json"],
           r"{tmp}/pairs\.json row 1: missing key `rejected`", r"found: \['chosen', 'prompt'\]",
           files={"pairs.json": json.dumps([PAIR, {"prompt": "Hi", "chosen": "Hello"}])},
           recipe="rm_smollm2", script_args=RM_ARGS),
    script("rm-margin-not-a-number", ["--dataset", "{tmp}/pairs.json"],
           r"{tmp}/pairs\.json row 1: `margin` must be a finite number, got 'large'",
           files={"pairs.json": json.dumps([{**PAIR, "margin": 1}, {**PAIR, "margin": "large"}])},
           recipe="rm_smollm2", script_args=RM_ARGS),
    script("rm-model-without-a-decoder-weight", ["--dataset", "{tmp}/pairs.json"],
           r"{model}: the checkpoint lacks decoder weights \['model\.norm\.weight'\]",
           r"expected a causal LM or a reward model",
           files={"pairs.json": json.dumps([PAIR] * 4)}, model=ModelVariant(drop=("model.norm.weight",)),
           recipe="rm_smollm2", script_args=RM_ARGS),
    script("rm-negative-centring", ["--center_rewards_coefficient", "-0.01"],
           r"center_rewards_coefficient=-0\.01 must be a finite number >= 0",
           recipe="rm_smollm2", script_args=RM_ARGS),
    script("grpo-reward-model-is-a-causal-lm", ["--reward_model", "{model}", "--reward_weights", "1,0.2,1"],
           r"reward_model='{model}': config\.json has architectures \['LlamaForCausalLM'\]",
           r"not a \*ForSequenceClassification", r"scaffold new --algo rm",
           recipe="grpo_smollm2", script_args=GRPO_ARGS),
    # --- GRPO ------------------------------------------------------------------------------------
    scaffold("new-grpo-hsdp-beyond-the-trainer",
             ["new", "--algo", "grpo", "--dp-replicate", "4", "--gpus", "4", "--engine-gpus", "2",
              "--out", "{tmp}/o"],
             r"\(--gpus 4 - --engine-gpus 2\) x --nodes 1 = 2 trainer processes is not divisible",
             r"one of \[1, 2\]"),
    scaffold("new-grpo-with-tp",
             ["new", "--algo", "grpo", "--tp", "2", "--gpus", "4", "--engine-gpus", "0",
              "--model", "qwen3-0.6b", "--tricks", "compile", "--out", "{tmp}/o"],
             r"--tricks compile with --tp 2: per-block torch.compile of DTensor",
             r"or use --tp 1"),
    scaffold("new-grpo-colocated-with-engine-gpus",
             ["new", "--algo", "grpo", "--layout", "colocated", "--gpus", "4", "--engine-gpus", "2",
              "--out", "{tmp}/o"],
             r"--layout colocated with --engine-gpus 2", r"take none of their own"),
    scaffold("new-grpo-colocated-multinode",
             ["new", "--algo", "grpo", "--layout", "colocated", "--gpus", "8", "--nodes", "2",
              "--out", "{tmp}/o"],
             r"--layout colocated with --nodes 2: not done yet", r"use --layout split"),
    scaffold("new-grpo-unknown-layout",
             ["new", "--algo", "grpo", "--layout", "shared", "--out", "{tmp}/o"],
             r"--layout shared: choose one of split, colocated"),
    script("grpo-answer-not-integer", ["--dataset", "{tmp}/sums.jsonl"],
           r"{tmp}/sums\.jsonl row 1: key 'answer' must be an integer", r"'seven'",
           files={"sums.jsonl": jsonl([{"question": "3 + 4 =", "answer": "7"},
                                       {"question": "3 + 4 =", "answer": "seven"}])},
           recipe="grpo_smollm2", script_args=GRPO_ARGS),
    script("grpo-missing-question", ["--dataset", "{tmp}/sums.jsonl"],
           r"{tmp}/sums\.jsonl row 0: key 'question' must be a non-empty string",
           files={"sums.jsonl": jsonl([{"prompt": "3 + 4 =", "answer": "7"}])},
           recipe="grpo_smollm2", script_args=GRPO_ARGS),
    script("grpo-unknown-rollout-mode", ["--dataset", "{tmp}/sums.jsonl", "--rollout", "overlap"],
           r"rollout='overlap': choose one of \('sync', 'async', 'off-policy'\)",
           files={"sums.jsonl": jsonl([{"question": "3 + 4 =", "answer": "7"}])},
           recipe="grpo_smollm2", script_args=GRPO_ARGS),
    script("grpo-more-engines-than-cpus", ["--dataset", "{tmp}/sums.jsonl", "--num_engines", "3",
                                           "--ray_num_cpus", "2"],
           r"the rollout actors need 3\.5 CPUs and 0 GPUs but the Ray cluster has 2 CPUs",
           r"lower --num_engines", when="no_cuda",
           files={"sums.jsonl": jsonl([{"question": "3 + 4 =", "answer": "7"}])},
           recipe="grpo_smollm2", script_args=GRPO_ARGS),
    script("grpo-vllm-engine-without-vllm", ["--engine", "vllm"],
           r"engine='vllm' but vllm is not installed in this Python", r"--engine runtime",
           when="no_vllm", recipe="grpo_smollm2", script_args=GRPO_ARGS),
    script("grpo-tensor-parallel-runtime-engine", ["--engine_tensor_parallel_size", "2"],
           r"engine_tensor_parallel_size=2: > 1 needs engine='vllm'",
           recipe="grpo_smollm2", script_args=GRPO_ARGS),
    script("grpo-collective-transfer-runtime-engine", ["--weight_transfer", "collective"],
           r"weight_transfer='collective' needs engine='vllm'", r"the runtime engine uses 'object-store'",
           recipe="grpo_smollm2", script_args=GRPO_ARGS),
    script("grpo-unknown-weight-transfer", ["--weight_transfer", "nccl"],
           r"weight_transfer='nccl': choose one of \('auto', 'collective', 'object-store'\)",
           recipe="grpo_smollm2", script_args=GRPO_ARGS),
    script("grpo-unknown-loss-type", ["--loss_type", "ppo"],
           r"loss_type='ppo': choose one of \('dapo', 'grpo', 'dr_grpo', 'gspo', 'cispo'\)",
           recipe="grpo_smollm2", script_args=GRPO_ARGS),
    script("grpo-dr-grpo-with-std-scaling", ["--loss_type", "dr_grpo"],
           r"loss_type='dr_grpo' with scale_rewards=True", r"pass --scale_rewards false",
           recipe="grpo_smollm2", script_args=GRPO_ARGS),
    script("grpo-one-generation", ["--num_generations", "1"],
           r"num_generations=1: GRPO's advantage is a completion's reward relative to the other completions",
           r"\(use num_generations >= 2\)", recipe="grpo_smollm2", script_args=GRPO_ARGS),
    script("grpo-max-staleness-with-sync", ["--rollout", "sync", "--max_staleness", "5"],
           r"max_staleness=5 applies to rollout='off-policy' only \(rollout='sync'",
           r"drop --max_staleness or pass --rollout off-policy", recipe="grpo_smollm2", script_args=GRPO_ARGS),
    script("grpo-num-iterations-zero", ["--num_iterations", "0"],
           r"num_iterations=0: must be >= 1", recipe="grpo_smollm2", script_args=GRPO_ARGS),
    script("grpo-max-steps-mid-batch", ["--num_iterations", "2"],
           r"max_steps=1 with num_iterations=2: must be a multiple of it",
           r"checkpoints fall between batches", recipe="grpo_smollm2", script_args=GRPO_ARGS),
    script("ppo-unknown-kl-in", ["--kl_in", "loss_and_reward"],
           r"kl_in='loss_and_reward': choose one of \('reward', 'loss'\)",
           recipe="ppo_smollm2", script_args=GRPO_ARGS),
    script("ppo-lam-out-of-range", ["--lam", "1.5"],
           r"gamma=1\.0 and lam=1\.5 must be in \[0, 1\]", recipe="ppo_smollm2", script_args=GRPO_ARGS),
    script("ppo-negative-cliprange-value", ["--cliprange_value", "0"],
           r"cliprange_value=0\.0 > 0", recipe="ppo_smollm2", script_args=GRPO_ARGS),
    scaffold("new-ppo-with-lce", ["new", "--algo", "ppo", "--tricks", "lce", "--out", "{tmp}/o"],
             r"ppo", r"lce", r"the value head reads the same final hidden states"),
    scaffold("new-ppo-colocated", ["new", "--algo", "ppo", "--layout", "colocated", "--out", "{tmp}/o"],
             r"--layout colocated with --algo ppo: not built yet", r"use --layout split"),
    script("grpo-collective-transfer-on-cluster-without-vllm",
           ["--engine", "vllm", "--ray_address", "auto"],
           r"engine='vllm' but vllm is not installed in this Python",
           r"or --weight_transfer object-store: with --ray_address only the cluster needs vllm",
           when="no_vllm", recipe="grpo_smollm2", script_args=GRPO_ARGS),
    scaffold("new-grpo-engine-gpus-take-every-gpu",
             ["new", "--algo", "grpo", "--gpus", "4", "--engine-gpus", "4", "--out", "{tmp}/o"],
             r"--engine-gpus 4 with --gpus 4", r"the trainer needs at least one", r"choose 0\.\.3"),
    scaffold("new-sft-with-engine-gpus",
             ["new", "--algo", "sft", "--gpus", "2", "--engine-gpus", "1", "--out", "{tmp}/o"],
             r"rollout engines exist only for --algo grpo", r"--engine-gpus 1: rollout engines", r"drop it"),
    script("kd-tokenizer-mismatch", ["--teacher", "{model}-teacher"],
           r"tokenizer mismatch: teacher {model}-teacher/tokenizer\.json \(513 tokens\)",
           r"student {model}/tokenizer\.json \(512 tokens\)", r"<\|teacher_only\|>",
           model=teacher_with_other_tokenizer, recipe="kd_smollm2"),
]  # fmt: skip
