"""Packing: greedy packs that never split a document, per-document positions, block-causal masks
(dense SDPA and flex-attention mask_mod agree index by index), and the model's logits and
gradients of a document inside a pack equal those of the document alone (every backend that runs
on CPU: SDPA with the dense mask for forward + backward, flex attention for forward).

Preference pairs (DPO) and rollouts (GRPO): packs that never split a pair or a rollout, and on the
tiny model the packed forward gives the unpacked padded path's per-pair chosen/rejected log-prob
sums and token counts, per-rollout completion log-probs, and the same parameter gradients of a
DPO-like and a GRPO-like loss (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from runtime import ModelArgs, build_model
from runtime.grpo import collate_rollouts, completion_logprobs, scatter_completion_values
from runtime.loss import IGNORE_INDEX, cross_entropy_sum, token_logprobs
from runtime.packing import (
    collate_preference_packs,
    document_attention_mask,
    document_causal_mask,
    document_mask_mod,
    expand_to_tokens,
    pack_examples,
    pack_preference_pairs,
    pack_rollouts,
    packed_completion_values,
    packed_position_ids,
    packing_efficiency,
    sequence_sums,
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


# --- preference pairs (DPO) ---------------------------------------------------------------------
def _reply_seq(prompt: list[int], reply: list[int]) -> dict:
    """prompt + reply with the DPO script's labels: the reply's tokens supervised, pre-shifted."""
    labels = [IGNORE_INDEX] * (len(prompt) - 1) + reply + [IGNORE_INDEX]
    return {"input_ids": prompt + reply, "labels": labels}


def _pairs(shapes, seed: int = 2) -> list[dict]:
    """Pairs of random ids, one per (prompt, chosen, rejected) length triple; id = 100 + index."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(0, TINY_CONFIG["vocab_size"], (n,), generator=g).tolist()

    pairs = []
    for i, (lp, lc, lr) in enumerate(shapes):
        prompt = rand(lp)
        pairs.append(
            {
                "id": 100 + i,
                "chosen": _reply_seq(prompt, rand(lc)),
                "rejected": _reply_seq(prompt, rand(lr)),
            }
        )
    return pairs


def _cut(seq: dict, max_seq_len: int) -> dict:
    """tokenize_sequence's cut: the first max_seq_len ids, labels re-derived (last one ignored)."""
    if len(seq["input_ids"]) <= max_seq_len:
        return seq
    labels = seq["labels"][: max_seq_len - 1] + [IGNORE_INDEX]
    return {"input_ids": seq["input_ids"][:max_seq_len], "labels": labels}


def _unpacked_dpo_batch(pairs: list[dict], max_seq_len: int) -> dict:
    """The DPO script's path: each sequence cut to max_seq_len (tokenize_sequence), then its
    collate: the P chosen rows, then the P rejected rows, right-padded."""
    seqs = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    seqs = [_cut(seq, max_seq_len) for seq in seqs]
    S = max(len(seq["input_ids"]) for seq in seqs)
    input_ids = torch.zeros((len(seqs), S), dtype=torch.long)
    labels = torch.full((len(seqs), S), IGNORE_INDEX, dtype=torch.long)
    for i, seq in enumerate(seqs):
        input_ids[i, : len(seq["input_ids"])] = torch.tensor(seq["input_ids"])
        labels[i, : len(seq["labels"])] = torch.tensor(seq["labels"])
    return {"input_ids": input_ids, "labels": labels}


def test_preference_pairs_pack_whole_pairs_in_order():
    # max_seq_len 8: rows of 16; pair 3's sequences (6 + 9, 6 + 4) are cut to 8 and 8 tokens
    pairs = _pairs([(2, 3, 1), (2, 2, 2), (3, 4, 5), (6, 9, 4), (1, 1, 1)])
    packs = pack_preference_pairs(pairs, max_seq_len=8)
    assert [p["sample_ids"] for p in packs] == [[100, 101], [102], [103], [104]]
    assert [p["seq_lens"] for p in packs] == [[5, 3, 4, 4], [7, 8], [8, 8], [2, 2]]
    assert packs[0]["input_ids"] == sum(
        (pairs[i][r]["input_ids"] for i in (0, 1) for r in ("chosen", "rejected")), []
    )
    assert (
        packs[2]["input_ids"]
        == pairs[3]["chosen"]["input_ids"][:8] + pairs[3]["rejected"]["input_ids"][:8]
    )
    # cut as tokenize_sequence cuts: the last kept token of a cut sequence predicts nothing
    chosen, rejected = pairs[3]["chosen"]["labels"], pairs[3]["rejected"]["labels"]
    assert chosen[7] != IGNORE_INDEX  # supervised before the cut
    assert packs[2]["labels"] == chosen[:7] + [IGNORE_INDEX] + rejected[:7] + [IGNORE_INDEX]
    assert packs[0]["position_ids"] == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3]
    assert pack_preference_pairs(pairs, 8) == packs  # deterministic
    assert packing_efficiency(packs, 16) == pytest.approx((16 + 15 + 16 + 4) / 64)

    batch = collate_preference_packs(packs[:2], pad_token_id=0)  # pairs 100, 101, 102: P = 3
    assert batch["sample_ids"].tolist() == [100, 101, 102]
    # chosen of the batch's k-th pair = k, its rejected = P + k, padding = -1
    assert batch["sequence_ids"].tolist() == [
        [0] * 5 + [3] * 3 + [1] * 4 + [4] * 4,
        [2] * 7 + [5] * 8 + [-1],
    ]
    assert batch["document_ids"].tolist() == [
        [0] * 5 + [1] * 3 + [2] * 4 + [3] * 4,
        [0] * 7 + [1] * 8 + [2],
    ]
    assert batch["num_tokens"].item() == 31 and batch["input_ids"].shape == (2, 16)
    assert collate_preference_packs(packs[:2], 0, pad_to=20)["sequence_ids"].shape == (2, 20)
    # a multiple of tp / 2*cp: the padding is one more document, outside every sequence
    padded = collate_preference_packs(packs[:2], 0, pad_to_multiple_of=6)  # 16 -> 18
    assert padded["sequence_ids"].tolist() == [
        row + [-1] * 2 for row in batch["sequence_ids"].tolist()
    ]
    assert padded["document_ids"][:, 16:].tolist() == [[4, 4], [2, 2]]
    with pytest.raises(ValueError, match="pad_to_multiple_of=0: must be >= 1"):
        collate_preference_packs(packs[:2], 0, pad_to_multiple_of=0)
    unshifted = {"id": 0, "chosen": {"input_ids": [1, 2], "labels": [1]}, "rejected": _doc(2)}
    with pytest.raises(ValueError, match=r"pair 0 \(chosen\): 2 input_ids but 1 labels"):
        pack_preference_pairs([unshifted], 4)
    with pytest.raises(ValueError, match="pack_preference_pairs"):
        collate_preference_packs([{**pack_examples([_doc(3)], 4)[0], "sample_ids": [0]}], 0)


def test_sequence_sums_and_expand_to_tokens():
    values = torch.tensor([[1.0, 2.0, 4.0, 8.0], [16.0, 32.0, 64.0, 128.0]], requires_grad=True)
    ids = torch.tensor([[0, 0, 2, -1], [1, 1, 1, 2]])
    sums = sequence_sums(values, ids, 4)
    assert sums.tolist() == [3.0, 112.0, 132.0, 0.0]  # padding (8.0) left out; sequence 3 empty
    sums.sum().backward()
    assert values.grad.tolist() == [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    counts = sequence_sums(ids >= 0, ids, 4)
    assert counts.dtype == torch.long and counts.tolist() == [2, 3, 2, 0]
    assert expand_to_tokens(torch.tensor([5.0, 6.0, 7.0, 9.0]), ids).tolist() == [
        [5.0, 5.0, 7.0, 0.0],
        [6.0, 6.0, 6.0, 7.0],
    ]
    with pytest.raises(ValueError, match="differ"):
        sequence_sums(values, ids[:, :2], 4)


def test_sequence_sums_of_long_sequences_are_rounded_once():
    """Two 4096-token fp32 sequences of about -6 nats per token: the sums are the fp64 sums
    rounded to fp32 once (within 1 ulp, 0.002 at 24,576); adding the tokens one by one in fp32
    is off by 0.0039 here."""
    g = torch.Generator().manual_seed(5)
    values = -6 + torch.rand((2, 4096), generator=g)
    ids = torch.tensor([[0], [1]]).expand(2, 4096)
    want = values.double().sum(-1).float()
    torch.testing.assert_close(sequence_sums(values, ids, 2), want, atol=2e-3, rtol=0)


def _dpo_loss(logps: torch.Tensor, ref: torch.Tensor, P: int, beta: float = 0.5) -> torch.Tensor:
    """The DPO script's sigmoid loss on [2P] sequence log-probs (chosen first), summed."""
    h = (logps[:P] - ref[:P]) - (logps[P:] - ref[P:])
    return -torch.nn.functional.logsigmoid(beta * h).sum()


# lengths (prompt, chosen, rejected), max_seq_len 12: rows of 24 hold pairs [0, 1], [2], [3],
# [4], [5, 6], [7]; pair 4's chosen sequence (9 + 6 tokens) is cut to 12, 3 reply tokens supervised
_DPO_SHAPES = [
    (3, 2, 3),
    (2, 3, 2),
    (4, 2, 2),
    (3, 3, 5),
    (9, 6, 2),
    (2, 2, 3),
    (2, 1, 2),
    (5, 3, 4),
]


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_packed_pair_logprobs_equal_unpacked(backend):
    """Per-pair chosen and rejected log-prob sums and supervised-token counts of the packed batch
    equal those of the unpacked padded batch (flex: forward only, no backward on CPU)."""
    model, max_seq_len = _tiny_model(), 12
    pairs = _pairs(_DPO_SHAPES)
    packs = pack_preference_pairs(pairs, max_seq_len)
    assert [p["sample_ids"] for p in packs] == [[100, 101], [102], [103], [104], [105, 106], [107]]
    batch = collate_preference_packs(packs, pad_token_id=0)
    unpacked = _unpacked_dpo_batch(pairs, max_seq_len)
    N = 2 * len(pairs)
    weight = model.lm_head.weight
    with torch.no_grad():
        mask = document_attention_mask(batch["document_ids"], backend)
        hidden = model.forward_hidden(batch["input_ids"], batch["position_ids"], mask)
        packed = sequence_sums(
            token_logprobs(hidden, weight, batch["labels"]), batch["sequence_ids"], N
        )
        want = token_logprobs(
            model.forward_hidden(unpacked["input_ids"]), weight, unpacked["labels"]
        ).sum(-1)
    counts = sequence_sums(batch["labels"] != IGNORE_INDEX, batch["sequence_ids"], N)
    assert counts.tolist() == (unpacked["labels"] != IGNORE_INDEX).sum(-1).tolist()
    assert counts[4].item() == 3  # pair 4's chosen sequence: cut, 3 reply tokens left
    assert want.abs().min() > 1.0  # every sequence has real log-probs to compare
    torch.testing.assert_close(packed, want, atol=1e-5, rtol=0)


def test_packed_dpo_loss_gradients_equal_unpacked():
    """SDPA dense mask, forward + backward: a DPO loss over the packed batch and over the unpacked
    batch have the same value and the same gradient for every parameter."""
    max_seq_len = 12
    pairs = _pairs(_DPO_SHAPES)
    P = len(pairs)
    ref = torch.randn(2 * P, generator=torch.Generator().manual_seed(3)) * 5 - 20  # fixed reference
    model = _tiny_model()
    unpacked = _unpacked_dpo_batch(pairs, max_seq_len)
    hidden = model.forward_hidden(unpacked["input_ids"])
    want_loss = _dpo_loss(
        token_logprobs(hidden, model.lm_head.weight, unpacked["labels"]).sum(-1), ref, P
    )
    want_loss.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    batch = collate_preference_packs(pack_preference_pairs(pairs, max_seq_len), pad_token_id=0)
    mask = document_attention_mask(batch["document_ids"], "sdpa")
    hidden = model.forward_hidden(batch["input_ids"], batch["position_ids"], mask)
    logps = sequence_sums(
        token_logprobs(hidden, model.lm_head.weight, batch["labels"]), batch["sequence_ids"], 2 * P
    )
    loss = _dpo_loss(logps, ref, P)
    loss.backward()
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=0)
    for name, p in model.named_parameters():
        assert want[name].abs().max() > 0, name  # every parameter gets a gradient to compare
        torch.testing.assert_close(p.grad, want[name], atol=1e-6, rtol=1e-5, msg=name)


# --- rollouts (GRPO) ----------------------------------------------------------------------------
def _rollouts(shapes, seed: int = 4) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(0, TINY_CONFIG["vocab_size"], (n,), generator=g).tolist()

    return [rand(lp) for lp, _ in shapes], [rand(lc) for _, lc in shapes]


# (prompt, completion) lengths, max_len 16: rows [0, 1], [2, 3, 4], [5]; rollout 3 sampled nothing
_GRPO_SHAPES = [(5, 6), (4, 1), (3, 7), (2, 0), (3, 1), (6, 8)]


def test_pack_rollouts_layout():
    prompts, completions = _rollouts(_GRPO_SHAPES)
    batch = pack_rollouts(prompts, completions, max_len=16, pad_token_id=0)
    unpacked = collate_rollouts(prompts, completions, pad_token_id=0)
    assert batch["sequence_ids"].tolist() == [
        [0] * 11 + [1] * 5,
        [2] * 10 + [3] * 2 + [4] * 4,
        [5] * 14 + [-1] * 2,
    ]
    assert batch["document_ids"][2].tolist() == [0] * 14 + [1] * 2  # padding: its own document
    # each rollout's tokens, labels and positions in its row equal its unpacked row
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        where = batch["sequence_ids"] == i
        (row,) = where.any(dim=1).nonzero()[:, 0].tolist()  # one row: never split
        n = len(p) + len(c)
        assert where.sum() == n
        assert batch["input_ids"][where].tolist() == unpacked["input_ids"][i, :n].tolist()
        assert batch["labels"][where].tolist() == unpacked["labels"][i, :n].tolist()
        assert batch["position_ids"][where].tolist() == list(range(n))
        assert len(set(batch["document_ids"][where].tolist())) == 1, row
    with pytest.raises(
        ValueError, match=r"rollout 5: 6 prompt \+ 8 completion tokens > max_len=13"
    ):
        pack_rollouts(prompts, completions, max_len=13)
    with pytest.raises(ValueError, match="rollout 1: empty prompt"):
        pack_rollouts([[1], []], [[2], [3]], max_len=8)


def test_packed_rollout_logprobs_and_grads_equal_unpacked():
    """Per-token completion log-probs (temperature 0.7) of the packed rollouts equal the unpacked
    ones; the sampler's values and the advantages land on the same tokens; a GRPO-like token
    loss has the same value and parameter gradients (SDPA dense mask)."""
    prompts, completions = _rollouts(_GRPO_SHAPES)
    M, T = len(prompts), 0.7
    sampler = [[-0.5 - 0.1 * j - i for j in range(len(c))] for i, c in enumerate(completions)]
    advantages = torch.tensor([1.0, -0.5, 0.25, 2.0, -1.5, 0.75])

    def token_loss(logprobs, sampler_logprobs, token_advantages, mask):
        ratio = torch.exp(logprobs - sampler_logprobs)  # [B, S], differentiable in logprobs
        return (-ratio * token_advantages * mask).sum()

    model = _tiny_model()
    unpacked = collate_rollouts(prompts, completions, pad_token_id=0)
    want = completion_logprobs(model, unpacked["input_ids"], unpacked["labels"], T)  # [M, S']
    want_sampler = scatter_completion_values(sampler, [len(p) for p in prompts], want.shape[1])
    want_mask = unpacked["labels"] != IGNORE_INDEX
    want_loss = token_loss(want, want_sampler, advantages[:, None], want_mask)
    want_loss.backward()
    want_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    batch = pack_rollouts(prompts, completions, max_len=16)
    seq = batch["sequence_ids"]
    mask = document_attention_mask(batch["document_ids"], "sdpa")
    got = completion_logprobs(
        model,
        batch["input_ids"],
        batch["labels"],
        T,
        position_ids=batch["position_ids"],
        attention_mask=mask,
    )
    got_sampler = packed_completion_values(sampler, batch["labels"], seq)
    got_mask = batch["labels"] != IGNORE_INDEX
    loss = token_loss(got, got_sampler, expand_to_tokens(advantages, seq), got_mask)
    loss.backward()

    for i in range(M):  # the same tokens, in the same order, on both layouts
        torch.testing.assert_close(
            got[got_mask & (seq == i)], want[i][want_mask[i]], atol=1e-5, rtol=0
        )
        assert got_sampler[got_mask & (seq == i)].tolist() == want_sampler[i][want_mask[i]].tolist()
    assert got_sampler[~got_mask].abs().sum() == 0
    torch.testing.assert_close(sequence_sums(got, seq, M), want.sum(-1), atol=1e-5, rtol=0)
    assert sequence_sums(got_mask, seq, M).tolist() == [len(c) for c in completions]
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=0)
    for name, p in model.named_parameters():
        assert want_grads[name].abs().max() > 0, name
        torch.testing.assert_close(p.grad, want_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    with pytest.raises(ValueError, match="rollout 2: 6 values but 7 completion tokens"):
        packed_completion_values(
            [*sampler[:2], sampler[2][:-1], *sampler[3:]], batch["labels"], seq
        )
