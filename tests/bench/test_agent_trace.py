"""The agent workload and its benchmark driver: the sessions are seeded and shaped as documented (each turn's
prompt is the previous prompt, its reply and a new tool output), and the driver replays them at a tiny size on
the CPU into a result with six runs whose prefix-cache hit rates show the cache at work."""

import json

import pytest

from bench.serving.agent_trace import main, percentile, prompt_lengths
from kda_edu.models.serving import AgentSession, agent_sessions

SCALE = 1 / 256  # history 32 -> 512 tokens, tool outputs 4-32, replies 1-2


def fake_replies(session: AgentSession, n: int) -> list[list[int]]:
    return [[(7 * i + j) % 50 for j in range(t.max_new_tokens)] for i, t in enumerate(session.turns[:n])]


def test_sessions_are_deterministic_per_seed_and_agent():
    a = agent_sessions(3, vocab_size=50, scale=SCALE, seed=4)
    assert a == agent_sessions(3, vocab_size=50, scale=SCALE, seed=4)
    assert a[:2] == agent_sessions(2, vocab_size=50, scale=SCALE, seed=4)  # agent a's draws are its own
    other = agent_sessions(3, vocab_size=50, scale=SCALE, seed=5)
    assert all(
        x.system_prompt != y.system_prompt and x.turns != y.turns for x, y in zip(a, other, strict=True)
    )
    assert a[0].turns != a[1].turns and a[0].system_prompt != a[1].system_prompt


@pytest.mark.parametrize("scale", [SCALE, 1 / 64])
def test_lengths_ids_and_the_history_limit_follow_the_scale(scale):
    sessions = agent_sessions(4, vocab_size=50, scale=scale, seed=0)
    system, limit = round(8192 * scale), round(131072 * scale)
    tool_lo, tool_hi = max(1, round(1024 * scale)), round(8192 * scale)
    new_lo, new_hi = max(1, round(128 * scale)), round(512 * scale)
    tools, news = [], []
    for i, s in enumerate(sessions):
        assert s.agent == i and len(s.system_prompt) == system
        tools += [len(t.tool_output) for t in s.turns]
        news += [t.max_new_tokens for t in s.turns]
        ids = list(s.system_prompt) + [x for t in s.turns for x in t.tool_output]
        assert all(isinstance(x, int) and 0 <= x < 50 for x in ids)
        assert s.history_tokens <= limit  # the history stays within the limit...
        assert s.history_tokens + tool_hi + new_hi > limit  # ...and stops only when the next turn may not fit
    assert min(tools) >= tool_lo and max(tools) <= tool_hi and min(news) >= new_lo and max(news) <= new_hi
    assert len(set(tools)) > 3  # drawn, not fixed
    assert [len(s.turns) for s in agent_sessions(4, vocab_size=50, scale=scale, max_turns=3)] == [3] * 4


def test_each_prompt_extends_the_previous_prompt_and_its_reply():
    (session,) = agent_sessions(1, vocab_size=50, scale=SCALE, seed=2)
    assert len(session.turns) > 5
    replies = fake_replies(session, len(session.turns))
    assert session.prompt([]) == list(session.system_prompt + session.turns[0].tool_output)
    for i in range(1, len(session.turns)):
        before, now = session.prompt(replies[: i - 1]), session.prompt(replies[:i])
        assert now == before + replies[i - 1] + list(session.turns[i].tool_output)
    total = sum(len(session.prompt(replies[:i])) for i in range(len(session.turns)))
    assert prompt_lengths(session) == total
    assert len(now) + session.turns[-1].max_new_tokens == session.history_tokens


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_agents must be an int >= 1"):
        agent_sessions(0, vocab_size=50)
    with pytest.raises(ValueError, match="vocab_size must be an int >= 1"):
        agent_sessions(2, vocab_size=0)
    with pytest.raises(ValueError, match="scale must be a number > 0"):
        agent_sessions(2, vocab_size=50, scale=0)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        agent_sessions(2, vocab_size=50, seed=-1)
    with pytest.raises(ValueError, match="tool_tokens must be a pair"):
        agent_sessions(2, vocab_size=50, tool_tokens=(8, 4))
    with pytest.raises(ValueError, match="max_turns must be None or an int >= 1"):
        agent_sessions(2, vocab_size=50, max_turns=0)
    with pytest.raises(ValueError, match="one turn needs at least 2"):
        agent_sessions(2, vocab_size=50, history=(100, 101))
    (session,) = agent_sessions(1, vocab_size=50, scale=SCALE, max_turns=2)
    with pytest.raises(ValueError, match="replies must number fewer than"):
        session.prompt(fake_replies(session, 2))
    with pytest.raises(ValueError, match=r"replies\[0\] must hold"):
        session.prompt([fake_replies(session, 1)[0] + [3]])


def test_percentile_interpolates_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5 and percentile([5.0, 1.0], 90) == pytest.approx(4.6)


def test_driver_writes_six_runs_and_prefix_caching_hits(tmp_path):
    result = main(["--out", str(tmp_path), "--agents", "2", "--max-turns", "4"])
    assert json.loads((tmp_path / "agent_trace_cpu.json").read_text()) == result
    runs = result["runs"]
    assert sorted((r["model"], r["prefix_cache"]) for r in runs) == sorted(
        (m, c) for m in ("hybrid", "mla", "kda") for c in (True, False)
    )
    assert len({r["parameters"] for r in runs}) == 3  # equal width, different mixers
    prompts = result["workload"]["prompt_tokens"]
    for r in runs:
        assert r["turns_done"] == 8 and not r["cut_short"] and r["peak_memory_bytes"] is None
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] and r["wall_s"] > 0
        assert r["generated_tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["wall_s"])
        assert sum(t["prompt_tokens"] for t in r["turns"]) == prompts  # every turn sent its whole history
        for agent in (0, 1):
            assert [t["turn"] for t in r["turns"] if t["agent"] == agent] == [0, 1, 2, 3]
        later = [t["cached_tokens"] for t in r["turns"] if t["turn"] > 0]
        assert all(c > 0 for c in later) if r["prefix_cache"] else not any(later)
    for model in ("hybrid", "mla", "kda"):
        on, off = (
            next(r for r in runs if r["model"] == model and r["prefix_cache"] == c) for c in (True, False)
        )
        assert off["hit_rate"] == 0 and on["hit_rate"] > 0.3
        assert on["engine"]["prefill_tokens"] < off["engine"]["prefill_tokens"] == prompts
        assert on["generated_tokens"] == off["generated_tokens"]


def test_merge_keeps_the_runs_a_call_does_not_redo_and_refuses_another_workload(tmp_path):
    small = ["--out", str(tmp_path), "--agents", "2", "--max-turns", "2", "--models", "mla"]
    main(small + ["--prefix-cache", "on"])
    result = main(small + ["--prefix-cache", "off", "--merge"])
    assert [(r["model"], r["prefix_cache"]) for r in result["runs"]] == [("mla", True), ("mla", False)]
    again = main(small + ["--prefix-cache", "on", "--merge"])  # redone: replaced, not doubled
    assert [(r["model"], r["prefix_cache"]) for r in again["runs"]] == [("mla", False), ("mla", True)]
    with pytest.raises(ValueError, match="--merge: .* has workload"):
        main(small[:3] + ["3"] + small[4:] + ["--merge"])


def test_a_short_history_still_gets_one_turn_cut_to_fit():
    """A system prompt of 10 tokens in a history of 14: the first turn draws 8 + 4 tokens and is cut to
    1 + 3; any later turn would not fit."""
    sessions = agent_sessions(3, vocab_size=50, history=(10, 14), tool_tokens=(8, 8), new_tokens=(4, 4))
    for s in sessions:
        assert [(len(t.tool_output), t.max_new_tokens) for t in s.turns] == [(1, 3)]
        assert s.history_tokens == 14


def test_a_time_limit_stops_new_turns_and_says_so(tmp_path):
    args = ["--out", str(tmp_path), "--agents", "3", "--max-turns", "3", "--models", "mla"]
    result = main(args + ["--prefix-cache", "on", "--time-limit-s", "0"])
    (run,) = result["runs"]
    assert run["cut_short"] and run["turns_done"] == 3 and {t["turn"] for t in run["turns"]} == {0}
