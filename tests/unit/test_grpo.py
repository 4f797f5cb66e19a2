"""The GRPO task's pieces on a tiny Llama built from a config, with hand-built prompt batches and a stub config.

Checks the group-normalised advantages, the completion mask (up to and including EOS), the three loss
normalisations against their formulas, that iterations == 1 gives the plain policy gradient, that the per-token
log-probs equal a full fp64 log-softmax, that a completion does not depend on the other prompts of its batch or on
how a window is cut into micro-batches or ranks, that a rollout's metric sums reduce to the right numbers by name,
and the contract of the rollout state the train dataloader and the checkpoint object share.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from finetune.data import DataBundle
from finetune.data.batching import left_pad
from finetune.data.rows import IGNORE
from finetune.errors import ConfigError, RunDirError
from finetune.tasks.grpo import (
    GRPOTask,
    PolicyGenerator,
    Rollout,
    RolloutState,
    completion_logprobs,
    completion_mask,
    completion_seed,
    generation_metrics,
    group_advantages,
    policy_loss,
    sequences,
    step_layout,
    targets_of,
    token_logprobs,
)
from finetune.tasks.logprobs import FORWARD, next_token_targets

EOS, PAD = 2, 0
PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, 60, 61, 62, 63], [1, 70]]


def make_cfg(loss: str = "grpo", group: int = 3, new: int = 5, beta: float = 0.0, iterations: int = 1,
             micro: int = 2, global_batch: int = 4, world: int = 1) -> Any:
    """The recipe fields the GRPO task reads."""
    return SimpleNamespace(
        grpo=SimpleNamespace(group_size=group, max_new_tokens=new, temperature=1.0, top_p=1.0, beta=beta,
                             epsilon=0.2, iterations=iterations, loss=loss),
        train=SimpleNamespace(seed=3, global_batch_size=global_batch, micro_batch_size=micro),
        eval=SimpleNamespace(metrics=["exact_match"], batch_size=2),
        data=SimpleNamespace(shuffle=False, packing=False, num_workers=None),
        grad_accum=global_batch // (micro * world),
    )


class LengthReward:
    """Two reward functions: the completion's length in characters, and whether it contains a 'a'."""

    names = ("length", "has_a")
    weights = (1.0, 0.5)

    def score(self, prompts: list[str], completions: list[str], rows: list[dict], templated: list[bool]
              ) -> list[list[float]]:
        assert len(templated) == len(prompts)
        return [[float(len(c)) for c in completions], [float("a" in c) for c in completions]]

    def total(self, scores: list[list[float]]) -> list[float]:
        return [sum(w * s for w, s in zip(self.weights, column, strict=True)) for column in zip(*scores, strict=True)]


def bound_task(cfg: Any, model: Any, tok: Any, rank: int = 0, world: int = 1) -> GRPOTask:
    """A GRPOTask bound to ``model`` as prepare() binds it, with stub accelerator, precision and rewards."""
    task = GRPOTask(cfg, DataBundle(None, None, None), PAD, rank, world, tokenizer=SimpleNamespace(
        eos_token_id=EOS, decode=tok.decode))
    task.model = model
    task.accelerator = SimpleNamespace(device=torch.device("cpu"), unwrap_model=lambda m: m, num_processes=world)
    task.precision = SimpleNamespace(autocast=nullcontext)
    task.rewards = LengthReward()
    grpo = cfg.grpo
    task.generator = PolicyGenerator(model, task.precision, max_new_tokens=grpo.max_new_tokens,
                                     temperature=grpo.temperature, top_p=grpo.top_p, stop_ids=[EOS], pad_id=PAD,
                                     lockstep=False)
    return task


def prompt_batch(rows: list[list[int]]) -> dict[str, Any]:
    ids, mask = left_pad(rows, PAD)
    return {"prompt_ids": ids, "prompt_mask": mask, "prompts": [str(r) for r in rows],
            "rows": [{"answer": "x"} for _ in rows], "index": torch.arange(len(rows)), "templated": [False] * len(rows)}


def test_group_advantages() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    a, flat = group_advantages(rewards, 3, scale=True)
    assert a[:3].tolist() == pytest.approx([-1.0, 0.0, 1.0])  # sample std of (1, 2, 3) is 1
    assert a[3:].tolist() == [0.0, 0.0, 0.0] and flat.tolist() == [False, True]
    centred, _ = group_advantages(torch.tensor([0.0, 4.0, 7.0, 7.0]), 2, scale=False)  # dr_grpo: no std
    assert centred.tolist() == [-2.0, 2.0, 0.0, 0.0]


def test_completion_mask_keeps_tokens_up_to_and_including_the_first_eos() -> None:
    tokens = torch.tensor([[5, 6, EOS, PAD, PAD], [7, 8, 9, 10, 11], [EOS, PAD, PAD, PAD, PAD]])
    assert completion_mask(tokens, [EOS]).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_sequences_target_the_completion_only() -> None:
    batch = sequences(prompt_batch([[1, 9], [1, 8, 7]]), torch.tensor([[5, EOS, PAD], [6, 6, 6], [4, 4, EOS],
                                                                        [EOS, PAD, PAD]]), 2, [EOS], PAD)
    assert batch["input_ids"][0].tolist() == [PAD, 1, 9, 5, EOS, PAD]
    assert batch["labels"][0].tolist() == [IGNORE, IGNORE, IGNORE, 5, EOS, IGNORE]
    assert batch["attention_mask"][3].tolist() == [1, 1, 1, 1, 0, 0]
    assert batch["position_ids"][0].tolist() == [0, 0, 1, 2, 3, 3]


@pytest.mark.parametrize("kind", ["grpo", "token", "dr_grpo"])
def test_loss_normalisations(kind: str) -> None:
    """The sum each loss kind returns and the targets it counts give the formulas of the module docstring."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    logp = torch.randn(3, 4, dtype=torch.float64) * 0.1 - 1
    old = logp + torch.randn(3, 4, dtype=torch.float64) * 0.3
    ref = logp + torch.randn(3, 4, dtype=torch.float64) * 0.2
    adv = torch.tensor([1.5, -0.5, -1.0], dtype=torch.float64)
    eps, beta = 0.2, 0.1
    loss, stats = policy_loss(logp, old, ref, adv, mask, eps, beta, kind, 4)
    per = []
    for i in range(3):
        row = []
        for t in range(int(mask[i].sum())):
            r, a = math.exp(logp[i, t] - old[i, t]), float(adv[i])
            term = -min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
            d = float(ref[i, t] - logp[i, t])
            row.append(term + beta * (math.exp(d) - d - 1))
        per.append(row)
    expected = {"grpo": sum(sum(r) / len(r) for r in per), "token": sum(map(sum, per)),
                "dr_grpo": sum(map(sum, per))}[kind]
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert targets_of(kind, mask, 4) == {"grpo": 3, "token": 8, "dr_grpo": 12}[kind]
    assert float(stats["tokens"]) == 8


def test_one_iteration_is_the_policy_gradient() -> None:
    """old = logp.detach(): the ratio is 1 and the gradient is -A / len on each token (grpo), with no clipping."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    loss, stats = policy_loss(logp, logp.detach(), None, torch.tensor([2.0]), torch.tensor([[1, 1, 0]]), 0.2, 0.0,
                              "grpo", 3)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-2.0)
    assert logp.grad.tolist() == [[-1.0, -1.0, 0.0]]
    assert float(stats["clipped"]) == 0


def test_token_logprobs_equal_a_full_log_softmax(llama) -> None:
    batch = sequences(prompt_batch(PROMPTS[:2]), torch.tensor([[5, 6, EOS], [7, 8, 9], [3, EOS, PAD], [4, 4, 4]]),
                      2, [EOS], PAD)
    targets = next_token_targets(batch["labels"])
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    got = token_logprobs(llama, {**inputs, "use_cache": False}, targets, "lm_head")
    logits = llama(**inputs).logits.double()
    naive = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    naive = torch.where(targets != IGNORE, naive, 0.0)
    assert torch.allclose(got.double(), naive, atol=1e-5)
    window = completion_logprobs(llama, batch, FORWARD)
    assert window.shape == (4, 3)
    assert torch.allclose(window.double(), naive[:, -4:-1], atol=1e-5)


def test_a_completion_does_not_depend_on_its_batch(llama, tok) -> None:
    """The same prompt (same seeds) alone and in a left-padded batch of 4 samples the same tokens."""
    task = bound_task(make_cfg(new=6), llama, tok)
    seeds = [completion_seed(3, 0, p, j) for p in range(4) for j in range(3)]
    batch = prompt_batch(PROMPTS)
    ids, mask = batch["prompt_ids"].repeat_interleave(3, 0), batch["prompt_mask"].repeat_interleave(3, 0)
    together = task.generator.complete(ids, mask, seeds)
    for p in (0, 3):  # the longest prompt (no padding in the batch) and the shortest (the most)
        prompt = PROMPTS[p]
        alone_ids, alone_mask = left_pad([prompt] * 3, PAD)
        alone = task.generator.complete(alone_ids, alone_mask, seeds[3 * p:3 * p + 3])
        assert torch.equal(alone, together[3 * p:3 * p + 3])
    assert len({tuple(r) for r in together.tolist()}) > 4  # sampled: the group's completions differ
    assert llama.training is False


def test_the_generator_restores_train_mode(llama, tok) -> None:
    task = bound_task(make_cfg(), llama, tok)
    llama.train()
    try:
        ids, mask = left_pad([PROMPTS[0]], PAD)
        seen = []
        hook = llama.register_forward_pre_hook(lambda module, args: seen.append(module.training))
        task.generator.complete(ids, mask, [1])
        hook.remove()
        assert seen and not any(seen) and llama.training
    finally:
        llama.eval()


@pytest.mark.parametrize("micro,world", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_rollouts_do_not_depend_on_micro_batches_or_ranks(llama, tok, micro: int, world: int) -> None:
    """The window's completions, in global prompt order, are the same for 4x1, 2x2, 1x4 and 2 ranks: each
    completion's seed is (seed, step, its prompt's position in the global batch, its number in the group)."""
    def window(micro: int, world: int) -> torch.Tensor:
        out = []
        for rank in range(world):
            cfg = make_cfg(micro=micro, global_batch=4)
            task = bound_task(cfg, llama, tok, rank, world)
            share = 4 // world
            for i in range(share // micro):
                first = rank * share + i * micro
                out.append(task.rollout(prompt_batch(PROMPTS[first:first + micro]), 6, first).completions)
        return torch.cat(out)

    assert torch.equal(window(micro, world), window(4, 1))


def test_rollout_metrics(llama, tok) -> None:
    """The sums of a window reduce to the reward mean/std per function and total, zero-std groups, lengths."""
    task = bound_task(make_cfg(group=2, new=4), llama, tok)
    completions = torch.tensor([[5, EOS, PAD, PAD], [5, EOS, PAD, PAD], [6, 7, 8, 9], [6, 6, EOS, PAD]])
    rewards = torch.tensor([[1.0, 1.0, 4.0, 2.0], [0.0, 0.0, 1.0, 1.0]], dtype=torch.float64)
    sums = task.rollout_sums([Rollout(prompt_batch(PROMPTS[:2]), completions, rewards)])
    m = generation_metrics(sums, ["length", "has_a"])
    assert m["reward_length"] == pytest.approx(2.0)
    assert m["reward_length_std"] == pytest.approx(math.sqrt((1 + 1 + 4 + 0) / 4))
    total = [1.0, 1.0, 4.5, 2.5]
    assert m["reward"] == pytest.approx(sum(total) / 4)
    assert m["frac_zero_std"] == 0.5  # the first group's totals are equal
    assert m["completion_len"] == pytest.approx((2 + 2 + 4 + 3) / 4) and m["completion_len_max"] == 4
    assert m["truncated"] == 0.25  # the third: 4 tokens, no EOS


def test_the_rollout_state_serves_holds_and_restores_once() -> None:
    """The one owner of the rollout state: served metrics read back as often as the cycle's steps ask (none served:
    an error), a live batch held until released, a checkpoint's batch taken exactly once."""
    state = RolloutState()
    with pytest.raises(RuntimeError, match="without a generation batch"):
        state.served()
    sums = {"completions": torch.tensor([6.0], dtype=torch.float64)}
    state.serve(sums)
    assert state.served() is sums and state.served() is sums
    assert state.live() is None
    window = [Rollout(prompt_batch(PROMPTS[:1]), torch.tensor([[5, EOS]]), torch.tensor([[1.0]]))]
    state.hold(3, window)
    assert state.live() == (3, window)
    state.release()
    assert state.live() is None
    assert state.take_restored() is None
    rows = torch.full((2, 3), 7.0, dtype=torch.float64)
    state.restore(5, rows)
    cycle, taken = state.take_restored()
    assert cycle == 5 and taken is rows
    assert state.take_restored() is None  # once: a later generation never reads it again


RANK_SUMS = [  # two ranks' generation sums (functions length, has_a weighted 1 and 0.5; 3 new tokens) and loss sums
    {"reward": [6.0, 1.0, 6.5], "reward_squared": [20.0, 1.0, 22.25], "completions": [2.0], "zero_std_groups": [0.0],
     "groups": [1.0], "completion_tokens": [5.0], "truncated": [1.0], "length_histogram": [0.0, 0.0, 1.0, 1.0],
     "clipped": [1.0], "kl": [0.5], "tokens": [5.0]},  # rewards (2, 1), (4, 0): lengths 2 and 3 (no stop)
    {"reward": [6.0, 2.0, 7.0], "reward_squared": [18.0, 2.0, 24.5], "completions": [2.0], "zero_std_groups": [1.0],
     "groups": [1.0], "completion_tokens": [2.0], "truncated": [0.0], "length_histogram": [0.0, 2.0, 0.0, 0.0],
     "clipped": [0.0], "kl": [0.3], "tokens": [2.0]},  # rewards (3, 1), (3, 1): one token each
]
EXPECTED_ROW = {  # rewards length (2, 4, 3, 3), has_a (1, 0, 1, 1), totals (2.5, 4, 3.5, 3.5); lengths 2, 3, 1, 1
    "reward_length": 3.0, "reward_length_std": math.sqrt(0.5), "reward_has_a": 0.75,
    "reward_has_a_std": math.sqrt(0.1875), "reward": 3.375, "reward_std": math.sqrt(0.296875), "frac_zero_std": 0.5,
    "completion_len": 1.75, "completion_len_max": 3.0, "truncated": 0.25,
}


def test_named_metric_sums_round_trip_through_the_reduction() -> None:
    """Two ranks pack their sums by name into one vector each; summed (the all-reduce) and read back by name they
    give the step's totals, and the train row's metrics by their names; a producer out of step is refused."""
    layout = step_layout(2, 3)
    cpu = torch.device("cpu")
    ranks = [{k: torch.tensor(v, dtype=torch.float64) for k, v in sums.items()} for sums in RANK_SUMS]
    summed = layout.unpack(layout.pack(ranks[0], cpu) + layout.pack(ranks[1], cpu))
    assert {k: v.tolist() for k, v in summed.items()} == {
        "reward": [12.0, 3.0, 13.5], "reward_squared": [38.0, 3.0, 46.75], "completions": [4.0],
        "zero_std_groups": [1.0], "groups": [2.0], "completion_tokens": [7.0], "truncated": [1.0],
        "length_histogram": [0.0, 2.0, 1.0, 1.0], "clipped": [1.0], "kl": [pytest.approx(0.8)], "tokens": [7.0]}
    assert generation_metrics(summed, ["length", "has_a"]) == pytest.approx(EXPECTED_ROW)
    with pytest.raises(ValueError, match="do not match"):
        layout.pack({k: v for k, v in ranks[0].items() if k != "truncated"}, cpu)
    with pytest.raises(ValueError, match="'length_histogram' has 3 value"):
        layout.pack(ranks[0] | {"length_histogram": torch.zeros(3)}, cpu)


def test_step_metrics_reads_the_served_sums_in_one_reduction(llama, tok) -> None:
    """The task's step metrics: the batch it serves (rank 0 of RANK_SUMS, no loss sums yet) and the other rank's
    sums, added by the one reduction, give the train row by name (kl and clip fraction over the step's tokens)."""
    task = bound_task(make_cfg(group=2, new=3, beta=0.1), llama, tok)
    task.rollout_state.serve({k: torch.tensor(v, dtype=torch.float64) for k, v in RANK_SUMS[0].items()
                              if k not in ("clipped", "kl", "tokens")})
    other = step_layout(2, 3).pack({k: torch.tensor(v, dtype=torch.float64) for k, v in RANK_SUMS[1].items()},
                                   torch.device("cpu"))
    calls = []

    def reduce(vector: torch.Tensor) -> torch.Tensor:
        calls.append(vector)
        return vector + other

    row = task.step_metrics(reduce)
    assert len(calls) == 1 and calls[0].dtype == torch.float64
    assert row == pytest.approx(EXPECTED_ROW | {"clip_fraction": 0.0, "kl": 0.15})


def test_micro_batch_carries_advantages_and_counts(llama, tok) -> None:
    task = bound_task(make_cfg(group=2, new=4, loss="dr_grpo"), llama, tok)
    completions = torch.tensor([[5, EOS, PAD, PAD], [5, 6, EOS, PAD]])
    batch = task.micro_batch(Rollout(prompt_batch(PROMPTS[:1]), completions,
                                     torch.tensor([[1.0, 3.0], [0.0, 0.0]], dtype=torch.float64)))
    assert batch["advantages"].tolist() == [-1.0, 1.0]  # r - mean, no std
    assert task.count_targets(batch) == 2 * 4
    loss = task.train_output(llama, batch)
    assert loss.requires_grad and math.isfinite(float(loss.detach()))


def test_the_plan_counts_the_frozen_reference(tmp_path) -> None:
    """finetune plan: full fine-tuning with grpo.beta > 0 holds a frozen copy of the weights (one more line, the size
    of the parameters, sharded as they are on FSDP2 / ZeRO-3); LoRA's reference is the base with the adapter
    disabled (no line). A micro-batch of prompts trains on group_size sequences per prompt."""
    from finetune.config import load_recipe
    from finetune.runtime.plan import build_plan
    from tests.recipe_files import write_recipe_file

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a b", "answer": "b a"}\n')
    recipe = {"name": "g", "task": "grpo", "model": {"type": "tiny-llama"},
              "data": {"format": "prompt", "train": str(data), "max_seq_len": 64},
              "grpo": {"rewards": [{"exact_match": True}]}, "train": {"max_steps": 1}}
    path = write_recipe_file(tmp_path / "g.yaml", recipe, output_dir=str(tmp_path / "run"))
    plans = {overrides: build_plan(load_recipe(path, list(overrides))[0], devices=[])
             for overrides in ((), ("grpo.beta=0.1",), ("grpo.beta=0.1", "peft.method=lora"))}
    keys = {overrides: [item.key for item in plan.items] for overrides, plan in plans.items()}
    assert "grpo_reference" not in keys[()] and "grpo_reference" not in keys[("grpo.beta=0.1", "peft.method=lora")]
    full = plans[("grpo.beta=0.1",)]
    assert full.item("grpo_reference").per_rank_bytes == full.item("parameters").whole_bytes
    for backend in ("fsdp2", "zero3"):  # sharded as the parameters (finetune.backends.frozen_copy)
        sharded = build_plan(load_recipe(path, ["grpo.beta=0.1", f"launch.accelerate_config={backend}",
                                                "launch.num_processes=2"])[0], devices=[])
        reference, params = sharded.item("grpo_reference"), sharded.item("parameters")
        assert reference.shards == params.shards == 2 and reference.whole_bytes == params.whole_bytes, backend
        assert 0 <= 2 * reference.per_rank_bytes - params.whole_bytes <= 64, backend  # half, each tensor rounded up
    micro = load_recipe(path)[0].train.micro_batch_size
    assert full.activations.micro_batch_size == micro * 4  # its prompts x group_size (default 4)


def test_a_mid_cycle_generation_batch_resumes_on_another_world_size(llama, tok) -> None:
    """iterations 2: the generation batch a checkpoint saves inside a cycle is gathered from the ranks in global
    prompt order; 2 ranks x micro 1 saved, 1 process x micro 2 resumed serves exactly the micro-batches that 1
    process generates itself (the same completions, advantages and old log-probs)."""
    from finetune.tasks.grpo import RolloutCache, Rollouts

    def task_of(rank: int, world: int, micro: int) -> GRPOTask:
        task = bound_task(make_cfg(group=2, new=4, iterations=2, micro=micro, global_batch=4, world=world), llama,
                          tok, rank, world)
        share = 4 // world
        batches = [prompt_batch(PROMPTS[rank * share + i:rank * share + i + micro]) for i in range(0, share, micro)]
        task.prompt_loader = lambda start: iter(batches * 4)  # type: ignore[method-assign]
        return task

    ranks = [task_of(rank, 2, 1) for rank in range(2)]
    for task in ranks:
        stream = iter(task.build_dataloader("train"))
        [next(stream) for _ in range(2)]  # step 1 of cycle 0: the batch stays live for step 2
    lives = [task.rollout_state.live() for task in ranks]
    assert [live[0] for live in lives] == [0, 0]
    tables = [task.cache_rows(live[1]) for task, live in zip(ranks, lives, strict=True)]
    ranks[0].accelerator.num_processes = 2
    ranks[0].accelerator.gather = lambda table: torch.cat(tables)
    state = ranks[0].checkpoint_objects["grpo_rollouts"].state_dict()
    assert state["cycle"] == 0 and state["rows"].shape[0] == 4 * 2

    fresh_task = task_of(0, 1, 2)
    fresh = iter(Rollouts(fresh_task, fresh_task.rollout_state, 0))
    expected = [next(fresh) for _ in range(2)]
    resumed_task = task_of(0, 1, 2)
    resumed_task.generator = None  # it must not generate: the batch comes from the checkpoint
    RolloutCache(resumed_task, resumed_task.rollout_state).load_state_dict(state)
    resumed = iter(Rollouts(resumed_task, resumed_task.rollout_state, 4))  # the cursor after step 1 (batch 4)
    for want, got in zip(expected, [next(resumed) for _ in range(2)], strict=True):
        for key in ("input_ids", "labels", "attention_mask", "advantages"):
            assert torch.equal(want[key], got[key]), key
        assert torch.allclose(want["old_logps"], got["old_logps"], atol=1e-5)


def test_the_frozen_reference_comes_from_the_backend(llama, tok) -> None:
    """Full fine-tuning with beta > 0: the reference is what the worker's frozen_copy (finetune.backends)
    returns, scored inside its context (FSDP2 / ZeRO-3: the policy with the copy's shards swapped in); a task given
    none refuses to deep-copy sharded parameters (one ConfigError before training). Off the sharded backends the
    copy is taken and frozen."""
    from finetune.errors import ConfigError

    cfg = make_cfg(beta=0.1)
    cfg.grpo.rewards = []
    accelerator = SimpleNamespace(device=torch.device("cpu"), unwrap_model=lambda m: m, num_processes=2)
    sharded = GRPOTask(cfg, DataBundle(None, None, None), PAD, 0, 2, lockstep=True, tokenizer=tok)
    with pytest.raises(ConfigError, match=r"grpo\.beta > 0 with full fine-tuning"):
        sharded.prepare(lambda: llama, accelerator, SimpleNamespace(autocast=nullcontext), print)
    entered = []

    class Swapped:
        def __enter__(self) -> None:
            entered.append(True)

        def __exit__(self, *exc: object) -> None:
            return None

    given = GRPOTask(cfg, DataBundle(None, None, None), PAD, 0, 2, lockstep=True, tokenizer=tok,
                     frozen_copy=lambda model: (model, Swapped))
    given.prepare(lambda: llama, accelerator, SimpleNamespace(autocast=nullcontext), print)
    reference, context = given.reference_model()
    assert reference is llama and not entered
    with context:
        assert entered
    plain = GRPOTask(cfg, DataBundle(None, None, None), PAD, 0, 1, tokenizer=tok)
    plain.prepare(lambda: llama, accelerator, SimpleNamespace(autocast=nullcontext), print)
    assert plain.reference is not llama and not any(p.requires_grad for p in plain.reference.parameters())
    assert all(torch.equal(a, b) for a, b in zip(plain.reference.state_dict().values(),
                                                 llama.state_dict().values(), strict=True))


def test_fsdp1_full_fine_tune_with_beta_is_one_line_at_validation(tmp_path) -> None:
    """The frozen reference is built on every backend but FSDP1 (flat parameters): there, full fine-tuning with
    grpo.beta > 0 is one line when the recipe is validated (finetune run --dry-run, before any tokenizing) naming
    the key, the backend and the ways out; fsdp2, zero3, LoRA and beta 0 validate."""
    from finetune.config import load_recipe
    from finetune.errors import ConfigError
    from tests.recipe_files import write_recipe_file

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a b", "answer": "b a"}\n')
    recipe = {"name": "g", "task": "grpo", "model": {"type": "tiny-llama"},
              "data": {"format": "prompt", "train": str(data), "max_seq_len": 64},
              "grpo": {"rewards": [{"exact_match": True}], "beta": 0.1}, "train": {"max_steps": 1},
              "launch": {"num_processes": 2}}
    path = write_recipe_file(tmp_path / "g.yaml", recipe, output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError) as info:
        load_recipe(path, ["launch.accelerate_config=fsdp1"])
    assert str(info.value).splitlines() == [
        "grpo.beta=0.1 with full fine-tuning needs a frozen reference copy, which is not built under FSDP1 "
        "(launch.accelerate_config=fsdp1); use launch.accelerate_config=fsdp2 or zero3, peft (LoRA: the base with "
        "the adapter disabled), or grpo.beta=0"]
    for overrides in (["launch.accelerate_config=fsdp2"], ["launch.accelerate_config=zero3"],
                      ["launch.accelerate_config=fsdp1", "peft.method=lora"],
                      ["launch.accelerate_config=fsdp1", "grpo.beta=0"]):
        load_recipe(path, overrides)


def test_every_logprob_is_scored_at_the_sampling_temperature(llama, tok) -> None:
    """grpo.temperature 0.7: the old log-probs (iterations 2), the reference's (beta > 0) and the policy's in the
    loss are each log_softmax(logits / 0.7) at the completion token, computed here by hand from the models' full
    logits; the loss and its gradient equal the clipped surrogate + k3 KL written out plainly on those log-probs.
    The policy has moved off the weights that generated (as on a cycle's second step), so the ratio is not 1."""
    import copy

    temperature, eps, beta = 0.7, 0.2, 0.1
    cfg = make_cfg(group=3, new=5, beta=beta, iterations=2)
    cfg.grpo.temperature = temperature
    task = bound_task(cfg, llama, tok)
    reference = copy.deepcopy(llama)
    with torch.no_grad():  # a reference that differs from the sampler, so the KL term is not ~0
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
    task.reference = reference
    rollout = task.rollout(prompt_batch(PROMPTS[:2]), 0, 0)
    batch = task.micro_batch(rollout)
    width = rollout.completions.size(1)
    start = batch["input_ids"].size(1) - width - 1  # the logits at `start + j` predict completion token j
    mask = batch["completion_mask"].bool()

    def by_hand(model: Any) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, start:start + width]
        picked = torch.log_softmax(logits / temperature, -1).gather(-1, rollout.completions[..., None])[..., 0]
        return torch.where(mask, picked, 0.0)

    with torch.no_grad():
        old, ref = by_hand(llama), by_hand(reference)
    assert mask.sum() > mask.size(0)  # completions of more than one token
    torch.testing.assert_close(rollout.old, old, rtol=0, atol=1e-6)
    torch.testing.assert_close(rollout.ref, ref, rtol=0, atol=1e-6)

    policy = copy.deepcopy(llama)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
    twin = copy.deepcopy(policy)
    loss = task.train_output(policy, batch)
    loss.backward()
    logp = by_hand(twin)
    advantage = batch["advantages"][:, None]
    ratio = torch.exp(logp - old)
    surrogate = -torch.minimum(ratio * advantage, ratio.clamp(1 - eps, 1 + eps) * advantage)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_token = torch.where(mask, surrogate + beta * kl, 0.0)
    expected = (per_token.sum(1) / mask.sum(1)).sum()  # grpo: each completion's mean over its tokens, summed
    expected.backward()
    assert float(task._sums["clipped"]) > 0  # the clip is exercised
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    for (name, got), want in zip(policy.named_parameters(), twin.parameters(), strict=True):
        scale = want.grad.norm()
        assert (got.grad - want.grad).norm() <= 1e-5 * scale, name


def _saved_batch(cycle: int, last_id: float = 511.0) -> dict[str, Any]:
    """A generation batch as a mid-cycle checkpoint of :func:`make_cfg` (group 2, 4 new tokens, iterations 2, global
    batch 4) holds it: 8 rows of 4 completion ids (the last one ``last_id``), 2 rewards and 4 old log-probs."""
    ids = torch.tensor([[5.0, 6.0, 7.0, last_id]]).repeat(8, 1)
    return {"cycle": cycle, "rows": torch.cat([ids, torch.ones(8, 2), torch.full((8, 4), -1.5)], 1).double()}


@pytest.mark.parametrize("held,samples,outcome", [
    (_saved_batch(1), 12, []),  # step 3 is inside cycle 1: its batch
    (_saved_batch(1), 8, []),  # step 2 ends cycle 0: the next step generates anew, whatever was saved
    ({"cycle": -1}, 8, []),
    (None, 8, []),  # no file at a cycle's end (nothing to save)
    (None, 12, ["needs the checkpoint's saved generation batch"]),
    ({"cycle": -1}, 12, ["needs the checkpoint's saved generation batch"]),
    (_saved_batch(0), 12, ["is of cycle 0, the run resumes inside cycle 1"]),
    (_saved_batch(1, last_id=512.0), 12, ["completion token id 512.0, not a whole number in [0, 512)"]),
    ({"cycle": True}, 12, ["its cycle is True"]),
    ({"cycle": 1}, 12, ["holds cycle, not cycle, rows"]),
    (_saved_batch(1), 10, ConfigError),  # a cursor between steps: another global batch than the run's
], ids=["inside-its-cycle", "at-a-cycle-end", "none-saved-at-a-cycle-end", "no-file-at-a-cycle-end",
        "no-file-inside-a-cycle", "none-saved-inside-a-cycle", "another-cycle", "token-at-the-vocabulary",
        "cycle-a-bool", "no-rows", "cursor-between-steps"])
def test_the_saved_generation_batch_is_judged_against_the_recipe_and_the_resumed_step(
        llama, tok, held: dict[str, Any] | None, samples: int, outcome: Any) -> None:
    """What a checkpoint holds for grpo_rollouts is judged before a resume loads anything: the table this recipe
    writes, with token ids below the model's vocabulary (512 here, from its embeddings), and the batch of the cycle
    the resumed step is inside (none needed at a cycle's end); a cursor that is no whole step is the recipe's
    mistake (a changed global batch), and load_state_dict refuses what the judge refuses."""
    from finetune.tasks.grpo import RolloutCache

    task = bound_task(make_cfg(group=2, new=4, iterations=2, global_batch=4), llama, tok)
    cache = RolloutCache(task, task.rollout_state)
    if outcome is ConfigError:
        with pytest.raises(ConfigError, match="not a whole number of steps"):
            cache.restored_problems(held, {"samples_seen": samples})
        return
    found = cache.restored_problems(held, {"samples_seen": samples})
    assert len(found) == len(outcome) and all(want in got for want, got in zip(outcome, found, strict=True)), found
    if held is not None and cache.problems(held):
        with pytest.raises(RunDirError, match=r"grpo_rollouts\.json"):
            cache.load_state_dict(held)
