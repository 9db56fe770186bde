"""Packing: greedy packs that never split a document, per-document positions, block-causal masks
(dense SDPA and flex-attention mask_mod agree index by index), and the model's logits and
gradients of a document inside a pack equal those of the document alone (every backend that runs
on CPU: SDPA with the dense mask for forward + backward, flex attention for forward)."""

from __future__ import annotations

import pytest
import torch

from runtime import ModelArgs, build_model
from runtime.loss import IGNORE_INDEX, cross_entropy_sum
from runtime.packing import (
    document_attention_mask,
    document_causal_mask,
    document_mask_mod,
    pack_examples,
    packed_position_ids,
    packing_efficiency,
)
from tests.helpers import TINY_CONFIG

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)


def _doc(n: int, start: int = 1) -> dict:
    ids = list(range(start, start + n))
    return {"input_ids": ids, "labels": (ids[1:] + [IGNORE_INDEX])[:n]}


def test_greedy_packs_never_split_and_restart_positions():
    docs = [_doc(5), _doc(4, 10), _doc(3, 20), _doc(8, 30), _doc(12, 50), _doc(0)]
    packs = pack_examples(docs, max_seq_len=10)
    assert [p["seq_lens"] for p in packs] == [[5, 4], [3], [8], [10]]  # 12 truncated to 10
    assert packs[0]["input_ids"] == docs[0]["input_ids"] + docs[1]["input_ids"]
    assert packs[0]["labels"] == docs[0]["labels"] + docs[1]["labels"]
    assert packs[0]["position_ids"] == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    # the last token of a document never predicts the first token of the next one
    assert packs[0]["labels"][4] == IGNORE_INDEX
    assert pack_examples(docs, 10) == packs  # deterministic
    assert packing_efficiency(packs, 10) == pytest.approx((9 + 3 + 8 + 10) / 40)
    with pytest.raises(ValueError, match="labels"):
        pack_examples([{"input_ids": [1, 2], "labels": [1]}], 4)


def _collate(packs, S):
    """The script's collate for packs: right-pad ids (0) and labels, then the packing ids."""
    input_ids = torch.zeros((len(packs), S), dtype=torch.long)
    labels = torch.full((len(packs), S), IGNORE_INDEX, dtype=torch.long)
    for b, p in enumerate(packs):
        input_ids[b, : len(p["input_ids"])] = torch.tensor(p["input_ids"])
        labels[b, : len(p["labels"])] = torch.tensor(p["labels"])
    return {"input_ids": input_ids, "labels": labels, **packed_position_ids(packs, S)}


def test_position_and_document_ids_with_padding_document():
    packs = pack_examples([_doc(3), _doc(2, 7), _doc(4, 20)], max_seq_len=6)
    batch = packed_position_ids(packs, 6)
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    with pytest.raises(ValueError, match="longest pack"):
        packed_position_ids(packs, 4)


def test_dense_mask_and_flex_mask_mod_agree_with_brute_force():
    document_ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 3], [0, 1, 1, 1, 1, 1, 2, 2]])
    B, S = document_ids.shape
    expected = torch.zeros(B, 1, S, S, dtype=torch.bool)
    for b in range(B):
        for i in range(S):
            for j in range(S):
                expected[b, 0, i, j] = bool(document_ids[b, i] == document_ids[b, j]) and j <= i
    assert torch.equal(document_causal_mask(document_ids), expected)
    # flex's mask_mod, evaluated over every (b, q, kv) index as flex attention would
    b = torch.arange(B)[:, None, None, None]
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    q = torch.arange(S)[None, None, :, None]
    kv = torch.arange(S)[None, None, None, :]
    assert torch.equal(document_mask_mod(document_ids)(b, h, q, kv), expected)
    with pytest.raises(ValueError, match="choose one of"):
        document_attention_mask(document_ids, "eager")


def _tiny_model():
    torch.manual_seed(0)
    model = build_model(ModelArgs(**TINY_CONFIG, rope_theta=10000.0), device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    return model


def _docs_and_pack():
    g = torch.Generator().manual_seed(1)
    lens = [5, 9, 3]
    docs = []
    for n in lens:
        ids = torch.randint(0, TINY_CONFIG["vocab_size"], (n,), generator=g).tolist()
        docs.append({"input_ids": ids, "labels": ids[1:] + [IGNORE_INDEX]})
    packs = pack_examples(docs, max_seq_len=20)
    assert len(packs) == 1  # all three share one row, then 3 padding positions
    return docs, _collate(packs, 20), lens


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_document_logits_in_pack_equal_alone(backend):
    """fp32: each document's logits inside the pack equal its logits run alone (flex: forward only,
    it has no backward on CPU)."""
    model = _tiny_model()
    docs, batch, lens = _docs_and_pack()
    mask = document_attention_mask(batch["document_ids"], backend)
    with torch.no_grad():
        packed = model(batch["input_ids"], batch["position_ids"], mask)  # [1, S, V]
        start = 0
        for doc, n in zip(docs, lens):
            alone = model(torch.tensor([doc["input_ids"]]))  # [1, n, V], plain causal
            torch.testing.assert_close(packed[:, start : start + n], alone, atol=1e-5, rtol=1e-5)
            start += n


def test_packed_loss_and_grads_equal_unpacked():
    """SDPA dense mask, forward + backward: the summed token loss and every parameter gradient of
    the packed row equal those of the documents run one by one."""
    docs, batch, _ = _docs_and_pack()
    ref = _tiny_model()
    ref_loss = sum(
        cross_entropy_sum(ref(torch.tensor([d["input_ids"]])), torch.tensor([d["labels"]]))
        for d in docs
    )
    ref_loss.backward()
    model = _tiny_model()
    mask = document_attention_mask(batch["document_ids"], "sdpa")
    loss = cross_entropy_sum(
        model(batch["input_ids"], batch["position_ids"], mask), batch["labels"]
    )
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_flex_block_mask_builds_on_cpu():
    """create_block_mask evaluates the same mask_mod (CPU, uncompiled); its dense view matches."""
    document_ids = torch.tensor([[0] * 100 + [1] * 156])
    block_mask = document_attention_mask(document_ids, "flex")
    dense = document_causal_mask(document_ids)[0, 0]  # [S, S]
    # BlockMask.to_dense() is block-level (128 x 128): a block is kept iff any entry is True
    blocks = block_mask.to_dense()[0, 0].bool()
    S, n = dense.shape[0], dense.shape[0] // 128
    expected_blocks = dense.view(n, 128, n, 128).any(dim=3).any(dim=1)
    assert blocks.shape == (n, n) and S == 256
    assert torch.equal(blocks, expected_blocks)
