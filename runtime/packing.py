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

Shape legend: B rows (packs) per batch, S = max_seq_len, N documents.

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
        id the pack's index (logged as the step's sample ids).

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
        current["input_ids"] += ids
        current["labels"] += labels
        current["position_ids"] += range(len(ids))
        current["seq_lens"].append(len(ids))
    if current["input_ids"]:
        packs.append(current)
    return packs


def _empty_pack(pack_id: int) -> dict:
    return {"id": pack_id, "input_ids": [], "labels": [], "position_ids": [], "seq_lens": []}


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
        document_ids[b] = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), lens)
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
        backend: "sdpa" (dense [B, 1, S, S] bool mask) or "flex" (a BlockMask; CUDA training,
            since flex attention has no backward on CPU).

    Returns:
        [B, 1, S, S] bool tensor, or a `torch.nn.attention.flex_attention.BlockMask`.

    Raises:
        ValueError: unknown backend.
    """
    if backend == "sdpa":
        return document_causal_mask(document_ids)
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        B, S = document_ids.shape
        mask_mod = document_mask_mod(document_ids)
        return create_block_mask(mask_mod, B, None, S, S, device=document_ids.device)
    raise ValueError(f"attention backend {backend!r}: choose one of {BACKENDS}")
