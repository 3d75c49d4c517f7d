"""What runs in the next step: requests, their queues, and chunked prefill under a token budget.

A step of the engine is one forward pass over a packed batch of *pieces*: a piece is a run of consecutive
tokens of one request, `start ... end - 1`. Two kinds share a step:

- a **decode** piece, one token: the token a running request generated last, fed back;
- a **prefill chunk**: the next tokens of a request's prompt not yet in its caches.

The step has a *token budget*: the tokens it may process in all. Decodes go first (each running request's
next token should not wait behind someone else's long prompt); what is left of the budget goes to prefill
chunks, oldest request first. A prompt longer than what is left is cut: its first chunk now, the rest in the
next steps, beside the decodes of the requests already running (chunked prefill). So a long tool output
arriving never stalls the others for more than one budget's worth of tokens per step.

Requests wait in a queue until the engine admits them (it needs a state slot and enough free blocks for the
whole request; `kda_edu.models.serving.engine`), then run until they finish.
"""

from collections import deque
from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    """One request: its prompt, what it generated, and where its caches are.

    Attributes:
        id: its number, given by the engine.
        prompt: token ids.
        max_new_tokens: tokens to generate at most.
        eos_token_id: a token that finishes the request when generated, or None.
        keep_logits: keep the logits of every generated token in `logits`.
        output: the generated token ids.
        logits: the logits `[vocab]` each generated token was picked from (with `keep_logits`).
        table: its block table (`kda_edu.models.serving.blocks`).
        hashes: the prefix hashes of its full blocks so far.
        slot: its KDA state slot, None while waiting.
        done: tokens whose caches are written (prompt tokens, then fed-back generated tokens).
        cached: prompt tokens taken from the prefix cache instead of computed.
        decode_snapshot: the prefix hash of the last KDA snapshot it took while decoding (it keeps one).
        finished: it generated `max_new_tokens` tokens or `eos_token_id`.
        prompt_hashes: the prefix hashes of the prompt's full blocks, computed once when it is first
            considered for admission (a request that waits is looked up again every step).
    """

    id: int
    prompt: list[int]
    max_new_tokens: int
    eos_token_id: int | None = None
    keep_logits: bool = False
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    slot: int | None = None
    done: int = 0
    cached: int = 0
    decode_snapshot: bytes | None = None
    finished: bool = False

    prompt_hashes: list[bytes] | None = None

    @property
    def tokens(self) -> list[int]:
        """The prompt followed by the generated tokens (a new list: `tokens_between` reads a part of it
        without copying the whole history)."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """len(prompt) + len(output)."""
        return len(self.prompt) + len(self.output)

    def tokens_between(self, start: int, end: int) -> list[int]:
        """`tokens[start:end]`, copying only those tokens (a long history is read every step)."""
        P = len(self.prompt)
        if end <= P:
            return self.prompt[start:end]
        if start >= P:
            return self.output[start - P : end - P]
        return self.prompt[start:] + self.output[: end - P]

    @property
    def prefilling(self) -> bool:
        """Part of its prompt is not in its caches yet."""
        return self.done < len(self.prompt)


class Scheduler:
    """The waiting queue, the running list, and the choice of each step's pieces.

    Args:
        token_budget: tokens one step processes at most (decodes and prefill chunks together).
    """

    def __init__(self, token_budget: int):
        self.token_budget = token_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def schedule(self) -> list[tuple[Request, int, int]]:
        """The next step's pieces `(request, start, end)`: one decode token per running request that has
        finished its prompt, then prefill chunks of the others in the order they were admitted, until the
        budget is spent."""
        pieces, budget = [], self.token_budget
        for r in self.running:
            if not r.prefilling and budget > 0:
                pieces.append((r, r.done, r.done + 1))
                budget -= 1
        for r in self.running:
            if r.prefilling and budget > 0:
                n = min(len(r.prompt) - r.done, budget)
                pieces.append((r, r.done, r.done + n))
                budget -= n
        return pieces
