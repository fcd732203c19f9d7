"""The OpenAI sampling fields the simulated engines honour as vLLM does: ``n``, ``logprobs``
(completions: an int; chat: ``logprobs`` + ``top_logprobs``) and ``echo`` (completions).

**Choices.** The engine model runs one request per HTTP request — one prefill, one token
per step — and the ``n`` choices are ``n`` views of that stream: at every step each choice
gets a token of its own (its id derived from the step's token and the choice's index). So
the first token comes when it does for ``n`` = 1 (vLLM shares the prompt's blocks between
the choices, prefilled once) and, a simplification of the simulator, the extra choices
cost no decode work either: the model's batch counts the request once. Usage counts every
choice's tokens. Streamed, every event carries one choice; each chat choice opens with a
``role: "assistant"`` delta (at the first token, as vLLM sends it) and each choice ends with
its own ``finish_reason``.

**Logprobs.** The simulator has no distribution: a token's logprob and its alternatives are
drawn from a generator seeded by (``seed``, choice, position, token), so the same request
says the same numbers. They are plausible: the sampled token is the most likely, the
alternatives' probabilities decrease and all of them sum to less than 1. Completions get
``tokens``, ``token_logprobs``, ``top_logprobs`` (the sampled token and ``logprobs``
alternatives, vLLM's k + 1) and ``text_offset``; chat gets ``content[]`` of ``token``,
``logprob``, ``bytes`` and ``top_logprobs`` (``top_logprobs`` entries, the sampled first).

**Echo.** The prompt's text is prepended to every choice's text (streamed: to its first
event), as vLLM does; with logprobs, the prompt's tokens come first (the first with a null
logprob, as vLLM says it). A text prompt is echoed as sent; a token-id prompt as the
simulator's tokenizer renders ids (``decode_one``: `` t<id>`` per token — the simulator has
no vocabulary to decode with).

What the simulator cannot honour is refused with a 400 naming the field (:class:`FieldError`):
``best_of`` other than ``n``, ``use_beam_search``, ``prompt_logprobs``, ``echo`` on chat, and
values out of range (``n`` up to 128, as the router takes it; logprobs up to 20, vLLM's
default ``--max-logprobs``).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from foretoken.core.tokenizer import SimTokenizer

MAX_N = 128
MAX_LOGPROBS = 20
# A choice's token id: the step's token + index × this (a prime), modulo the vocabulary.
CHOICE_STRIDE = 7919
# The tokenizer's pieces (foretoken.core.tokenizer): one per token id of a text prompt.
_PIECE = re.compile(r"\s*+(?:\w++|[^\w\s])")
_PROMPT_CHOICE = -1  # the prompt's logprobs are drawn once, for every choice


class FieldError(ValueError):
    """A request field the simulated engine refuses (a 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Sampling:
    n: int = 1
    # alternatives asked for per token (completions' ``logprobs``, chat's ``top_logprobs``);
    # None: no logprobs
    logprobs: int | None = None
    echo: bool = False
    seed: int = 0


def _int(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(f"{name} must be an integer", name)
    if not low <= value <= high:
        raise FieldError(f"{name} must be between {low} and {high}, not {value}", name)
    return value


def _bool(body: Mapping[str, Any], name: str, what: str = "") -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise FieldError(f"{name} must be a boolean{what}", name)
    return bool(value)


def parse_sampling(body: Mapping[str, Any], chat: bool) -> Sampling:
    """The sampling fields of a request body, or :class:`FieldError`."""
    n = _int(body, "n", 1, MAX_N) or 1
    best_of = _int(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != n:
        raise FieldError("best_of other than n is not supported by the simulated engine",
                         "best_of")  # fmt: skip
    if _bool(body, "use_beam_search"):
        raise FieldError("use_beam_search is not supported by the simulated engine",
                         "use_beam_search")  # fmt: skip
    if body.get("prompt_logprobs") is not None:
        raise FieldError("prompt_logprobs is not supported by the simulated engine "
                         "(completions: echo with logprobs gives the prompt's)",
                         "prompt_logprobs")  # fmt: skip
    echo = _bool(body, "echo")
    if echo and chat:
        raise FieldError("echo is not supported for chat completions by the simulated engine",
                         "echo")  # fmt: skip
    if chat:
        wanted = _bool(body, "logprobs", " for chat completions")
        top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top and not wanted:
            raise FieldError("when using top_logprobs, logprobs must be set to true",
                             "top_logprobs")  # fmt: skip
        logprobs = (top or 0) if wanted else None
    else:
        logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    seed = body.get("seed")
    seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else 0
    return Sampling(n=n, logprobs=logprobs, echo=echo, seed=seed)


@dataclass(frozen=True, slots=True)
class Echo:
    """A prompt as echoed: its text and its tokens' (text, offset in the text)."""

    text: str
    pieces: tuple[tuple[str, int], ...]


def prompt_echo(tokenizer: SimTokenizer, prompt: Any, token_ids: list[int]) -> Echo:
    """The echo of a completion's prompt: a text as sent, token ids as ``decode_one`` says
    them."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        found = [(m.group(), m.start()) for m in _PIECE.finditer(prompt)]
        if len(found) == len(token_ids):
            return Echo(prompt, tuple(found))
    texts = [tokenizer.decode_one(t) for t in token_ids]
    offsets = [0]
    for t in texts[:-1]:
        offsets.append(offsets[-1] + len(t))
    return Echo("".join(texts), tuple(zip(texts, offsets, strict=True)))


@dataclass
class _Choice:
    index: int
    chars: int = 0  # text so far, echo included (completions' text_offset)
    tokens: int = 0
    opened: bool = False
    text: list[str] = field(default_factory=list)
    logprobs: dict[str, list[Any]] = field(default_factory=dict)


class Answer:
    """One request's choices, fed one engine token at a time: the streamed choice objects
    of each step, and (``collect``) the whole answer's choices at the end."""

    def __init__(self, sampling: Sampling, chat: bool, tokenizer: SimTokenizer,
                 echo: Echo | None = None, *, stream: bool, collect: bool) -> None:  # fmt: skip
        self.sampling, self.chat, self.tokenizer = sampling, chat, tokenizer
        self.echo = echo if sampling.echo else None
        self.stream, self.collect = stream, collect
        self.choices = [_Choice(i) for i in range(sampling.n)]
        self._prompt_logprobs: dict[str, list[Any]] | None = None

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    def step(self, token: int) -> list[dict[str, Any]]:
        """One engine token: each choice's streamed choice object (a chat choice's role
        delta before its first)."""
        out: list[dict[str, Any]] = []
        vocab = self.tokenizer.vocab_size
        for c in self.choices:
            if self.chat and self.stream and not c.opened:
                out.append({"index": c.index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})  # fmt: skip
            own = (token + c.index * CHOICE_STRIDE) % vocab
            text = self.tokenizer.decode_one(own)
            logprobs = self._logprobs(c, own, text)
            if not c.opened and self.echo is not None:
                text = self.echo.text + text
            c.opened = True
            c.chars += len(text)
            c.tokens += 1
            if self.collect:
                c.text.append(text)
                for key, value in (logprobs or {}).items():
                    c.logprobs.setdefault(key, []).extend(value)
            piece = {"delta": {"content": text}} if self.chat else {"text": text}
            out.append({"index": c.index, **piece, "logprobs": logprobs, "finish_reason": None})
        return out

    def finals(self) -> list[dict[str, Any]]:
        """Each choice's last streamed object: its finish reason (the simulator stops at
        ``max_tokens``)."""
        piece: dict[str, Any] = {"delta": {}} if self.chat else {"text": ""}
        return [{"index": c.index, **piece, "logprobs": None, "finish_reason": "length"}
                for c in self.choices]  # fmt: skip

    def whole(self) -> list[dict[str, Any]]:
        """The choices of the non-streamed answer (``collect``)."""
        out = []
        for c in self.choices:
            text = "".join(c.text)
            piece: dict[str, Any] = (
                {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            )
            logprobs = (c.logprobs or None) if self.sampling.logprobs is not None else None
            out.append({"index": c.index, **piece, "logprobs": logprobs, "finish_reason": "length"})
        return out

    # ------------------------------------------------------------------ logprobs

    def _logprobs(self, c: _Choice, token: int, text: str) -> dict[str, list[Any]] | None:
        k = self.sampling.logprobs
        if k is None:
            return None
        logprob, alternatives = self._draw(token, c.index, c.tokens)
        if self.chat:
            top = [(text, logprob)]
            top += [(self.tokenizer.decode_one(t), lp) for t, lp in alternatives[: k - 1]]
            entry = _chat_entry(text, logprob)
            entry["top_logprobs"] = [_chat_entry(t, lp) for t, lp in top[:k]]
            return {"content": [entry]}
        lists: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                       "text_offset": []}  # fmt: skip
        if not c.opened and self.echo is not None:
            for key, value in self._prompt().items():
                lists[key].extend(value)
        offset = c.chars + (len(self.echo.text) if not c.opened and self.echo else 0)
        top_map = {text: logprob}
        for t, lp in alternatives[:k]:
            top_map[self.tokenizer.decode_one(t)] = lp
        lists["tokens"].append(text)
        lists["token_logprobs"].append(logprob)
        lists["top_logprobs"].append(top_map)
        lists["text_offset"].append(offset)
        return lists

    def _prompt(self) -> dict[str, list[Any]]:
        """The echoed prompt's completion logprobs (the first token has none), drawn once."""
        if self._prompt_logprobs is None:
            assert self.echo is not None
            k = self.sampling.logprobs or 0
            out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                         "text_offset": []}  # fmt: skip
            for position, (text, offset) in enumerate(self.echo.pieces):
                out["tokens"].append(text)
                out["text_offset"].append(offset)
                if position == 0:
                    out["token_logprobs"].append(None)
                    out["top_logprobs"].append(None)
                    continue
                token = xxhash.xxh3_64_intdigest(text.encode()) % self.tokenizer.vocab_size
                logprob, alternatives = self._draw(token, _PROMPT_CHOICE, position)
                top_map = {text: logprob}
                for t, lp in alternatives[:k]:
                    top_map[self.tokenizer.decode_one(t)] = lp
                out["token_logprobs"].append(logprob)
                out["top_logprobs"].append(top_map)
            self._prompt_logprobs = out
        return self._prompt_logprobs

    def _draw(
        self, token: int, choice: int, position: int
    ) -> tuple[float, list[tuple[int, float]]]:
        """The sampled token's logprob and ``logprobs`` alternatives (ids distinct from it and
        from each other), most likely first; the probabilities sum below 1."""
        key = f"{self.sampling.seed}:{choice}:{position}:{token}"
        rng = random.Random(xxhash.xxh3_64_intdigest(key.encode()))
        p = 0.35 + 0.64 * rng.random()
        rest = 1.0 - p
        k = self.sampling.logprobs or 0
        vocab = self.tokenizer.vocab_size
        alternatives = []
        for j in range(k):
            q = rest * 0.5 ** (j + 1) * (0.5 + 0.5 * rng.random())
            alternatives.append(((token + 1 + j) % vocab, math.log(q)))
        return math.log(p), alternatives


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
