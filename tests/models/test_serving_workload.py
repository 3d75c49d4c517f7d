"""Replaying agent sessions through the engine: each turn's prompt is the session's history with the replies
the engine generated, every turn is recorded once, and with prefix caching a turn takes from the cache what
its previous turn left there."""

import torch

from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLAConfig
from kda_edu.models.model import HybridConfig, HybridLM
from kda_edu.models.serving import Engine, agent_sessions, replay


def test_replay_records_every_turn_and_feeds_back_the_replies():
    config = HybridConfig(
        vocab_size=40,
        d_model=16,
        n_layers=4,
        kda=KDAConfig(num_heads=2, head_dim=8, chunk_size=8),
        mla=MLAConfig(num_heads=2, kv_rank=12, qk_head_dim=8, v_head_dim=8, rope_head_dim=4),
        init_std=0.3,
    )
    torch.manual_seed(0)
    model = HybridLM(config).eval()
    sessions = agent_sessions(2, vocab_size=40, scale=1 / 256, seed=1, max_turns=3)
    for prefix_cache in (True, False):
        engine = Engine(
            model, block_size=4, num_blocks=400, token_budget=32, max_running=2, prefix_cache=prefix_cache
        )
        result = replay(engine, sessions)
        turns = result["turns"]
        assert sorted((t["agent"], t["turn"]) for t in turns) == [(a, i) for a in range(2) for i in range(3)]
        for session in sessions:
            requests = [
                r
                for r in engine.requests.values()
                if r.prompt[: len(session.system_prompt)] == list(session.system_prompt)
            ]
            replies = [r.output for r in requests]
            assert [r.prompt for r in requests] == [session.prompt(replies[:i]) for i in range(3)]
        assert all(
            t["ttft_s"] > 0 and t["new_tokens"] == sessions[t["agent"]].turns[t["turn"]].max_new_tokens
            for t in turns
        )
        cached = [t["cached_tokens"] for t in turns if t["turn"] > 0]
        assert (min(cached) > 0) if prefix_cache else (max(cached) == 0)
        assert result["generated_tokens"] == sum(t["new_tokens"] for t in turns) and not result["cut_short"]
