"""KV-cache generation: no-cache reference, transformers parity, padding, stop, sampling, real
model; `sample`, the scripts' chat reply."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.checkpoint import load_hf_checkpoint, read_hf_config
from runtime.generate import generate, sample_next_token, truncate_logits
from runtime.models.llama import ModelArgs, build_model
from tests.helpers import TINY_CONFIG

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

# The tiny config (tests/helpers.py TINY_CONFIG).
TINY = dict(
    **TINY_CONFIG,
    rms_norm_eps=1e-5,
)
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [11, 12], [200, 1, 2, 3, 4]]
NEW = 10


@pytest.fixture(scope="module")
def tiny():
    """Tiny model with N(0, 0.1) weights: logit gaps far above fp32 noise, so argmax is stable."""
    model = build_model(ModelArgs(**TINY), device="cpu")
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    return model.eval()


@torch.no_grad()
def greedy_without_cache(model, prompt: list[int], n: int) -> list[int]:
    """Reference: re-run the full forward on the whole sequence each step, take the argmax."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_equals_no_cache_reference_and_padded_rows_equal_alone(tiny):
    batched = generate(tiny, PROMPTS, max_new_tokens=NEW)
    for prompt, row in zip(PROMPTS, batched):
        assert row == greedy_without_cache(tiny, prompt, NEW)
        assert row == generate(tiny, [prompt], max_new_tokens=NEW)[0]


def test_greedy_equals_transformers_generate(tiny, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny.args.to_hf_config()))
    hf.load_state_dict(tiny.state_dict())
    hf.eval()
    for prompt in PROMPTS[:2]:
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        assert generate(tiny, [prompt], max_new_tokens=NEW)[0] == out[0, len(prompt) :].tolist()


def test_stop_token_ends_each_row_and_is_kept(tiny):
    full = generate(tiny, PROMPTS, max_new_tokens=NEW)
    stop = full[0][3]
    cut = generate(tiny, PROMPTS, max_new_tokens=NEW, stop_token_ids=[stop])
    for row, cut_row in zip(full, cut):
        end = row.index(stop) + 1 if stop in row else len(row)
        assert cut_row == row[:end]
    assert cut[0][-1] == stop and len(cut[0]) <= 4
    assert generate(tiny, PROMPTS, max_new_tokens=0) == [[], [], []]


def test_sampling_is_seeded_and_tiny_top_p_is_greedy(tiny):
    def sample(seed, **kw):
        gen = torch.Generator().manual_seed(seed)
        return generate(tiny, PROMPTS, max_new_tokens=NEW, generator=gen, **kw)

    assert sample(0, temperature=1.0, top_p=0.9) == sample(0, temperature=1.0, top_p=0.9)
    assert sample(0, temperature=1.5) != sample(1, temperature=1.5)
    greedy = generate(tiny, PROMPTS, max_new_tokens=NEW)
    assert sample(0, temperature=1.0, top_p=1e-6) == greedy


def test_top_p_only_samples_from_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(4000, 4)  # [B, V]
    gen = torch.Generator().manual_seed(0)
    nucleus = sample_next_token(logits, temperature=1.0, top_p=0.7, generator=gen)
    assert set(nucleus.tolist()) == {1, 3}  # 0.5 + 0.3 >= 0.7: smallest such set
    counts = torch.bincount(nucleus, minlength=4).float() / 4000
    torch.testing.assert_close(counts[[1, 3]], torch.tensor([0.625, 0.375]), atol=0.03, rtol=0)
    everything = sample_next_token(logits, temperature=1.0, top_p=1.0, generator=gen)
    assert set(everything.tolist()) == {0, 1, 2, 3}


def test_truncate_logits_closed_form():
    """vLLM's rules on hand-made rows: top-k keeps ties at the k-th value, top-p keeps the token
    that crosses the threshold and is taken on the mass renormalised after top-k, `keep` adds
    the label to the support; the log-softmax of the result is the renormalised log-prob."""
    inf = float("-inf")
    # top-k 2 with a tie at the 2nd value: both tied tokens stay (3 kept)
    x = torch.tensor([[1.0, 2.0, 2.0, 0.0, 3.0]])
    assert truncate_logits(x, top_k=2).tolist() == [[inf, 2.0, 2.0, inf, 3.0]]
    probs = torch.tensor([[0.1, 0.45, 0.15, 0.3]])  # descending: 0.45, 0.3, 0.15, 0.1
    logits = probs.log()
    # top-p 0.7: 0.45 < 0.7, 0.45 + 0.3 = 0.75 crosses it: that token is kept, the next is not
    got = truncate_logits(logits, top_p=0.7).log_softmax(-1)
    want = torch.tensor([[inf, math.log(0.45 / 0.75), inf, math.log(0.3 / 0.75)]])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # top-k 3 then top-p 0.8: renormalised after top-k (0.5, 0.333, 0.167) the first two reach
    # 0.8; on the raw mass (0.45 + 0.3 = 0.75 < 0.8) a third token would be kept
    got = truncate_logits(logits, top_k=3, top_p=0.8).log_softmax(-1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # the label outside the support is kept (finite), renormalised with it
    kept = truncate_logits(logits, top_p=0.7, keep=torch.tensor([2])).log_softmax(-1)
    torch.testing.assert_close(kept[0, 2], torch.tensor(math.log(0.15 / 0.9)), atol=1e-6, rtol=0)
    assert kept[0, 0] == inf
    # both off: the same tensor back; tiny top_p: the top token alone
    assert truncate_logits(logits) is logits and truncate_logits(logits, top_k=4) is logits
    assert truncate_logits(logits, top_p=1e-6).isfinite().nonzero().tolist() == [[0, 1]]
    with pytest.raises(ValueError, match="top_k=-1"):
        truncate_logits(logits, top_k=-1)


def test_top_k_only_samples_from_the_k_most_likely():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(4000, 4)  # [B, V]
    gen = torch.Generator().manual_seed(0)
    drawn = sample_next_token(logits, temperature=1.0, top_p=1.0, generator=gen, top_k=2)
    assert set(drawn.tolist()) == {1, 3}
    counts = torch.bincount(drawn, minlength=4).float() / 4000
    torch.testing.assert_close(counts[[1, 3]], torch.tensor([0.625, 0.375]), atol=0.03, rtol=0)


def test_bad_arguments_raise(tiny):
    with pytest.raises(ValueError, match="empty prompt"):
        generate(tiny, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        generate(tiny, [[1, 2]], max_new_tokens=2, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k=-1"):
        generate(tiny, [[1, 2]], max_new_tokens=2, temperature=1.0, top_k=-1)


SMOL_CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
SMOL_IM_END = 2  # token id of "<|im_end|>"


@pytest.fixture(scope="module")
def smollm2():
    """The real SmolLM2-135M-Instruct (fp32): our model, transformers' model, the tokenizer."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from generator.assets import ensure_smollm2

    path = ensure_smollm2()
    model = build_model(ModelArgs.from_hf_config(read_hf_config(path)), device="meta")
    model.to_empty(device="cpu")
    model.init_rope()
    load_hf_checkpoint(model, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model.eval(), hf, Tokenizer.from_file(str(path / "tokenizer.json"))


def test_smollm2_logits_match_transformers(smollm2):
    model, hf, tokenizer = smollm2
    ids = torch.tensor([tokenizer.encode(SMOL_CHAT_PROMPT).ids])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_smollm2_answers_paris(smollm2):
    model, _, tokenizer = smollm2
    prompt = tokenizer.encode(SMOL_CHAT_PROMPT).ids
    out = generate(model, [prompt], max_new_tokens=8, stop_token_ids=[SMOL_IM_END])[0]
    assert "Paris" in tokenizer.decode(out), tokenizer.decode(out)


def test_sample_is_the_greedy_chatml_reply_and_keeps_the_mode(tiny_model_dir):
    """`sample` = `generate` on the ChatML user turn plus the assistant header, decoded; the
    model's train/eval mode is what it was."""
    from runtime import Tokenizer, sample

    model = build_model(ModelArgs.from_hf_config(read_hf_config(tiny_model_dir)), device="cpu")
    load_hf_checkpoint(model, tiny_model_dir)
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    prompt = "What is the capital of France?"
    ids = tokenizer.encode(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
    out = generate(
        model.eval(), [ids], 12, stop_token_ids=tokenizer.stop_token_ids, pad_token_id=0
    )[0]
    model.train()
    reply = sample(model, tokenizer, prompt, 12)
    assert reply == tokenizer.decode(out) and len(out) == 12  # (random weights: never stops)
    assert model.training
    model.eval()
    assert sample(model, tokenizer, prompt, 0) == "" and not model.training


def test_sample_smollm2_answers_paris(smollm2):
    from generator.assets import ensure_smollm2
    from runtime import Tokenizer, sample

    model, _, _ = smollm2
    reply = sample(model, Tokenizer.from_dir(ensure_smollm2()), "What is the capital of France?", 8)
    assert "Paris" in reply, reply
