"""SimPO, ORPO and KTO in the emitted DPO scripts (`--loss_type simpo | orpo | kto`): each loss
equals its closed form on hand-made log-probs (plain float math here), SimPO and ORPO build no
reference of any kind, two micro-batches give the gradients of one (KTO's z_ref included: one
value per optimizer step), the memory tricks change none of it, and a short run on real
preference pairs ranks the chosen replies higher."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

from generator.render import render
from generator.spec import Spec
from runtime import ConfigError, Tokenizer
from tests.helpers import import_script, read_metrics, two_step_args

REPO = Path(__file__).resolve().parents[2]
NEW_LOSSES = ("simpo", "orpo", "kto")


@pytest.fixture(scope="module")
def dpo_script():
    return import_script(REPO / "examples" / "dpo_smollm2" / "train.py", "pref_dpo_smollm2_train")


@pytest.fixture(scope="module")
def dpo_lora_script():
    return import_script(
        REPO / "examples" / "dpo_lora_smollm2" / "train.py", "pref_dpo_lora_smollm2_train"
    )


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


# token log-probs of hand-made replies: (chosen, rejected) per pair; one-token replies, equal
# replies, and a chosen reply the policy is nearly sure of (mean log-prob -1e-6: p ~ 1)
PAIRS = [
    ([-0.5, -1.25, -2.0], [-1.5, -3.0]),
    ([-0.75], [-2.5]),  # one token each
    ([-1.0, -2.0], [-1.0, -2.0]),  # equal chosen and rejected
    ([-2.25, -0.25, -1.0, -0.5], [-0.125]),  # the rejected one is the likelier
    ([-1e-6], [-0.75, -0.25]),  # one token, p = exp(-1e-6)
]


def _mean_logps(pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """[P] per-token mean log-probs as the script's pair_losses makes them: the sum over the
    reply's tokens divided by its token count (so one-token replies go through the same path)."""
    chosen = torch.tensor([sum(c) for c, _ in pairs]) / torch.tensor([len(c) for c, _ in pairs])
    rejected = torch.tensor([sum(r) for _, r in pairs]) / torch.tensor([len(r) for _, r in pairs])
    return chosen, rejected


@pytest.mark.fast
def test_simpo_loss_equals_closed_form(dpo_script):
    """-log sigmoid(beta * (mean_c - mean_r) - gamma), cDPO-smoothed; rewards beta * mean.
    Equal replies lose log(1 + e^gamma) whatever beta is."""
    chosen, rejected = _mean_logps(PAIRS)
    for beta, gamma, eps in ((2.0, 0.5, 0.0), (2.5, 1.0, 0.1), (0.5, 0.0, 0.0)):
        want = []
        for c, r in PAIRS:
            z = beta * (_mean(c) - _mean(r)) - gamma
            want.append(-(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z))
        losses, rc, rr = dpo_script.simpo_loss(chosen, rejected, beta, gamma, eps)
        torch.testing.assert_close(losses, torch.tensor(want), msg=f"{beta=} {gamma=} {eps=}")
        torch.testing.assert_close(rc, torch.tensor([beta * _mean(c) for c, _ in PAIRS]))
        torch.testing.assert_close(rr, torch.tensor([beta * _mean(r) for _, r in PAIRS]))
    assert losses[2].item() == pytest.approx(math.log(2), abs=1e-6)  # gamma 0, equal replies
    losses, _, _ = dpo_script.simpo_loss(chosen, rejected, 2.0, 0.5)
    assert losses[2].item() == pytest.approx(math.log1p(math.exp(0.5)), abs=1e-6)


@pytest.mark.fast
def test_orpo_loss_equals_closed_form(dpo_script):
    """mean NLL of chosen - lambda * log sigmoid(log odds_c - log odds_r), odds = p / (1 - p), p
    the reply's length-normalised probability; finite with a finite gradient at p ~ 1, where
    log1p(-exp(log p)) alone would round 1 - p to 0 in fp32."""
    lam = 0.1

    def log_odds(mean: float) -> float:
        p = math.exp(mean)
        return math.log(p / (1 - p)) if p < 0.5 else mean - math.log(-math.expm1(mean))

    want_losses, want_log_odds = [], []
    for c, r in PAIRS:
        h = log_odds(_mean(c)) - log_odds(_mean(r))
        want_log_odds.append(h)
        want_losses.append(-_mean(c) - lam * _log_sigmoid(h))
    chosen, rejected = _mean_logps(PAIRS)
    chosen.requires_grad_(True)
    losses, rc, rr, got_log_odds = dpo_script.orpo_loss(chosen, rejected, lam)
    torch.testing.assert_close(losses, torch.tensor(want_losses), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_log_odds, torch.tensor(want_log_odds), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rc, lam * chosen.detach())
    torch.testing.assert_close(rr, lam * rejected)
    assert got_log_odds[2].item() == 0.0  # equal replies: odds ratio 1, L_OR = log 2
    assert losses[2].item() == pytest.approx(1.5 + lam * math.log(2), abs=1e-6)
    losses.sum().backward()
    assert torch.isfinite(chosen.grad).all(), chosen.grad
    # the form it replaces, near p = 1: fp32 rounds exp(-1e-6) to a neighbour of 1
    naive = torch.log1p(-torch.exp(torch.tensor(-1e-6)))
    assert abs(naive.item() - math.log(1e-6)) > 1e-2
    # closer still (exp(-1e-9) is 1 in fp32): value and gradient stay finite, and equal
    # log(1 - e^x) = log(-x) + O(x) and its derivative 1/x
    x = torch.tensor([-1e-9, -1e-7, -2.0], requires_grad=True)
    y = dpo_script.log1mexp(x)
    y.sum().backward()
    torch.testing.assert_close(y[:2], torch.log(-x[:2].detach()), rtol=1e-5, atol=1e-5)
    assert torch.isfinite(x.grad).all(), x.grad
    torch.testing.assert_close(x.grad[:2], 1 / x[:2].detach(), rtol=1e-3, atol=0.0)


@pytest.mark.fast
def test_kto_loss_equals_closed_form(dpo_script):
    """lambda_D (1 - sigmoid(beta (h - z))) for a desirable example, lambda_U (1 - sigmoid(beta
    (z - h))) for an undesirable one, h = policy - reference log-prob; also in batches of one
    label only, and 1/2 each (times its weight) where the policy is the reference and z = 0."""
    policy = [-12.0, -4.5, -30.0, -7.25, -1.0]
    ref = [-11.0, -5.0, -28.0, -7.25, -3.0]
    beta, z, wd, wu = 0.1, 0.75, 1.0, 1.5

    def want(labels, beta=beta, z=z):
        out = []
        for p, q, d in zip(policy, ref, labels, strict=True):
            h = p - q
            out.append(
                wd * (1 - _sigmoid(beta * (h - z))) if d else wu * (1 - _sigmoid(beta * (z - h)))
            )
        return out

    P, R = torch.tensor(policy), torch.tensor(ref)
    for labels in ([True, False, True, False, True], [True] * 5, [False] * 5):
        losses, rewards = dpo_script.kto_loss(
            P, R, torch.tensor(labels), torch.tensor(z), beta, wd, wu
        )
        torch.testing.assert_close(losses, torch.tensor(want(labels)), msg=str(labels))
        torch.testing.assert_close(rewards, beta * (P - R))
    losses, _ = dpo_script.kto_loss(
        P, P, torch.tensor([True, False] * 2 + [True]), torch.tensor(0.0), beta, wd, wu
    )
    torch.testing.assert_close(losses, torch.tensor([0.5 * wd, 0.5 * wu] * 2 + [0.5 * wd]))


# --- the scripts on the tiny model -------------------------------------------------------------


def _config(script, model_dir, data, **overrides):
    settings = dict(
        model=str(model_dir), dataset=str(data), dtype="fp32", device="cpu", max_seq_len=192,
        micro_batch_size=2, warmup_steps=0, val_fraction=0.0, lr=1e-2, max_grad_norm=0.0,
    )  # fmt: skip
    cfg = script.Config(**{**settings, **overrides})
    script.validate(cfg)
    return cfg


class _GradCapture:
    """An optimizer for train_step that records the step's gradients instead of stepping."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def step(self):
        self.grads = {
            n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None
        }

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


class _NoSchedule:
    def get_last_lr(self):
        return [0.0]

    def step(self):
        pass


def _step_grads(script, model, ref_cache, micro_batches, cfg):
    """train_step's gradients (its metrics too) over `micro_batches`, the model left unchanged."""
    optimizer = _GradCapture(model)
    metrics = script.train_step(
        model, None, ref_cache, optimizer, _NoSchedule(), micro_batches, cfg, torch.device("cpu")
    )
    return optimizer.grads, metrics


def _kto_setup(script, tiny_model_dir, short_pairs):
    """The policy, its 8 KTO examples (4 pairs unpaired) and a precomputed reference table made
    from the policy's own log-probs: reference = policy - offset, so each example's log-ratio is
    its offset exactly (completions: `d`, KL sequences: `c`), and z_ref is known in closed form."""
    cfg = _config(script, tiny_model_dir, short_pairs, loss_type="kto", ref_mode="precomputed")
    dist_info, mesh = script.setup_distributed(cfg)
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    train_set, _ = script.build_kto_datasets(cfg, tokenizer)
    model = script.setup_model(cfg, Path(tiny_model_dir), mesh, dist_info.device)
    collate = functools.partial(script.collate_kto, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        logps = script.sequence_logprobs(model, collate(train_set), cfg)[0]  # [2E]
    E = len(train_set)
    d = torch.tensor([0.5, -1.0, 2.0, 0.25, -0.5, 1.5, 0.75, -2.0])  # completions
    c = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0, 0.5, 1.0, 0.5])  # KL sequences: mean 1.25
    table = torch.zeros(E, 2)
    ids = torch.tensor([ex["id"] for ex in train_set])
    table[ids, 0], table[ids, 1] = logps[:E] - d, logps[E:] - c
    return cfg, model, train_set, collate, table, c


def test_kto_examples_unpair_the_pairs_and_borrow_the_next_completion(
    dpo_script, tiny_model_dir, short_pairs
):
    """4 pairs -> 8 examples: the chosen replies (desirable), then the rejected ones; an example's
    KL sequence is its own prompt with the next example's completion."""
    s = dpo_script
    _, _, train_set, collate, _, _ = _kto_setup(s, tiny_model_dir, short_pairs)
    assert [ex["desirable"] for ex in train_set] == [True] * 4 + [False] * 4
    assert [ex["id"] for ex in train_set] == list(range(8))
    for i, ex in enumerate(train_set):
        nxt = train_set[(i + 1) % 8]
        # the same prompt tokens, then the next example's reply tokens
        first = next(t for t, y in enumerate(ex["kl"]["labels"]) if y != -100)
        assert ex["kl"]["input_ids"][: first + 1] == ex["completion"]["input_ids"][: first + 1]
        reply = [y for y in ex["kl"]["labels"] if y != -100]
        assert reply == [y for y in nxt["completion"]["labels"] if y != -100]
    batch = collate(train_set[:2])
    assert batch["input_ids"].shape[0] == 4 and batch["desirable"].tolist() == [True, True]


def test_kto_reference_point_is_the_steps_mean_kl_ratio_clamped_at_zero(
    dpo_script, tiny_model_dir, short_pairs
):
    s = dpo_script
    cfg, model, train_set, collate, table, c = _kto_setup(s, tiny_model_dir, short_pairs)
    halves = [collate(train_set[:4]), collate(train_set[4:])]
    z, refs = s.kto_reference_point(model, None, table, halves, cfg, torch.device("cpu"))
    assert z.item() == pytest.approx(c.mean().item(), abs=1e-5)  # over both micro-batches
    torch.testing.assert_close(torch.cat(refs), table[:, 0])
    z_first, _ = s.kto_reference_point(model, None, table, halves[:1], cfg, torch.device("cpu"))
    # a per-micro-batch z would differ; fp32 sums of the pairs' log-probs: 1.5e-5 from 2.0 on an
    # AMD EPYC, whose kernels round differently from the machine this bound was set on
    assert z_first.item() == pytest.approx(2.0, abs=5e-5)
    negative = table.clone()
    negative[:, 1] += 2 * c  # log-ratios -c: a negative mean KL is clamped to 0
    z, _ = s.kto_reference_point(model, None, negative, halves, cfg, torch.device("cpu"))
    assert z.item() == 0.0


@pytest.mark.parametrize("loss_type", NEW_LOSSES)
def test_two_micro_batches_give_the_gradients_of_one(
    dpo_script, tiny_model_dir, short_pairs, loss_type
):
    """train_step over 1 micro-batch of 4 pairs (KTO: 8 examples) and over 2 of half the size:
    the same gradients within 1e-6 and the same metrics. For KTO z_ref is taken over the whole
    step, so it is the same number both ways (the halves' own estimates differ: 2.0 and 0.5)."""
    s = dpo_script
    tok = Tokenizer.from_dir(tiny_model_dir)
    if loss_type == "kto":
        cfg, model, examples, collate, table, _ = _kto_setup(s, tiny_model_dir, short_pairs)
    else:
        cfg = _config(s, tiny_model_dir, short_pairs, loss_type=loss_type)
        dist_info, mesh = s.setup_distributed(cfg)
        examples, _ = s.build_datasets(cfg, tok)
        model = s.setup_model(cfg, Path(tiny_model_dir), mesh, dist_info.device)
        collate, table = functools.partial(s.collate, pad_token_id=tok.pad_token_id), None
    n = len(examples) // 2
    one, one_metrics = _step_grads(s, model, table, [collate(examples)], cfg)
    two, two_metrics = _step_grads(
        s, model, table, [collate(examples[:n]), collate(examples[n:])], cfg
    )
    assert one.keys() == two.keys() and len(one) > 0
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-6, rtol=0, msg=name)
    assert max(g.abs().max().item() for g in one.values()) > 1e-4  # gradients worth comparing
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"):
        assert two_metrics[key] == pytest.approx(one_metrics[key], abs=1e-6), key
    if loss_type == "kto":
        assert one_metrics["kl"] == pytest.approx(1.25, abs=1e-5)
        assert two_metrics["kl"] == pytest.approx(1.25, abs=1e-5)
        assert one_metrics["count/chosen"] == 4 and one_metrics["num_examples"] == 8
    if loss_type == "orpo":
        assert {"nll_loss", "log_odds_ratio", "log_odds_chosen"} <= set(one_metrics)


def _no_reference(script, monkeypatch):
    """Make every way to a reference fail, and count the models the script builds."""
    built = []
    real_build_model = script.build_model

    def build_model(*args, **kwargs):
        built.append(1)
        return real_build_model(*args, **kwargs)

    def refuse(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"{name} called by a reference-free loss")

        return fail

    monkeypatch.setattr(script, "build_model", build_model)
    for name in ("build_reference", "setup_frozen_model", "frozen_cpu_copy", "reference_logprobs",
                 "load_reference_logprobs", "reference_side", "base_logprobs"):  # fmt: skip
        if hasattr(script, name):
            monkeypatch.setattr(script, name, refuse(name))
    return built


@pytest.mark.parametrize(("algo", "loss_type"), [("dpo", "simpo"), ("dpo-lora", "orpo")])
def test_reference_free_losses_build_no_reference(
    dpo_script, dpo_lora_script, tiny_model_dir, short_pairs, tmp_path, monkeypatch, capsys,
    algo, loss_type,
):  # fmt: skip
    """2 steps on the tiny model with the script's default ref_mode (dpo: separate, dpo-lora:
    adapters-off): one model is built, and no reference is built, loaded, precomputed or scored
    (the policy with its adapters off included); the metrics carry TRL's names."""
    script = dpo_script if algo == "dpo" else dpo_lora_script
    built = _no_reference(script, monkeypatch)
    out = tmp_path / "out"
    script.main([
        "--model", str(tiny_model_dir), "--dataset", str(short_pairs), "--out_dir", str(out),
        "--device", "cpu", "--dtype", "fp32", "--max_seq_len", "192", "--micro_batch_size", "2",
        "--max_steps", "2", "--warmup_steps", "0", "--lr", "1e-3", "--val_fraction", "0.25",
        "--eval_every_steps", "0", "--sample_max_new_tokens", "0", "--loss_type", loss_type,
        *(["--save_merged", "false"] if algo == "dpo-lora" else []),
    ])  # fmt: skip
    assert built == [1]
    assert not (out / "reference_logps.pt").exists()
    assert f"loss: {loss_type} | reference: none |" in capsys.readouterr().out
    rows = [r for r in read_metrics(out) if "loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    keys = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected", "val_loss", "val_rewards/accuracies"}  # fmt: skip
    if loss_type == "orpo":
        keys |= {"nll_loss", "log_odds_ratio", "log_odds_chosen"}
    assert keys <= set(rows[-1]), set(rows[-1])


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["simpo", "kto"])
def test_resume_continues_exactly(dpo_script, tiny_model_dir, short_pairs, tmp_path, loss_type):
    """4 steps straight == 2 steps, stop, resume to 4: SimPO with no reference file at all; KTO
    with its precomputed table of (completion, KL sequence) log-probs read back on resume."""
    common = [
        "--model", str(tiny_model_dir), "--dataset", str(short_pairs), "--device", "cpu",
        "--dtype", "fp32", "--max_seq_len", "192", "--micro_batch_size", "2", "--warmup_steps",
        "0", "--lr", "1e-2", "--min_lr_ratio", "1.0", "--val_fraction", "0",
        "--eval_every_steps", "0", "--sample_max_new_tokens", "0", "--save_every_steps", "2",
        "--loss_type", loss_type, *(["--ref_mode", "precomputed"] if loss_type == "kto" else []),
    ]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    dpo_script.main([*common, "--out_dir", str(straight), "--max_steps", "4"])
    dpo_script.main([*common, "--out_dir", str(resumed), "--max_steps", "2"])
    dpo_script.main([*common, "--out_dir", str(resumed), "--max_steps", "4"])
    want = {r["step"]: r for r in read_metrics(straight) if "loss" in r}
    got = {r["step"]: r for r in read_metrics(resumed) if "loss" in r}
    for step in (3, 4):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-6)
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-5)
    assert (resumed / "reference_logps.pt").exists() == (loss_type == "kto")


def test_reference_options_and_other_losses_fields_are_refused(dpo_script):
    s = dpo_script
    cases = [
        ({"loss_type": "simpo", "ref_mode": "precomputed"}, r"ref_mode='precomputed' with loss_type='simpo': simpo uses no reference"),
        ({"loss_type": "orpo", "ref_device": "cpu"}, r"ref_device='cpu' with loss_type='orpo'"),
        ({"loss_type": "orpo", "beta": 0.2}, r"ORPO has no beta, its odds-ratio weight is orpo_lambda"),
        ({"loss_type": "kto", "simpo_gamma": 1.0}, r"simpo_gamma=1.0 applies to loss_type='simpo' only"),
        ({"loss_type": "sigmoid", "desirable_weight": 2.0}, r"desirable_weight=2.0 applies to loss_type='kto'"),
        ({"loss_type": "kto", "label_smoothing": 0.1}, r"applies to loss_type sigmoid and simpo only"),
    ]  # fmt: skip
    for fields, message in cases:
        with pytest.raises(ConfigError, match=message):
            s.validate(s.Config(**fields))
    assert s.Config(loss_type="simpo").beta == 2.0 and s.Config(loss_type="kto").beta == 0.1
    assert s.Config(loss_type="orpo").beta is None and s.Config(beta=0.3).beta == 0.3
    s.validate(s.Config(loss_type="simpo", label_smoothing=0.1, simpo_gamma=1.0))


def test_kto_with_packing_is_refused_in_one_line(tmp_path):
    path = tmp_path / "dpo_packing.py"
    path.write_text(render(Spec(algo="dpo", tricks=("packing",), out="run")))
    script = import_script(path, "pref_dpo_packing")
    assert not hasattr(script, "kto_losses")  # KTO's functions are rendered without packing only
    with pytest.raises(ConfigError, match=r"loss_type='kto' with trick packing: not built yet"):
        script.validate(script.Config(loss_type="kto"))


# --- the tricks -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, tiny_model_dir, short_pairs):
    """two_steps(tricks, loss_type) -> [(loss, grad_norm)] x 2 of main(), cached."""
    cache: dict = {}

    def get(tricks: tuple, loss_type: str) -> list[tuple[float, float]]:
        if (tricks, loss_type) not in cache:
            tmp = tmp_path_factory.mktemp(f"pref_{'_'.join(tricks) or 'plain'}_{loss_type}")
            path = tmp / "train.py"
            path.write_text(render(Spec(algo="dpo", tricks=tricks, out="run")))
            script = import_script(path, f"pref_{tmp.name.replace('-', '_')}")
            out = tmp / "out"
            args = two_step_args(out, tiny_model_dir, short_pairs, max_seq_len=192)
            args[args.index("--micro_batch_size") + 1] = "1"  # 4 pairs: 2 steps of 2 x 1
            torch.manual_seed(0)
            script.main([*args, "--loss_type", loss_type])
            cache[tricks, loss_type] = [(r["loss"], r["grad_norm"]) for r in read_metrics(out)]
        return cache[tricks, loss_type]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", NEW_LOSSES)
def test_exact_tricks_give_the_plain_losses(two_steps, loss_type):
    """ac, lce and optim-in-bwd together (KTO's no-grad KL pass runs through the checkpointed
    blocks, the chunked log-probs and the optimizer's two backward passes) give the plain
    script's 2 losses and gradient norms within 1e-5."""
    plain, got = two_steps((), loss_type), two_steps(("ac", "lce", "optim-in-bwd"), loss_type)
    assert plain[1][0] != plain[0][0]
    for (gl, gn), (pl, pn) in zip(got, plain, strict=True):
        assert gl == pytest.approx(pl, abs=1e-5) and gn == pytest.approx(pn, rel=1e-5, abs=1e-5)


# --- learning ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", NEW_LOSSES)
def test_short_run_on_real_pairs_ranks_chosen_higher(
    dpo_script, tiny_model_dir, short_pairs, tmp_path, loss_type
):
    """6 steps of the tiny model on 4 real dpo_en_demo pairs (each step sees all of them: 2
    micro-batches; KTO's 8 examples, 4 desirable and 4 undesirable, reference precomputed): the
    reward margin of chosen over rejected grows and the loss falls. SimPO and ORPO start from
    the untrained policy's own margin; KTO from 0 (the policy is the reference at step 1)."""
    out = tmp_path / "out"
    dpo_script.main([
        "--model", str(tiny_model_dir), "--dataset", str(short_pairs), "--out_dir", str(out),
        "--device", "cpu", "--dtype", "fp32", "--max_seq_len", "192",
        "--micro_batch_size", "4" if loss_type == "kto" else "2", "--gradient_accumulation_steps", "2",
        "--max_steps", "6", "--warmup_steps", "0", "--lr", "1e-3", "--min_lr_ratio", "1.0",
        "--val_fraction", "0", "--eval_every_steps", "0", "--sample_max_new_tokens", "0",
        "--loss_type", loss_type, *(["--ref_mode", "precomputed"] if loss_type == "kto" else []),
    ])  # fmt: skip
    rows = [r for r in read_metrics(out) if "loss" in r]
    margins = [r["rewards/margins"] for r in rows]
    assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"]
    assert margins[-1] > margins[0] and margins == sorted(margins), margins
    if loss_type == "kto":
        assert margins[0] == 0.0 and margins[-1] > 1.0, margins
        assert rows[-1]["rewards/chosen"] > 0 > rows[-1]["rewards/rejected"]
        assert rows[-1]["count/chosen"] == rows[-1]["count/rejected"] == 4
    else:
        assert rows[0]["rewards/accuracies"] < 0.5 and rows[-1]["rewards/accuracies"] >= 0.75
