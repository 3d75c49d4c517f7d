"""A seeded agent workload for the serving engine: sessions of turns over a growing history.

An agent talks to a model in turns. It starts from a long system prompt (instructions, tool descriptions), and
every turn it appends what a tool returned (a file, a search result, a test log: often thousands of tokens) to
its history and asks the model for a short reply (the next tool call). The request of turn i is the *whole*
history so far:

    prompt_i = system + tool_0 + reply_0 + tool_1 + reply_1 + ... + tool_i

so `prompt_{i+1}` starts with `prompt_i + reply_i`. That shared head is what prefix caching reuses
(`kda_edu.models.serving.engine`): without it, every turn computes the whole history again.

`agent_sessions` draws such sessions: for each agent a system prompt of `history[0]` tokens, then turns while
the history, with the turn's reply, stays within `history[1]` tokens. Turn i draws a tool output length in
`tool_tokens` and a reply length in `new_tokens` (both inclusive, uniform), then the tool output's token ids,
uniform in `[0, vocab_size)`. The replies themselves are the model's (greedy, exactly `max_new_tokens`
tokens), so a session stores the tool outputs and reply lengths, and `AgentSession.prompt` assembles a turn's
prompt from the replies so far.

**One scale.** Every length is multiplied by `scale` (rounded, at least 1): the defaults are an agent's
numbers (history from 8K to 128K tokens, tool outputs of 1K-8K, replies of 128-512), `scale=1/256` the same
shape at a size a CPU replays in seconds.

**Replaying.** `replay(engine, sessions)` plays the sessions through an `Engine` as concurrent agents do: every
agent's first turn at the start, its next turn right after the step that finished its reply. It records each
turn's time to first token and the prompt tokens the prefix cache supplied.

**Seeds.** Agent a's draws come from a generator seeded with `(seed, a)` only, so a session does not depend
on how many agents are drawn beside it, and the same seed always gives the same sessions.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class AgentTurn:
    """One turn: the tool output appended to the history, and the reply's length.

    Attributes:
        tool_output: token ids appended to the history before the request.
        max_new_tokens: tokens the model generates for this turn.
    """

    tool_output: tuple[int, ...]
    max_new_tokens: int


@dataclass(frozen=True)
class AgentSession:
    """One agent's session: its system prompt and its turns.

    Attributes:
        agent: the agent's number.
        system_prompt: token ids the history starts with.
        turns: the turns, in order.
    """

    agent: int
    system_prompt: tuple[int, ...]
    turns: tuple[AgentTurn, ...]

    def prompt(self, replies: Sequence[Sequence[int]]) -> list[int]:
        """The prompt of turn `len(replies)`: the system prompt, every earlier turn's tool output and reply,
        then this turn's tool output.

        Args:
            replies: the model's replies to the earlier turns, in order; reply j must hold
                `turns[j].max_new_tokens` token ids.

        Raises:
            ValueError: more replies than turns before the last one, or a reply of the wrong length.
        """
        i = len(replies)
        if i >= len(self.turns):
            raise ValueError(
                f"replies must number fewer than the session's {len(self.turns)} turns, got {i} replies"
            )
        history = list(self.system_prompt)
        for j, (turn, reply) in enumerate(zip(self.turns, replies, strict=False)):
            if len(reply) != turn.max_new_tokens:
                raise ValueError(
                    f"replies[{j}] must hold turns[{j}].max_new_tokens = {turn.max_new_tokens} tokens, "
                    f"got {len(reply)}"
                )
            history += turn.tool_output
            history += reply
        return history + list(self.turns[i].tool_output)

    @property
    def history_tokens(self) -> int:
        """Tokens of the whole history after the last reply."""
        return len(self.system_prompt) + sum(len(t.tool_output) + t.max_new_tokens for t in self.turns)


def _scaled(value: int, scale: float) -> int:
    return max(1, round(value * scale))


def _length_range(name: str, value) -> tuple[int, int]:
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        or not 1 <= value[0] <= value[1]
    ):
        raise ValueError(f"{name} must be a pair of ints (low, high) with 1 <= low <= high, got {value!r}")
    return value[0], value[1]


def agent_sessions(
    num_agents: int = 16,
    *,
    vocab_size: int,
    scale: float = 1.0,
    seed: int = 0,
    history: tuple[int, int] = (8192, 131072),
    tool_tokens: tuple[int, int] = (1024, 8192),
    new_tokens: tuple[int, int] = (128, 512),
    max_turns: int | None = None,
) -> list[AgentSession]:
    """Draw `num_agents` agent sessions (see the module's docstring).

    Args:
        num_agents: agents, >= 1.
        vocab_size: token ids are drawn in `[0, vocab_size)`.
        scale: multiplies every length below (each rounded, at least 1); > 0.
        seed: seeds every agent's generator (with the agent's number), >= 0.
        history: (system prompt tokens, most tokens of a history with its last reply).
        tool_tokens: (least, most) tokens of a tool output.
        new_tokens: (least, most) tokens of a reply.
        max_turns: at most this many turns per agent; None: until the history is full.

    Returns:
        The sessions, agent 0 first. Every session has at least one turn: the first turn's tool output and
        reply are cut to fit when the system prompt leaves less room than they drew.

    Raises:
        ValueError: a bad argument, or a history too short for the system prompt and one token of tool output
            and one of reply.
    """
    for name, value in (("num_agents", num_agents), ("vocab_size", vocab_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a number > 0, got {scale!r}")
    if max_turns is not None and (
        isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1
    ):
        raise ValueError(f"max_turns must be None or an int >= 1, got {max_turns!r}")
    system, limit = (_scaled(v, scale) for v in _length_range("history", history))
    tool_lo, tool_hi = (_scaled(v, scale) for v in _length_range("tool_tokens", tool_tokens))
    new_lo, new_hi = (_scaled(v, scale) for v in _length_range("new_tokens", new_tokens))
    if limit < system + 2:
        raise ValueError(
            f"history = {history} at scale {scale} leaves {limit - system} tokens after the system prompt of "
            f"{system}; one turn needs at least 2 (one of tool output, one of reply)"
        )
    sessions = []
    for agent in range(num_agents):
        rng = np.random.default_rng([seed, agent])
        prompt = tuple(rng.integers(0, vocab_size, system).tolist())
        length, turns = system, []
        while max_turns is None or len(turns) < max_turns:
            tool = int(rng.integers(tool_lo, tool_hi + 1))
            new = int(rng.integers(new_lo, new_hi + 1))
            if length + tool + new > limit:
                if turns:
                    break
                room = limit - length  # the first turn is cut to fit: every session has one
                new = min(new, room - 1)
                tool = min(tool, room - new)
            turns.append(AgentTurn(tuple(rng.integers(0, vocab_size, tool).tolist()), new))
            length += tool + new
        sessions.append(AgentSession(agent, prompt, tuple(turns)))
    return sessions


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def replay(
    engine,
    sessions: list[AgentSession],
    device: torch.device | None = None,
    time_limit_s: float | None = None,
) -> dict:
    """Replay the sessions through `engine` (an `Engine`), each agent's next turn added when its reply is done.

    All agents' first turns are added at the start; an agent's next turn right after the step that finished
    its previous one (its prompt holds the reply the engine generated). On a CUDA `device` each step is
    synchronised before the clock is read. With `time_limit_s`, no new turn starts after that many seconds.

    Returns the per-turn records (agent, turn, prompt tokens, cached tokens, generated tokens, TTFT in
    seconds), the wall time, the generated tokens, whether the time limit stopped new turns, and the most
    blocks held by requests and KDA snapshots kept after any step."""
    replies: list[list[list[int]]] = [[] for _ in sessions]
    owner, turn_of, added, first = {}, {}, {}, {}
    cut_short, peak_blocks, peak_snapshots = False, 0, 0

    def add(agent: int) -> None:
        session = sessions[agent]
        turn = session.turns[len(replies[agent])]
        rid = engine.add_request(session.prompt(replies[agent]), turn.max_new_tokens)
        owner[rid], turn_of[rid] = agent, len(replies[agent])
        added[rid] = time.perf_counter()

    _sync(device)
    start = time.perf_counter()
    for agent in range(len(sessions)):
        add(agent)
    while engine.has_work():
        new_tokens = engine.step()
        _sync(device)
        now = time.perf_counter()
        peak_blocks = max(peak_blocks, engine.blocks.in_use())
        peak_snapshots = max(peak_snapshots, len(engine.kda.snapshots))
        for rid in new_tokens:
            request = engine.requests[rid]
            if len(request.output) == 1:
                first[rid] = now - added[rid]
            if request.finished:
                agent = owner[rid]
                replies[agent].append(request.output)
                if time_limit_s is not None and now - start > time_limit_s:
                    cut_short |= len(replies[agent]) < len(sessions[agent].turns)
                elif len(replies[agent]) < len(sessions[agent].turns):
                    add(agent)
    wall = time.perf_counter() - start
    turns = [
        dict(
            agent=owner[rid],
            turn=turn_of[rid],
            prompt_tokens=len(engine.requests[rid].prompt),
            cached_tokens=engine.requests[rid].cached,
            new_tokens=len(engine.requests[rid].output),
            ttft_s=first[rid],
        )
        for rid in sorted(owner)
    ]
    generated = sum(t["new_tokens"] for t in turns)
    return dict(
        turns=turns,
        wall_s=wall,
        generated_tokens=generated,
        cut_short=cut_short,
        peak_blocks_in_use=peak_blocks,
        peak_snapshots=peak_snapshots,
    )
