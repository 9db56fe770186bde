"""Where models and data come from: a local path, the scaffold cache, or the Hugging Face Hub.

The cache lives in `$SCAFFOLD_HOME` (default `~/.cache/scaffold`):
`models/<name>/` holds Hugging Face model directories (`config.json`, `*.safetensors`,
`tokenizer.json`, `tokenizer_config.json`), `data/<file>` holds dataset files.
`scaffold assets` fills it with the embedded real defaults (SmolLM2-135M-Instruct, alpaca demo).
"""

from __future__ import annotations

import os
from pathlib import Path

# Only what training needs: weights, config, tokenizer. Never optimizer states or other formats.
HF_ALLOW_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
]


def scaffold_home() -> Path:
    """The cache root: `$SCAFFOLD_HOME`, else `~/.cache/scaffold`."""
    return Path(os.environ.get("SCAFFOLD_HOME", "~/.cache/scaffold")).expanduser()


def hub_repo_id(model: str, hf_repo_id: str, default_model: str, default_repo_id: str) -> str:
    """The Hub id to fall back to for `model`: a script's default `hf_repo_id` belongs to its
    default model, so another model gets "" (nothing downloaded) unless its own id was given.

    Args:
        model, hf_repo_id: the values the run was given (e.g. cfg.model, cfg.hf_repo_id).
        default_model, default_repo_id: the script's defaults (Config.model, Config.hf_repo_id).
    """
    return hf_repo_id if model == default_model or hf_repo_id != default_repo_id else ""


def base_model_id(model: str, model_dir: str | os.PathLike, hf_repo_id: str) -> str:
    """The base model a saved adapter names (`base_model_name_or_path` in adapter_config.json).

    A cache path such as `~/.cache/scaffold/models/smollm2-135m` exists on this machine only, so a
    shared adapter naming it loads nowhere else; its Hub id loads anywhere. The rule:

    - `model` is a local directory the user passed (it holds config.json): that directory,
      absolute (the user's own base, which only they can name).
    - otherwise (a name in `$SCAFFOLD_HOME/models`, or downloaded from the Hub): `hf_repo_id`;
      without one (another cached model given no id), `model_dir`.

    Args:
        model: the run's model as given (cfg.model).
        model_dir: where `resolve_model_dir` found it.
        hf_repo_id: the Hub id of this model, "" if none (`hub_repo_id(...)`, not the raw
            config value, which belongs to the script's default model).

    Returns:
        A Hub id ("HuggingFaceTB/SmolLM2-135M-Instruct") or an absolute directory path.
    """
    path = Path(model).expanduser()
    if (path / "config.json").is_file():  # resolve_model_dir's first choice too
        return str(path.absolute())
    return hf_repo_id or str(model_dir)


def resolve_model_dir(
    model: str, hf_repo_id: str = "", flags: tuple[str, str] = ("--model", "--hf_repo_id")
) -> Path:
    """Find a Hugging Face model directory for `model`.

    Looks in order at: `model` as a local directory; `$SCAFFOLD_HOME/models/<model>`; then, when
    `hf_repo_id` is given, `huggingface_hub.snapshot_download(hf_repo_id)` (safetensors, config and
    tokenizer files only). An explicit path (absolute, or starting with "." or "~") is only
    looked at itself.

    Args:
        model: a local directory or a catalog name such as "smollm2-135m".
        hf_repo_id: Hub repository id to download from when nothing local is found.
        flags: the script options of `model` and `hf_repo_id`, named in the error.

    Returns:
        The directory holding `config.json`.

    Raises:
        FileNotFoundError: nothing local and the download failed or no repo id was given; the
            message names every place looked at and how to fix it.
    """
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    # An explicit path (/..., ./..., ~/...) means that directory: never a cached or downloaded
    # model instead (hf_repo_id belongs to the script's default model, not to this path).
    is_path = path.is_absolute() or model.startswith((".", "~"))
    cached = scaffold_home() / "models" / model
    if not is_path and (cached / "config.json").is_file():
        return cached
    tried = [str(path)] if is_path else [str(path), str(cached)]
    if hf_repo_id and not is_path:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(hf_repo_id, allow_patterns=HF_ALLOW_PATTERNS))
        except Exception as e:  # network off, gated repo, bad id: all end in the same advice
            tried.append(f"hub:{hf_repo_id} ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    raise FileNotFoundError(
        f"{flags[0]} {model!r}: no config.json found (looked at {', '.join(tried)}). "
        f"Pass a local Hugging Face directory with {flags[0]}, or its Hub id with {flags[1]}, or "
        "run `scaffold assets` to build the embedded SmolLM2-135M-Instruct."
    )


def resolve_data_path(dataset: str) -> str:
    """Resolve a dataset argument: a local file, a file in `$SCAFFOLD_HOME/data`, or a Hub name.

    Returns the local file path as a string when one exists, else `dataset` unchanged (to be read
    with `datasets.load_dataset`).

    Raises:
        FileNotFoundError: `dataset` names a local file (ends in .json/.jsonl/.parquet) that is in
            neither place; the message names both paths looked at.
    """
    path = Path(dataset).expanduser()
    if path.exists():
        return str(path)
    cached = scaffold_home() / "data" / dataset
    if cached.exists():
        return str(cached)
    if path.suffix.lower() in (".json", ".jsonl", ".parquet"):  # a file, never a Hub name
        looked = [str(path.absolute())]
        if cached != path:  # an absolute path joins the cache directory as itself
            looked.append(str(cached))
        raise FileNotFoundError(
            f"dataset {dataset!r}: no such file (looked at {' and '.join(looked)}); "
            "fix the path given as --dataset, or copy the file into "
            f"{scaffold_home() / 'data'}."
        )
    return dataset
