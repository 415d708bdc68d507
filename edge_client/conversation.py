"""Multi-turn conversations that keep their KV caches: :class:`Conversation` (``EdgeClient.chat()``).

A conversation's turns run in ONE verifier session: the first turn opens it (OpenSession over the rendered
prompt); each later turn extends it (ExtendSession with only the new tokens: the end of the assistant's turn,
the new user message and the generation prompt, :func:`common.chat.continuation_ids`), so the verifier
prefills only those and keeps the target KV cache of the conversation so far, and the session is not closed
between turns. The edge draft keeps its KV cache too: :class:`edge_client.drafting.drafter.ModelDrafter` keeps the
longest common prefix of what it holds and the committed ids, so a turn feeds the draft only the appended ids.

The committed ids (``history_ids``) are the prompt plus each reply *as generated* (token ids, not re-tokenized
text), which is what both KV caches hold; so turn N's output is token-identical (greedy) to a fresh session over
``history_ids`` of turn N, and a seeded sampled turn equals a fresh session with the same seed (draws depend on
the seed and the absolute position only).

Resilience: when the verifier lost the session between turns (NOT_FOUND after its TTL, an eviction or a restart
with an empty store), or cannot extend it, the turn transparently opens a new session over the whole history
with the same seed (same output), counted in ``last_result.num_reopened_sessions``. A session moved to another
replica is resumed there from the store (Redis keeps the conversation's committed ids), as any session is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from specdec_runtime.common.chat import continuation_ids, message_text, render_chat_ids
from specdec_runtime.common.errors import InvalidRequestError
from specdec_runtime.edge_client.generation.context import GenerationContext
from specdec_runtime.edge_client.generation.loop import KeptSession, close_session, generate
from specdec_runtime.edge_client.request import check_generation_options, generation_params

if TYPE_CHECKING:
    from specdec_runtime.edge_client.generation.run import GenerationResult
    from specdec_runtime.edge_client.output import Chunk

__all__ = ["Conversation"]


class Conversation:
    """A multi-turn chat over one :class:`~edge_client.client.EdgeClient` (see the module docstring).

    Args:
        client: the EdgeClient (its tokenizer must have a chat template for :meth:`send`).
        system: system message of the conversation (None: the template's default, if any).
        **defaults: generation options for every turn (max_new_tokens, temperature, top_k, top_p, seed, stop,
            stop_token_ids, ignore_eos); a turn's own keyword arguments override them.

    Usage::

        with client.chat(system="Be brief.", max_new_tokens=64) as conv:
            for chunk in conv.send("Hi!"):
                print(chunk.text, end="")
            print(conv.last_result.stats.acceptance_rate)

    Not thread-safe: one turn at a time.

    Raises:
        InvalidRequestError: an unknown generation option.
    """

    def __init__(self, client: GenerationContext, system: str | None = None, **defaults):
        check_generation_options({k: v for k, v in defaults.items() if k != "route"})  # route: edge_client.generation.routing
        self.client = client
        self.system = system
        self.defaults = dict(defaults)
        self._keep = KeptSession()
        self._messages: list[dict] = []
        self.history_ids: list[int] = []  # committed prompt + replies so far (token ids both KV caches hold)
        self.last_result: GenerationResult | None = None
        self.reset()

    @property
    def messages(self) -> list[dict]:
        """The conversation as chat messages (``{"role", "content"}``; replies as text, cut at a stop string)."""
        return [dict(m) for m in self._messages]

    @property
    def session_id(self) -> str | None:
        """The verifier session kept for the next turn (None before the first turn or after a failure)."""
        return self._keep.opened.session_id if self._keep.opened is not None else None

    def send(self, message: str, **kwargs) -> Iterator["Chunk"]:
        """Add a user message and stream the assistant's reply (:class:`~edge_client.output.Chunk`); afterwards
        ``last_result`` is its GenerationResult and ``messages``/``history_ids`` include the turn. Keyword
        arguments as :meth:`EdgeClient.stream_chunks` (max_new_tokens, temperature, top_k, top_p, seed, stop,
        stop_token_ids, ignore_eos, route) over the conversation's defaults. Message content is text: special-token
        strings in it stay literal (:mod:`common.chat`).

        Raises:
            InvalidRequestError: an empty message, a tokenizer without a chat template, an unknown option, bad
                parameters; and the errors of :meth:`EdgeClient.stream` (the conversation is then unchanged).
        """
        if not isinstance(message, str) or not message.strip():
            raise InvalidRequestError("empty message")
        tok = self.client.tokenizer
        if not getattr(tok, "chat_template", None):
            raise InvalidRequestError("the tokenizer has no chat template: use send_ids")
        user = {"role": "user", "content": message}
        try:
            if self.history_ids:
                ids = continuation_ids(tok, self.history_ids, [user])
            else:
                ids = render_chat_ids(tok, [*self._messages, user], add_generation_prompt=True)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        yield from self.send_ids(ids, **kwargs)
        self._messages += [user, {"role": "assistant", "content": self.last_result.text}]

    def send_ids(self, appended_token_ids: list[int], **kwargs) -> Iterator["Chunk"]:
        """Token-level :meth:`send`: the first turn's ids are the whole prompt (they open the session), a later
        turn's are appended to ``history_ids`` (they extend the session: only they are prefilled). Streams
        the reply; ``last_result`` and ``history_ids`` are updated once it ends (an interrupted or failed turn
        leaves them unchanged, and the next turn opens a session over the history).

        Raises:
            InvalidRequestError: no ids, an unknown option, bad parameters; the errors of
            :meth:`EdgeClient.stream`.
        """
        appended = [int(t) for t in appended_token_ids]
        if not appended:
            raise InvalidRequestError("no token ids to send")
        kwargs = {**self.defaults, **kwargs}
        route = kwargs.pop("route", None)  # edge_client.generation.routing (None: the client's), not a sampling option
        check_generation_options(kwargs)
        sampling, stopping = generation_params(**kwargs)
        prompt_ids = self.history_ids + appended
        if not self.history_ids:
            self._close_kept()  # a fresh conversation (after reset) never extends an old session
        yield from generate(self.client, prompt_ids, sampling, stopping, keep=self._keep, route=route)
        self.last_result = self.client.last_result
        self.history_ids = prompt_ids + list(self.last_result.token_ids)

    def reset(self) -> None:
        """Start over (the system message stays); the kept verifier session is closed."""
        self._close_kept()
        self._messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        if self.system is not None:
            message_text(self._messages[0])  # a bad type fails here, not at the first turn
        self.history_ids = []
        self.last_result = None

    def close(self) -> None:
        """Close the kept verifier session (the conversation can go on: the next turn opens a new one)."""
        self._close_kept()

    def _close_kept(self) -> None:
        opened, self._keep.opened = self._keep.opened, None
        if opened is not None:
            close_session(self.client, opened.session_id)

    def __enter__(self) -> "Conversation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
