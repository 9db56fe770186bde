"""Sequence packing: whole tokenized documents concatenated into fixed-length rows, with positions
that restart per document and attention that never crosses a document boundary.

Padding a batch to its longest example wastes the rest of every row (31% of positions on the
alpaca demo at 256 tokens, docs/DESIGN.md#facts-the-code-relies-on); packing fills the rows with more documents instead. The
math stays that of the unpacked batch: each document sees only itself (block-causal attention),
its RoPE positions start at 0, and its labels are its own pre-shifted labels, so the last token of
a document never predicts the first token of the next one. Loss normalisation is untouched (the
script divides by the global supervised-token count).

Attention backends (`document_attention_mask`):
- "sdpa": a dense boolean mask [B, 1, S, S] for `F.scaled_dot_product_attention` (CPU and GPU;
  B * S * S bytes, e.g. 16 MiB at B=4, S=2048). The CPU training path: flex attention has no
  backward on CPU.
- "flex": a `torch.nn.attention.flex_attention.BlockMask` (GPU training): blocks of 128 x 128 that
  are fully masked are skipped, so compute and memory follow the documents, not S * S.

Preference pairs and GRPO rollouts (`pack_preference_pairs` + `collate_preference_packs`,
`pack_rollouts`): every sequence is one document, and a batch also carries `sequence_ids` [B, S],
the index of the sequence each position belongs to in the order of the unpacked batch (DPO: the P
chosen sequences, then their P rejected ones; GRPO: the rollouts in order). Per-token values
([B, S] log-probs) are summed back per sequence with `sequence_sums`, and per-sequence values
(advantages) are spread over their tokens with `expand_to_tokens`, so the loss code that follows
sees the [2P] or [M] tensors the unpacked path gives it.

Shape legend: B rows (packs) per batch, S the padded row length (<= max_seq_len; <= 2 *
max_seq_len for preference pairs), N documents (sequences) of a batch, P preference pairs, M
rollouts.

Reference:
    Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination: Accelerating Large
    Language Models without Impacting Performance", https://arxiv.org/abs/2107.02027 (block-causal
    masks, per-document positions, loss unchanged); torchtune `PackedDataset`
    (torchtune/datasets/_packed.py: greedy packing in dataset order, positions restart per
    document); PyTorch FlexAttention docs, "document masking"
    (https://pytorch.org/blog/flexattention/, torch.nn.attention.flex_attention.create_block_mask).
    Differs from reference: greedy in dataset order (as torchtune), not Krell's histogram-based
    bin packing: simpler and order-preserving; the startup print reports the efficiency reached.
"""

from __future__ import annotations

import torch

from runtime.loss import IGNORE_INDEX

BACKENDS = ("sdpa", "flex")


def pack_examples(examples: list[dict], max_seq_len: int) -> list[dict]:
    """Greedily pack tokenized documents, in order, into rows of at most `max_seq_len` tokens.

    A document goes into the current row if it fits, else it starts a new row: documents are never
    split. A document longer than max_seq_len is truncated to it (as the unpacked path does).
    Deterministic: the same examples in the same order give the same packs.

    Args:
        examples: [{"input_ids": list[int], "labels": list[int]}, ...], labels pre-shifted per
            document (labels[t] is the target of position t; IGNORE_INDEX = not supervised), as
            the script's `tokenize_example` makes them. Empty documents are skipped.
        max_seq_len: S, the row length.

    Returns:
        Packs: [{"id": int, "input_ids": list[int], "labels": list[int], "position_ids":
        list[int], "seq_lens": list[int]}, ...], each at most S tokens (not padded: the script's collate pads,
        `packed_position_ids` adds the positions and document ids of the padded batch),
        position_ids restarting at 0 for every document, seq_lens the document lengths in order,
        id the pack's index (logged as the step's sample ids). When the examples carry a
        "prompt" (the chat messages the script's end-of-run sample can ask), a pack carries its
        first document's.

    Raises:
        ValueError: max_seq_len < 1, or a document whose labels and input_ids differ in length.
    """
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len={max_seq_len}; it must be >= 1.")
    packs: list[dict] = []
    current = _empty_pack(0)
    for i, ex in enumerate(examples):
        ids, labels = ex["input_ids"][:max_seq_len], ex["labels"][:max_seq_len]
        if len(ex["input_ids"]) != len(ex["labels"]):
            raise ValueError(
                f"example {i}: {len(ex['input_ids'])} input_ids but {len(ex['labels'])} labels; "
                "labels must be pre-shifted to the same length as input_ids."
            )
        if not ids:
            continue
        if len(current["input_ids"]) + len(ids) > max_seq_len:
            packs.append(current)
            current = _empty_pack(len(packs))
        _append_document(current, ids, labels)
        if "prompt" in ex:
            current.setdefault("prompt", ex["prompt"])
    if current["input_ids"]:
        packs.append(current)
    return packs


def _empty_pack(pack_id: int) -> dict:
    return {"id": pack_id, "input_ids": [], "labels": [], "position_ids": [], "seq_lens": []}


def _append_document(pack: dict, ids: list[int], labels: list[int]) -> None:
    """Add one document to a pack: its tokens, labels, positions from 0 and its length."""
    pack["input_ids"] += ids
    pack["labels"] += labels
    pack["position_ids"] += range(len(ids))
    pack["seq_lens"].append(len(ids))


def packing_efficiency(packs: list[dict], max_seq_len: int) -> float:
    """Share of the positions of the padded rows that hold real tokens (1.0 = no padding)."""
    if not packs:
        return 0.0
    return sum(len(p["input_ids"]) for p in packs) / (len(packs) * max_seq_len)


def packed_position_ids(packs: list[dict], S: int) -> dict:
    """Position and document ids of a batch of packs, right-padded to S (the batch's length).

    The script's collate pads input_ids and labels; this adds what packing needs on top. The
    padding at the end of a row is its own document (id = number of documents in the row) with
    positions 0.., so every query row attends to at least one key (an all-masked row would make
    SDPA return NaN) and no real token attends to padding.

    Args:
        packs: from `pack_examples`, each at most S tokens.
        S: the padded length of the batch (the longest pack, or max_seq_len for fixed shapes).

    Returns:
        {"position_ids": [B, S] int64, restarting at 0 per document; "document_ids": [B, S]
        int32, 0, 1, ... per document within each row}.

    Raises:
        ValueError: a pack longer than S.
    """
    B = len(packs)
    position_ids = torch.zeros((B, S), dtype=torch.long)
    document_ids = torch.zeros((B, S), dtype=torch.int32)
    for b, pack in enumerate(packs):
        n = len(pack["input_ids"])
        if n > S:
            raise ValueError(f"pack {b} has {n} tokens > S={S}; pad the batch to its longest pack.")
        position_ids[b, :n] = torch.tensor(pack["position_ids"], dtype=torch.long)
        position_ids[b, n:] = torch.arange(S - n)
        lens = torch.tensor(pack["seq_lens"] + [S - n])  # the padding is the last "document"
        # output_size: the row's length is known (S), so no device sync, and the planner's fake
        # tensors (which hold no values) can size the result
        document_ids[b] = torch.repeat_interleave(
            torch.arange(len(lens), dtype=torch.int32), lens, output_size=S
        )
    return {"position_ids": position_ids, "document_ids": document_ids}


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Dense block-causal mask for SDPA: query i may attend key j iff same document and j <= i.

    Args:
        document_ids: [B, S] int, the document of every position (as from `packed_position_ids`).

    Returns:
        [B, 1, S, S] bool, True = may attend (SDPA's boolean attn_mask convention).
    """
    S = document_ids.shape[1]
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]  # [B, S, S]
    causal = torch.ones(S, S, dtype=torch.bool, device=document_ids.device).tril()  # [S, S]
    return (same_doc & causal)[:, None]  # [B, S, S] -> [B, 1, S, S]


def document_mask_mod(document_ids: torch.Tensor):
    """The flex-attention `mask_mod` of `document_causal_mask` (same truth table, per index).

    Args:
        document_ids: [B, S] int, captured by the returned function.

    Returns:
        mask_mod(b, h, q_idx, kv_idx) -> bool tensor, True = may attend; the arguments are int
        tensors (broadcastable), as flex attention calls it.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        same_doc = document_ids[b, q_idx] == document_ids[b, kv_idx]
        return same_doc & (q_idx >= kv_idx)

    return mask_mod


def document_attention_mask(document_ids: torch.Tensor, backend: str):
    """The attention mask to pass as the model's `attention_mask` for a packed batch.

    Args:
        document_ids: [B, S] int on the model's device.
        backend: "sdpa" (dense [B, 1, S, S] bool mask), "flex" (a BlockMask; CUDA training,
            since flex attention has no backward on CPU), or "auto": flex when document_ids is
            on CUDA (it skips the masked blocks), else sdpa.

    Returns:
        [B, 1, S, S] bool tensor, or a `torch.nn.attention.flex_attention.BlockMask`.

    Raises:
        ValueError: unknown backend.
    """
    if backend == "auto":
        backend = "flex" if document_ids.is_cuda else "sdpa"
    if backend == "sdpa":
        return document_causal_mask(document_ids)
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        B, S = document_ids.shape
        mask_mod = document_mask_mod(document_ids)
        return create_block_mask(mask_mod, B, None, S, S, device=document_ids.device)
    raise ValueError(f"attention backend {backend!r}: choose one of {('auto', *BACKENDS)}")


# --- preference pairs (DPO) and rollouts (GRPO) -------------------------------------------------
def pack_preference_pairs(pairs: list[dict], max_seq_len: int) -> list[dict]:
    """Greedily pack preference pairs, in order, into rows of at most 2 * max_seq_len tokens.

    Each pair is two documents of one row, its chosen sequence then its rejected one; a pair is
    never split across rows: it goes into the current row if both fit, else it starts a new row.
    A sequence longer than max_seq_len is cut at the end as the DPO script's `tokenize_sequence`
    cuts it (its last kept token then predicts nothing), so a row of 2 * max_seq_len (the
    positions of the pair's two unpacked rows) always holds a whole pair and every pair's
    log-probs are those of the unpacked path. Deterministic, order-preserving.

    Args:
        pairs: [{"id": int, "chosen": {"input_ids": list[int], "labels": list[int]},
            "rejected": {...}}, ...], labels pre-shifted per sequence (IGNORE_INDEX on the prompt),
            as the DPO script's `build_datasets` makes them.
        max_seq_len: the per-sequence limit (the script's max_seq_len); rows hold 2 * max_seq_len.

    Returns:
        Packs: [{"id": int, "sample_ids": list[int], "input_ids": list[int], "labels": list[int],
        "position_ids": list[int], "seq_lens": list[int]}, ...], not padded: `id` the pack's
        index, `sample_ids` its pairs' ids in order, `seq_lens` 2 per pair (chosen, rejected; 0
        for an empty sequence), positions restarting at 0 per sequence. Batch them with
        `collate_preference_packs`; `packing_efficiency(packs, 2 * max_seq_len)` reports the fill.
        A pack also carries its first pair's "prompt" when the pairs have one.

    Raises:
        ValueError: max_seq_len < 1, or a sequence whose labels and input_ids differ in length.
    """
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len={max_seq_len}; it must be >= 1.")
    row_len = 2 * max_seq_len
    packs: list[dict] = []
    current = _empty_pair_pack(0)
    for i, pair in enumerate(pairs):
        sequences = []
        for role in ("chosen", "rejected"):
            seq = pair[role]
            if len(seq["input_ids"]) != len(seq["labels"]):
                raise ValueError(
                    f"pair {i} ({role}): {len(seq['input_ids'])} input_ids but "
                    f"{len(seq['labels'])} labels; labels must be pre-shifted to the same length."
                )
            ids, labels = seq["input_ids"], seq["labels"]
            if len(ids) > max_seq_len:  # as tokenize_sequence cuts: the last kept token's
                # target is past the cut, so it predicts nothing
                ids, labels = ids[:max_seq_len], labels[: max_seq_len - 1] + [IGNORE_INDEX]
            sequences.append((ids, labels))
        n = sum(len(ids) for ids, _ in sequences)
        if current["sample_ids"] and len(current["input_ids"]) + n > row_len:
            packs.append(current)
            current = _empty_pair_pack(len(packs))
        current["sample_ids"].append(pair["id"])
        if "prompt" in pair:
            current.setdefault("prompt", pair["prompt"])
        for ids, labels in sequences:
            _append_document(current, ids, labels)
    if current["sample_ids"]:
        packs.append(current)
    return packs


def _empty_pair_pack(pack_id: int) -> dict:
    return {**_empty_pack(pack_id), "sample_ids": []}


def _padded_rows(packs: list[dict], S: int, pad_token_id: int) -> dict:
    """input_ids (pad_token_id) and labels (IGNORE_INDEX) of packs, right-padded to [B, S]."""
    input_ids = torch.full((len(packs), S), pad_token_id, dtype=torch.long)
    labels = torch.full((len(packs), S), IGNORE_INDEX, dtype=torch.long)
    for b, pack in enumerate(packs):
        n = len(pack["input_ids"])
        input_ids[b, :n] = torch.tensor(pack["input_ids"], dtype=torch.long)
        labels[b, :n] = torch.tensor(pack["labels"], dtype=torch.long)
    return {"input_ids": input_ids, "labels": labels, **packed_position_ids(packs, S)}


def collate_preference_packs(
    packs: list[dict], pad_token_id: int, pad_to: int = 0, pad_to_multiple_of: int = 1
) -> dict:
    """Right-pad packs of preference pairs into one batch that keeps the unpacked batch's order.

    The unpacked DPO batch is the P chosen sequences, then their P rejected ones ([2P] rows);
    `sequence_ids` numbers the packed sequences the same way, so `sequence_sums(logps,
    batch["sequence_ids"], 2 * P)` gives the [2P] log-probs the unpacked forward gives.

    Args:
        packs: from `pack_preference_pairs`.
        pad_token_id: written into padding.
        pad_to: pad to at least this length (fixed shapes); 0 = the longest pack.
        pad_to_multiple_of: S is rounded up to a multiple of it (sequence parallel splits rows
            over tp, context parallel into 2*cp chunks); the padding is one more document.

    Returns:
        input_ids [B, S] int64 (pad_token_id on padding); labels [B, S] int64 (IGNORE_INDEX on
        padding); position_ids [B, S] int64 and document_ids [B, S] int32 (`packed_position_ids`:
        feed `document_attention_mask(document_ids, backend)` as the attention mask);
        sequence_ids [B, S] int64: k for the chosen tokens of the batch's k-th pair, P + k for
        its rejected ones, -1 on padding; num_tokens: scalar int64, the non-padding tokens;
        sample_ids [P] int64, the pairs' ids in order.

    Raises:
        ValueError: a pack without two sequences per pair (e.g. one from `pack_examples`), or
            pad_to_multiple_of < 1.
    """
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of}: must be >= 1")
    S = max(pad_to, max(len(p["input_ids"]) for p in packs))
    S = -(-S // pad_to_multiple_of) * pad_to_multiple_of
    P = sum(len(p["sample_ids"]) for p in packs)
    batch = _padded_rows(packs, S, pad_token_id)
    sequence_ids = torch.full((len(packs), S), -1, dtype=torch.long)
    first_pair = 0  # the batch index of the pack's first pair
    for b, pack in enumerate(packs):
        if len(pack["seq_lens"]) != 2 * len(pack["sample_ids"]):
            raise ValueError(
                f"pack {b}: {len(pack['seq_lens'])} sequences for {len(pack['sample_ids'])} pairs; "
                "pack preference pairs with pack_preference_pairs (chosen, rejected per pair)."
            )
        start = 0
        for j, n in enumerate(pack["seq_lens"]):  # chosen, rejected, chosen, rejected, ...
            pair, rejected = first_pair + j // 2, j % 2
            sequence_ids[b, start : start + n] = pair + P * rejected
            start += n
        first_pair += len(pack["sample_ids"])
    return {
        **batch,
        "sequence_ids": sequence_ids,
        "num_tokens": torch.tensor(sum(len(p["input_ids"]) for p in packs)),
        "sample_ids": torch.tensor([i for p in packs for i in p["sample_ids"]], dtype=torch.long),
    }


def pack_rollouts(
    prompts: list[list[int]],
    completions: list[list[int]],
    max_len: int,
    pad_token_id: int = 0,
    pad_to: int = 0,
    pad_to_multiple_of: int = 1,
) -> dict[str, torch.Tensor]:
    """Greedily pack rollouts (prompt + completion), in order, into right-padded rows.

    The packed counterpart of `runtime.grpo.collate_rollouts`: each rollout is one document with
    the same pre-shifted labels (its completion tokens, IGNORE_INDEX elsewhere), its own positions
    from 0 and block-causal attention, so its per-token log-probs equal the unpacked ones. A
    rollout is never split or cut (its sampled tokens and their sampler log-probs must stay
    whole): one longer than max_len is an error.

    Args:
        prompts: M prompt token ids, each non-empty (its last token predicts the completion's
            first).
        completions: M completion token ids (the stop token, if sampled, included).
        max_len: the row length limit, e.g. max_prompt_len + max_new_tokens.
        pad_token_id: written into padding.
        pad_to: pad the rows to at least this length (fixed shapes, e.g. compiled blocks); 0 =
            the longest row.
        pad_to_multiple_of: S rounded up to a multiple of it (sequence parallel splits rows over
            tp ranks, context parallel into 2*cp chunks); the padding is its row's last document.

    Returns:
        input_ids [R, S] int64, labels [R, S] int64, position_ids [R, S] int64, document_ids
        [R, S] int32, sequence_ids [R, S] int64 (rollout i's positions hold i, padding -1); R rows,
        S the longest row (<= max_len), or pad_to if larger, rounded up to pad_to_multiple_of. Lay the sampler's per-token log-probs on it with
        `packed_completion_values`, per-rollout values with `expand_to_tokens`, and reduce per
        rollout with `sequence_sums`.

    Raises:
        ValueError: max_len < 1, pad_to_multiple_of < 1, prompts and completions of different
            counts, an empty prompt, or a rollout longer than max_len.
    """
    if max_len < 1:
        raise ValueError(f"max_len={max_len}; it must be >= 1.")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of}; it must be >= 1.")
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    documents = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        if not p:
            raise ValueError(f"rollout {i}: empty prompt; no position predicts its first token")
        if len(p) + len(c) > max_len:
            raise ValueError(
                f"rollout {i}: {len(p)} prompt + {len(c)} completion tokens > max_len={max_len}; "
                "pass max_len >= max_prompt_len + max_new_tokens"
            )
        labels = [IGNORE_INDEX] * (len(p) - 1) + list(c) + [IGNORE_INDEX]  # as collate_rollouts
        documents.append({"input_ids": list(p) + list(c), "labels": labels})
    packs = pack_examples(documents, max_len)  # none is empty or too long: none skipped or cut
    S = max(pad_to, max(len(pack["input_ids"]) for pack in packs))
    S = -(-S // pad_to_multiple_of) * pad_to_multiple_of
    batch = _padded_rows(packs, S, pad_token_id)
    sequence_ids = torch.full((len(packs), S), -1, dtype=torch.long)
    i = 0
    for b, pack in enumerate(packs):
        start = 0
        for n in pack["seq_lens"]:
            sequence_ids[b, start : start + n] = i
            start, i = start + n, i + 1
    return {**batch, "sequence_ids": sequence_ids}


def sequence_sums(
    values: torch.Tensor, sequence_ids: torch.Tensor, num_sequences: int
) -> torch.Tensor:
    """Sum per-token values per sequence: out[n] = sum of values where sequence_ids == n.

    Args:
        values: [B, S] per-token values, e.g. `token_logprobs` (0 off the supervised tokens), or
            a bool mask (summed as int64: token counts). Differentiable.
        sequence_ids: [B, S] int64 from `collate_preference_packs` / `pack_rollouts`; -1 (padding)
            is left out. Ids must be < num_sequences.
        num_sequences: N (DPO: 2 * P; GRPO: M).

    Returns:
        [N] in values' dtype (int64 for a bool mask; float values are summed in fp64); 0 for a
        sequence with no position.

    Raises:
        ValueError: values and sequence_ids of different shapes.
    """
    if values.shape != sequence_ids.shape:
        raise ValueError(
            f"values {tuple(values.shape)} and sequence_ids {tuple(sequence_ids.shape)} differ"
        )
    if values.dtype == torch.bool:
        values = values.long()
    # index_add adds a sequence's tokens one by one into one slot; in fp32 that drifts from the
    # unpacked path's pairwise `.sum(-1)` (7x its error at 1000 tokens of -6 nats each), so float
    # values accumulate in fp64 ([B * S] elements: negligible cost) and are cast back
    acc = values.double() if values.is_floating_point() else values
    ids = sequence_ids.reshape(-1)
    # padding goes to an extra slot that is cut off: no boolean indexing, so no host sync on GPU
    index = torch.where(ids < 0, num_sequences, ids)
    out = acc.new_zeros(num_sequences + 1).index_add(0, index, acc.reshape(-1))
    return out[:num_sequences].to(values.dtype)


def expand_to_tokens(values: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
    """Spread per-sequence values over their tokens (e.g. GRPO advantages over the packed rows).

    Args:
        values: [N], one per sequence; differentiable.
        sequence_ids: [B, S] int64, ids < N, -1 on padding.

    Returns:
        [B, S] in values' dtype: values[sequence_ids], 0 on padding.
    """
    padded = torch.cat([values, values.new_zeros(1)])  # index N: padding's 0
    return padded[torch.where(sequence_ids < 0, values.shape[0], sequence_ids)]


def packed_completion_values(
    values: list[list[float]], labels: torch.Tensor, sequence_ids: torch.Tensor
) -> torch.Tensor:
    """Per-completion-token values (the sampler's log-probs) laid out like `pack_rollouts`.

    The packed counterpart of `runtime.grpo.scatter_completion_values`: values[i][j] goes to the
    position that predicts completion token j of rollout i, i.e. the j-th supervised position
    (labels != IGNORE_INDEX) of sequence i. Rollouts are packed in order, so the supervised
    positions in row-major order are rollout 0's, then rollout 1's, and so on.

    Args:
        values: M lists, values[i] one float per completion token of rollout i.
        labels: [B, S] int64 from `pack_rollouts`.
        sequence_ids: [B, S] int64 from `pack_rollouts`.

    Returns:
        [B, S] fp32 on labels' device, 0 off the completion tokens.

    Raises:
        ValueError: a rollout whose value count is not its completion length, or sequence ids
            that do not run in order over the rows (not a `pack_rollouts` layout).
    """
    mask = labels != IGNORE_INDEX
    counts = sequence_sums(mask, sequence_ids, len(values)).tolist()
    lens = [len(v) for v in values]
    if counts != lens:
        bad = next(i for i, (c, n) in enumerate(zip(counts, lens, strict=True)) if c != n)
        raise ValueError(
            f"rollout {bad}: {lens[bad]} values but {counts[bad]} completion tokens in the batch"
        )
    ids = sequence_ids[mask]
    if ids.numel() and not bool((ids[1:] >= ids[:-1]).all()):
        raise ValueError("sequence_ids do not run in order over the rows; use pack_rollouts")
    out = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    flat = [x for v in values for x in v]
    out[mask] = torch.tensor(flat, dtype=torch.float32, device=labels.device)
    return out
