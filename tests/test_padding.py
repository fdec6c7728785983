"""Padding policies: registry, compose(), and check() catching every broken invariant."""
from __future__ import annotations

import numpy as np
import pytest

import fullgraph as fg
from fullgraph.padding import REPEAT_LAST, PaddingPolicy, PlanInvariantError, check, compose, get_policy

CFG = fg.RunnerConfig(max_num_seqs=8, max_num_tokens=64, max_model_len=128, block_size=16, num_blocks=40)


def make_plan():
    chunks = [fg.SeqChunk([1, 2, 3], 14, [1, 2]), fg.SeqChunk([4], 20, [3, 4]), fg.SeqChunk([5] * 9, 0, [5])]
    return fg.plan_step(chunks, CFG, get_policy("sdpa"))


def test_registry_lists_builtin_policies():
    assert {"sdpa", "blocksparse"} <= set(fg.padding.available())
    assert get_policy("sdpa").tail("query_start_loc") == REPEAT_LAST
    with pytest.raises(ValueError, match="no padding policy named 'nope'"):
        get_policy("nope")


def test_register_refuses_a_different_policy_under_a_taken_name():
    with pytest.raises(ValueError, match="already registered"):
        fg.padding.register_policy(PaddingPolicy("sdpa", reads=frozenset({"seq_lens"})))


def test_policy_validation():
    with pytest.raises(ValueError, match="unknown metadata fields"):
        PaddingPolicy("x", reads=frozenset({"cu_seqlens"}))
    with pytest.raises(ValueError, match="graph_steps"):
        PaddingPolicy("x", reads=frozenset(), graph_steps=frozenset({"prefill"}))
    with pytest.raises(ValueError, match="must be an int"):
        PaddingPolicy("x", reads=frozenset(), tails={"seq_lens": "zero"})


def test_compose_unites_reads_and_intersects_graph_support():
    a = PaddingPolicy("a", reads=frozenset({"seq_lens"}), graph_steps=frozenset({"decode", "mixed"}))
    b = PaddingPolicy("b", reads=frozenset({"block_table"}), graph_steps=frozenset({"decode"}))
    c = compose(a, b)
    assert c.reads == {"seq_lens", "block_table"} and c.graph_steps == {"decode"}
    assert c.name == "a+b" and not c.allows_graph(decode_only=False)


def test_compose_conflict_names_both_policies_and_the_field():
    a = PaddingPolicy("zero_len", reads=frozenset({"seq_lens"}), tails={"seq_lens": 0})
    b = PaddingPolicy("one_len", reads=frozenset({"seq_lens"}), tails={"seq_lens": 1})
    with pytest.raises(ValueError, match="'zero_len' and 'one_len' conflict on seq_lens"):
        compose(a, b)


def test_compose_ignores_tails_of_fields_a_policy_does_not_read():
    a = PaddingPolicy("a", reads=frozenset({"seq_lens"}), tails={"seq_lens": 0})
    b = PaddingPolicy("b", reads=frozenset({"block_table"}), tails={"seq_lens": 1})
    assert compose(a, b).tail("seq_lens") == 0


@pytest.mark.parametrize("seed", range(20))
def test_compose_takes_each_tail_from_the_policies_that_read_the_field(seed):
    """Random policies whose readers of a field agree on its tail while non-readers declare other
    tails: both orders of compose give the readers' tail (the default where none reads it). A
    "first wins" or "last wins" compose that listened to non-readers fails this."""
    rng = np.random.default_rng(seed)
    fields = list(fg.padding.METADATA_FIELDS)
    agreed = {f: int(rng.integers(1, 100)) for f in fields}
    policies = []
    for i in range(3):
        reads = frozenset(rng.choice(fields, rng.integers(0, 4), replace=False).tolist())
        tails = {f: agreed[f] if f in reads else -int(rng.integers(1, 100))
                 for f in fields if f in reads or rng.random() < 0.7}
        steps = frozenset(rng.choice(["mixed", "decode"], rng.integers(1, 3), replace=False).tolist())
        policies.append(PaddingPolicy(f"p{i}", reads=reads, tails=tails, graph_steps=steps))
    one, two = compose(*policies), compose(*policies[::-1])
    assert one.reads == two.reads and one.graph_steps == two.graph_steps and dict(one.tails) == dict(two.tails)
    for f in fields:
        expected = agreed[f] if any(f in p.reads for p in policies) else fg.padding.DEFAULT_TAILS[f]
        assert one.tail(f) == expected, (f, [(p.name, sorted(p.reads), dict(p.tails)) for p in policies])


def broken(plan, name, index, value):
    arr = getattr(plan, name).copy()
    arr[index] = value
    return plan.replace(**{name: arr})


BREAKS = [
    ("query_start_loc", -1, -1, "query_start_loc"),       # the -1 tail that broke FlashAttention
    ("query_start_loc", 0, 1, "query_start_loc"),
    ("seq_start_loc", 2, 0, "seq_start_loc"),
    ("seq_start_loc", -1, 999, "seq_start_loc"),
    ("seq_lens", -1, 5, "seq_lens"),
    ("slot_mapping", -1, 17, "slot_mapping"),               # padding that would write the cache
    ("slot_mapping", 1, 16 * 1 + 14, "slot_mapping"),       # a real slot written twice
    ("slot_mapping", 0, 3, "slot_mapping"),                 # a slot in the null block
    ("slot_mapping", 0, 40 * 16, "slot_mapping"),           # outside the cache
    ("block_table", (3, 0), 7, "block_table"),              # a padded row off the null block
    ("block_table", (0, 0), 40, "block_table"),
    ("logits_indices", 1, 0, "logits_indices"),
    ("input_ids", -1, 7, "input_ids"),
    ("positions", -1, 7, "positions"),
]


@pytest.mark.parametrize("name,index,value,field", BREAKS)
def test_check_reports_field_index_and_value(name, index, value, field):
    plan = make_plan()
    policy = get_policy("sdpa")
    check(plan, policy)
    with pytest.raises(PlanInvariantError) as err:
        check(broken(plan, name, index, value), policy)
    assert err.value.field == field and field in str(err.value)


def test_a_minus_one_policy_builds_a_plan_that_check_rejects():
    bad = PaddingPolicy("minus_one", reads=frozenset({"query_start_loc"}), tails={"query_start_loc": -1})
    plan = fg.plan_step([fg.SeqChunk([1, 2, 3], 0, [1])], CFG, bad)
    assert plan.query_start_loc[-1] == -1
    with pytest.raises(PlanInvariantError, match="non-decreasing"):
        check(plan, bad)
